"""Layer 1, `format`: what a checkpoint is on disk, with no I/O of its own.

Holds: tag and item names and the one "newest" order (names), the manifest and
rank-marker records with their seal, and an item's bytes checked against its entry
(manifest), JSON read bounded in size and nesting (jsonbounds), checksum algorithms and
their names (checksum), torch's zip format: the layout of a file, planned without its data
(torchzip), items written and read under an allowlist (serialization, allowlist), and an
item's tensor metadata read without running a pickle (inert_unpickler, item_metadata).

May import: `nebulaml.errors`, `nebulaml._version` and this package. Not for: files,
stores or sessions (every layer above).
"""
