"""Layer 4, `runtime`: a training process's nebula: the session, its save and load
pipelines, the persister, and the fast path of a save.

Holds: the process's session (session) and its exit path (exit), saving a checkpoint
(save, and its steps' names: steps) and loading an item (load), finding a root's tiers, a
tag or an item on them (locate), ranks (ranks), the job and its hold on the root (job),
the memory budget (budget), the background persister (persister: its scheduler
persist_schedule, which memory copies it lets go evict_plan, its actions persist_actions,
its thread persist_loop, one persist's copy persist_step, retention after a persist
retirement, the history's and the removals' queues history_queue and removal_queue
and their wait after a failure retry_queue, outages outage), the snapshot layout and fill
(snapshot), what a buffer still holds from its last fill (unchanged), reused buffers
(slots) and their fresh pages (pages), lazy snapshots' fence (fence), and the replication
of a node's memory tier to its partner node: the ring and nebula's own process group
(peers), the sender and receivers (replication), their messages (peer_wire), the byte
streams both they and the restart's recovery send (peer_streams) and what of
a part crosses the wire (replica_delta).

May import: every layer below (`errors`, `config`, `format`, `storage`, `protocol`). Not
for: the configuration itself (config.py), the public functions (api.py, checkpoint.py)
or operator commands (ops).
"""
