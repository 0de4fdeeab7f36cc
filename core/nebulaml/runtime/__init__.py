"""Layer 4, `runtime`: a training process's nebula: configuration, session, persister,
and the fast path of a save.

Holds: the session and its configuration (session), ranks (ranks), the memory budget
(budget), the background persister (persister), the snapshot layout and fill (snapshot),
reused buffers (slots) and lazy snapshots' fence (fence).

May import: every layer below (`errors`, `format`, `storage`, `protocol`). Not for: the
public functions (api.py, checkpoint.py) or operator commands (ops).
"""
