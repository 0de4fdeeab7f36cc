"""Layer 1, `format`: what a checkpoint is on disk, with no I/O of its own.

Holds: tag and item names (names), the manifest and rank-marker records with their seal
(manifest), checksum algorithms (checksum), torch's zip format and pickles read under
an allowlist (serialization, allowlist, torchzip), and an item's tensor metadata read
without running a pickle (item_metadata).

May import: `nebulaml.errors`, `nebulaml._version` and this package. Not for: files,
stores or sessions (every layer above).
"""
