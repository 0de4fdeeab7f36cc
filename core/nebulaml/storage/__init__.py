"""Layer 2, `storage`: one `Store` per checkpoint root, the only code that touches files.

Holds: the `Store` facade (store), its error translation and file streams (streams),
retries (retry), secret redaction (redaction), and Azure's credentials and blob calls
(azure_auth, azure_blob).

May import: `nebulaml.errors` and `nebulaml.format`. Not for: what a checkpoint is
(protocol) or when anything is written (runtime).
"""

from nebulaml.storage.store import LocalRead, Store, using_storage_options
from nebulaml.storage.streams import MissingFileError

__all__ = ["LocalRead", "MissingFileError", "Store", "using_storage_options"]
