"""The steps of a checkpoint's life, by name and in order, and `trace`, which logs each
one as it runs.

A save's pipeline is read in runtime/save.py (`SaveJob.add` and `SaveJob.commit` call
the steps of `SAVE` and `COMMIT` in this order) and runs on in the persister's thread
(`PERSIST`: a turn of runtime/persist_loop.py, retention in persist_actions.py, the
history rows written by history_queue.py). With the logger ``nebulaml.steps`` at DEBUG
level, each step logs one line, ``<step> <tag>``: the trace of a save, which
tests/core/test_pipeline.py matches against this order.

    >>> SAVE + COMMIT + PERSIST
    ('begin', 'claim', 'room', 'snapshot', 'publish', 'await ranks', 'record', 'hand over', \
'persist', 'retain', 'evict', 'history')

May import: the standard library only. Not for: doing any step (save.py, the persister's
modules).
"""

from __future__ import annotations

import logging

# Checkpoint.save, for each item, on the training thread (a lazy save: `room` and
# `snapshot` on the snapshot worker):
SAVE = (
    "begin",  # the tag's folder in the memory tier, with this rank's writer marker
    "claim",  # the item's name claimed, when other ranks write into the same folder
    "room",  # room in the memory tier (budget, eviction), else the persistent tier
    "snapshot",  # the item's bytes copied (a reused buffer, or torch.save) and hashed
)
# Checkpoint.commit (the last save's, with num_of_files):
COMMIT = (
    "publish",  # this rank's part marker; the last part publishes manifest.json
    "await ranks",  # on a shared memory tier: the other ranks' parts, bounded
    "record",  # the writer marker dropped, and the save's history row made
    "hand over",  # the tag queued for the persister, which evicts what it supersedes
)
# On the persister's thread, once the interval makes the tag due:
PERSIST = (
    "persist",  # copied to the persistent tier, verified, and committed there
    "retain",  # retention applied on the persistent tier
    "evict",  # memory copies no longer needed dropped
    "history",  # the save's and the persist's rows appended to checkpointHistories.csv
)

_log = logging.getLogger("nebulaml.steps")


def trace(step: str, tag: str) -> None:
    """Log that `step` (one of SAVE, COMMIT, PERSIST) of checkpoint `tag` runs now.

    >>> trace("begin", "global_step1")  # a no-op unless nebulaml.steps logs DEBUG
    """
    if _log.isEnabledFor(logging.DEBUG):
        _log.debug("%s %s", step, tag)
