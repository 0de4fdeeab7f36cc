"""Layer 3, `protocol`: the rules that make a checkpoint on a store safe to share.

Holds: listing what is committed (catalog), the commit protocol with rank markers, copying
and deleting (commit), read leases and delete claims (leases), the retention policy
(retention), the tiers of a root with their identity and holds (tiers), and the history
rows (history).

May import: `nebulaml.errors`, `nebulaml.format` and `nebulaml.storage`. Not for: a
running job's state (runtime) or operator commands (ops).
"""
