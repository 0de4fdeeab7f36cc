"""Which of a memory tier's copies eviction may take: pure functions, no I/O.

    evictable       of the memory tier's committed copies, those that may go, given what
                    the persister protects and what the persistent tier holds
    superseded      whether the persistent tier holds a tag, or a newer checkpoint
    awaited         this rank's part whose partner's replica may still come (kept)
    settled_parts   of this rank's parts in a shared memory tier, those eviction may
                    consider (not one still being written, not one the other ranks are
                    still saving)
    expired         a follower's candidates it may give up (its leader has moved past them)

The persister's schedule (persist_schedule.py) asks these with its own state (what it
protects, what it knows durable); the eviction itself, its listings and deletes, is
persist_actions.py's. Nothing here reads a clock, a store or a thread.

May import: `nebulaml.format` and protocol.retention. Not for: the persister's state or
its other decisions (persist_schedule.py), deleting a copy (persist_actions.py), or
retention on the persistent tier (retirement.py).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

from nebulaml.format.names import MANIFEST_NAME, order_key, step_of, writer_marker_name
from nebulaml.protocol.retention import Version, plan_retention

FOLLOW_KEEP = 4  # a follower's newest candidates, never given up
FOLLOW_GRACE_S = 60.0  # and older ones, while no newer one has been committed this long


def superseded(tag: str, durable: Collection[str]) -> bool:
    """Whether `durable` (the tags the persistent tier holds committed, as the job knows
    it) holds `tag`, or a checkpoint of a higher step.

    Example:
        >>> superseded("global_step1", {"global_step2"}), superseded("last", {"global_step2"})
        (True, False)
    """
    if tag in durable:
        return True
    step = step_of(tag)
    steps = [step_of(t) for t in durable]
    return step is not None and any(s is not None and s > step for s in steps)


def evictable(
    versions: Sequence[Version],
    retention: int,
    protected: Collection[str],
    durable: Collection[str] | None,
    *,
    superseded_newest: bool = False,
    replicas: Collection[str] = (),
) -> list[str]:
    """Which of the memory tier's `versions` may go, never one of `protected` (what the
    persister still needs). With a persistent tier (`durable`: what it holds committed,
    as the job knows it) the newest is kept; with `superseded_newest` (the memory budget
    needs room) the newest goes too once the persistent tier holds it or a newer one.
    Without one (`durable` None) the memory tier is the only tier, and retention
    (`retention`) applies.

    `replicas`: the tags of the replicas this node keeps of its partners' parts
    (`peer_replicas`; protocol/replicas.py `replica_tags`). This rank's own part of each
    is kept like the newest, so that a lost partner finds the tag complete on this node
    (its part from the replica, this rank's from here): replication is asynchronous, and
    the newest replica is often a step behind this rank's newest part. So is the newest
    part but one while its step is newer than every replica's (`awaited`: the partner's
    replica of it has not begun to arrive yet). With `superseded_newest` they go once the
    persistent tier holds them or a newer one (a restart resumes that).

    Example:
        >>> parts = [Version(f"global_step{i}", "") for i in (1, 2, 3)]
        >>> evictable(parts, 2, {"global_step1"}, set())
        ['global_step2']
        >>> evictable(parts, 2, (), {"global_step3"}, superseded_newest=True)
        ['global_step1', 'global_step2', 'global_step3']
    """
    if not versions:
        return []
    kept = set(replicas) | set(awaited(versions, replicas))
    if durable is None:
        return plan_retention(versions, retention, {*protected, *kept})
    newest = max(versions, key=lambda v: v.sort_key).tag
    keep = {newest, *kept}
    if superseded_newest:
        keep = {tag for tag in keep if not superseded(tag, durable)}
    return [v.tag for v in versions if v.tag not in keep and v.tag not in protected]


def awaited(versions: Sequence[Version], replicas: Collection[str]) -> list[str]:
    """Of this rank's parts (`versions`), the one whose partner's replica may still come,
    given the tags of the replicas its node keeps (`replicas`): its newest part but one,
    while its step is newer than every replica's (the partner sends a part once it has
    committed it, and this rank may be a step ahead); none when the node keeps no
    replica, or a tag has no step to tell.

    Example:
        >>> parts = [Version(f"global_step{i}", "") for i in (1, 2, 3)]
        >>> awaited(parts, {"global_step1"}), awaited(parts, {"global_step2"})
        (['global_step2'], [])
    """
    ordered = sorted(versions, key=lambda v: v.sort_key)
    if len(ordered) < 2 or not replicas:
        return []
    step = step_of(ordered[-2].tag)
    steps = [step_of(tag) for tag in replicas]
    if step is None or any(s is None or s >= step for s in steps):
        return []
    return [ordered[-2].tag]


def settled_parts(
    versions: Sequence[Version], files: Mapping[str, Collection[str]], rank: int
) -> list[Version]:
    """Of this rank's parts in a shared memory tier (`versions`, with each tag folder's
    `files`), those eviction may consider. Not a part still being written (its writer
    marker is there until the commit: Lightning's `last`, saved again each epoch, was
    evicted between its rank marker and its manifest, and the save failed). Not a part of
    a tag the other ranks have not committed yet, newer than the newest committed one
    (they are still saving it, or died): keeping it and evicting the committed one before
    it lost a checkpoint both ranks had acknowledged (the elastic campaign).

    Example:
        >>> parts = [Version("global_step1", ""), Version("global_step2", "")]
        >>> files = {"global_step1": ["manifest.json"], "global_step2": [".rank-0.json"]}
        >>> [v.tag for v in settled_parts(parts, files, 0)]
        ['global_step1']
    """
    whole = {t for t, names in files.items() if MANIFEST_NAME in names}
    writing = {
        t for t, names in files.items() if t not in whole and writer_marker_name(rank) in names
    }
    versions = [v for v in versions if v.tag not in writing]
    if whole:
        newest_whole = max((v for v in versions if v.tag in whole), key=lambda v: v.sort_key)
        in_progress = {
            v.tag for v in versions if v.tag not in whole and v.sort_key > newest_whole.sort_key
        }
        versions = [v for v in versions if v.tag not in in_progress]
    return versions


def expired(since: Mapping[str, float], never: Collection[str | None], now: float) -> list[str]:
    """Of a follower's candidates (`since`: each tag it keeps for its leader's persist,
    and when it committed it), those it may give up at `now`, unless the leader has
    begun to persist them: each older than the newest `FOLLOW_KEEP`, or with a newer one
    committed `FOLLOW_GRACE_S` ago; never one of `never` (labelled, queued, in flight).

    A leader persists its newest commit when the interval comes due, and the ranks of a
    job commit in step, so a leader that has not begun a tag this far behind the
    follower's newest has moved past it. Without this a follower kept every part of an
    interval (11.5x the state after 12 saves, the leader 2.1x) and, its spare buffers
    taken, copied each save whole (90 ms against the leader's 5 ms).

    Example:
        >>> since = {f"global_step{i}": float(i) for i in (1, 2, 3, 4, 5)}
        >>> expired(since, (), 10.0), expired(since, {"global_step2"}, 70.0)
        (['global_step1'], ['global_step1', 'global_step3', 'global_step4'])
    """
    ordered = sorted(since, key=lambda t: order_key(t, ""))
    newest = set(ordered[-FOLLOW_KEEP:])
    out = []
    for i, tag in enumerate(ordered[:-1]):
        if tag in never:
            continue
        newer_since = min(since[t] for t in ordered[i + 1 :])
        if tag not in newest or newer_since <= now - FOLLOW_GRACE_S:
            out.append(tag)
    return out
