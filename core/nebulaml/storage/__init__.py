"""Layer 2, `storage`: one `Store` per checkpoint root, the only code that touches files.

Holds: the `Store` facade (store), which opens each root with the backend registered for
its protocol and delegates to it; the operations every backend implements and the
capabilities it declares (backend); the registration point, `register_backend` and the
`nebulaml.backends` entry points (registry), and nebula's own registrations (builtins);
the backends: local disks and the memory tier (local, which writes through local_files
and reads through mapped_reads), any fsspec store (remote), S3 (s3), and Azure Blob
Storage (azure, which connects through azure_auth's credentials and writes a blob range by
range through azure_ranges); the probe of a persistent root's atomic create, once per
root and process (atomic_probe); and the
boundary's plumbing: error translation (failures), a network store's file streams
(remote_streams), a view written in pieces while hashed (view_writes), retries (retry), a
deadline on every call (deadline) and secret redaction (redaction).

May import: `nebulaml.errors`, `nebulaml.config` and `nebulaml.format`. Not for: what a
checkpoint is (protocol) or when anything is written (runtime).
"""

from nebulaml.storage.failures import MissingFileError
from nebulaml.storage.store import LocalRead, Store, using_storage_options

__all__ = ["LocalRead", "MissingFileError", "Store", "using_storage_options"]
