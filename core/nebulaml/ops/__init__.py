"""Layer 5, `ops`: what operators (and the `nebula` command line) do to a root.

Holds: copying and flushing (copying), pruning (pruning), inspection (inspection),
verification (verification), this user's memory tiers (memory_tiers), reading the
history file back (history), comparing two checkpoints (diff), exporting items as plain
.pt or .safetensors files (export) and breaking a root's job hold (unlocking).

May import: every layer below (`errors`, `format`, `storage`, `protocol`, `runtime`).
Not for: the public API (api.py imports from here, never the other way).
"""
