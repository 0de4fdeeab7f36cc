"""Layer 3, `protocol`: the rules that make a checkpoint on a store safe to share.

Holds: listing what is committed (catalog), the commit protocol (commit), reserving a
commit's sequence, its place in "newest" order (sequence), copying between tiers
(transfer), what a persist takes from an item's previous version (reuse), deleting
(delete), rank and writer markers (markers), what a crash leaves and what may be cleared
(recovery), read leases, handles' holds and delete claims (leases), which job holds a root
(holds), two writers of one tag (cowriters), the retention policy (retention), the tiers
of a job (tiers); one memory tier: where it lives and its privacy (memory_tier), whose
root it is (tier_identity), its sessions' holds and its release (tier_lifetime), the ranks
alive on the node (rank_presence) and the removals a rank left unfinished (removals); the
replicas a node keeps of other nodes' parts, checked and committed whole (replicas), and
those a memory tier holds that a restart may still need (replicas_held); and the history
rows (history). Every reserved file name is spelled in `nebulaml.format.names`.

May import: `nebulaml.errors`, `nebulaml.format` and `nebulaml.storage`. Not for: a
running job's state (runtime) or operator commands (ops).
"""
