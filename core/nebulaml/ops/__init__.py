"""Layer 5, `ops`: what operators (and the `nebula` command line) do to a root.

Holds: copying and flushing (copying), pruning (pruning), inspection (inspection),
verification (verification), this user's memory tiers (memory_tiers), and reading the
history file back (history).

May import: every layer below (`errors`, `format`, `storage`, `protocol`, `runtime`).
Not for: the public API (api.py imports from here, never the other way).
"""
