"""Layer 2, `storage`: one `Store` per checkpoint root, the only code that touches files.

Holds: the `Store` facade (store), which picks a backend for each root and delegates to
it; the operations every backend implements (backend); the backends: local disks and the
memory tier (local, with mapped_reads for loads), any fsspec store (remote), and Azure
Blob Storage (azure, which connects through azure_auth's credentials and writes a blob
range by range through azure_ranges); and the boundary's
plumbing: error translation and file streams (streams), retries (retry) and secret
redaction (redaction).

May import: `nebulaml.errors`, `nebulaml.config` and `nebulaml.format`. Not for: what a
checkpoint is (protocol) or when anything is written (runtime).
"""

from nebulaml.storage.store import LocalRead, Store, using_storage_options
from nebulaml.storage.streams import MissingFileError

__all__ = ["LocalRead", "MissingFileError", "Store", "using_storage_options"]
