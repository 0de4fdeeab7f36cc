"""The persister's decisions (runtime/persist_schedule.py, and evict_plan.py's for
eviction): pure, table-driven.

Each row is a state in and a decision out: a `Schedule` made from the row's fields, one
call, and what it answered and left. No thread, no store, no clock: the time is the row's.
"""

from __future__ import annotations

from typing import Any

import pytest

from nebulaml.errors import (
    CorruptCheckpointError,
    PartSupersededError,
    PersistError,
    StorageFullError,
)
from nebulaml.protocol.retention import Version
from nebulaml.runtime.evict_plan import settled_parts
from nebulaml.runtime.outage import RETRY_MAX_S, Outage, OutageWatch
from nebulaml.runtime.persist_schedule import (
    FOLLOW_POLL_S,
    Follow,
    Removal,
    Schedule,
    Skip,
    Turn,
    Upkeep,
)
from nebulaml.runtime.ranks import RankInfo

S1, S2, S3, S4, S5 = (f"global_step{i}" for i in range(1, 6))
FOLLOWER = RankInfo(rank=1, world_size=2, local_rank=1, local_world_size=2)
LEADER = RankInfo(rank=0, world_size=2, local_rank=0, local_world_size=2)


def _error(tag: str, cause: BaseException) -> PersistError:
    error = PersistError(tag, "/ckpt", cause)
    error.__cause__ = cause
    return error


def full(tag: str = S1) -> PersistError:
    """A failure the store may get over (a full disk): retried."""
    return _error(tag, StorageFullError("disk full"))


def corrupt(tag: str = S1) -> PersistError:
    """The checkpoint's own failure (a corrupt memory copy): never retried."""
    return _error(tag, CorruptCheckpointError("model.pt", "sha 1", "sha 2"))


def make(state: dict[str, Any]) -> Schedule:
    """A fresh schedule from a row: its fields, with `interval_s` 60 unless given, and
    `outage` (a float: an outage whose backoff ends then; None: none) and `failed_rows`
    for its watch. Lists and sets are copied, so that no row shares them."""
    state = dict(state)
    watch = OutageWatch("/ckpt")
    if "outage" in state:
        watch.outage = Outage(started=0.0, since_utc="t", error=full())
        watch.retry_at = state.pop("outage")
    watch.failed_rows = set(state.pop("failed_rows", ()))
    copied = {k: v.copy() if isinstance(v, (list, set, dict)) else v for k, v in state.items()}
    return Schedule(interval_s=copied.pop("interval_s", 60.0), watch=watch, **copied)


# which tag is persisted next, and when ------------------------------------------------------
@pytest.mark.parametrize(
    ("state", "now", "persist", "left"),
    [
        pytest.param({"pending": S1}, 0.0, S1, {"pending": None}, id="the first is due at once"),
        pytest.param(
            {"pending": S2, "last_start": 100.0},
            159.9,
            None,
            {"pending": S2},
            id="the interval not yet elapsed: nothing due",
        ),
        pytest.param(
            {"pending": S2, "last_start": 100.0},
            160.0,
            S2,
            {"pending": None},
            id="the interval elapsed: the pending one is due",
        ),
        pytest.param(
            {"forced": [S2], "last_start": 100.0},
            100.1,
            S2,
            {"forced": []},
            id="a labelled (forced) one is due at once",
        ),
        pytest.param(
            {"forced": [S3, S4], "pending": S5, "last_start": 100.0},
            100.1,
            S3,
            {"forced": [S4], "pending": S5},
            id="forced ones go first, in order",
        ),
        pytest.param(
            {"pending": S2, "last_start": 100.0, "stopping": True},
            100.1,
            S2,
            {"pending": None},
            id="at exit the interval does not apply",
        ),
        pytest.param(
            {"pending": S2, "last_start": 100.0, "outage": 100.5},
            100.5,
            S2,
            {"pending": None},
            id="during an outage the backoff paces the tries, not the interval",
        ),
        pytest.param(
            {"forced": [S2], "pending": S3, "outage": 130.0},
            129.0,
            None,
            {"forced": [S2], "pending": S3},
            id="within the backoff nothing is due, even forced",
        ),
        pytest.param(
            {"ranks": FOLLOWER, "pending": S2, "leaders": {S2: 0}, "candidates": [S2]},
            0.0,
            None,
            {"pending": S2},
            id="a follower's pending one waits for its leader",
        ),
        pytest.param(
            {"ranks": LEADER, "pending": S2, "leaders": {S2: 0}},
            0.0,
            S2,
            {"pending": None},
            id="the leader persists its own",
        ),
        pytest.param(
            {"ranks": FOLLOWER, "forced": [S2], "candidates": [S2, S3]},
            0.0,
            S2,
            {"candidates": [S3]},
            id="a forced candidate is no longer one",
        ),
    ],
)
def test_next_tag(state: dict[str, Any], now: float, persist: str | None, left: dict) -> None:
    schedule = make(state)
    assert schedule.next_tag(now) == persist
    assert {k: getattr(schedule, k) for k in left} == left


# what a commit supersedes -------------------------------------------------------------------
@pytest.mark.parametrize(
    ("state", "commit", "skips", "left"),
    [
        pytest.param(
            {"pending": S1},
            (S2, ()),
            [Skip(S1, S2, row=True, dropped=False)],
            {"pending": S2, "forced": []},
            id="a newer commit supersedes an unlabelled pending one",
        ),
        pytest.param(
            {"forced": [S1]},
            (S2, ()),
            [],
            {"pending": S2, "forced": [S1]},
            id="but not a labelled (forced) one",
        ),
        pytest.param(
            {"pending": S1, "forced": [S1]},
            (S2, ()),
            [],
            {"pending": S2, "forced": [S1]},
            id="nor a pending one also asked for (a flush, the recovery)",
        ),
        pytest.param(
            {"pending": S1},
            (S2, ("best",)),
            [Skip(S1, S2, row=True, dropped=False)],
            {"pending": None, "forced": [S2]},
            id="a labelled commit is forced, and supersedes the pending one",
        ),
        pytest.param(
            {"pending": S1, "inflight": S1},
            (S2, ()),
            [],
            {"pending": S2},
            id="one in flight is not skipped",
        ),
        pytest.param(
            {"pending": S1, "failed_rows": {S1}},
            (S2, ()),
            [Skip(S1, S2, row=True, dropped=True)],
            {"pending": S2},
            id="one that failed in this outage is dropped, never durable",
        ),
        pytest.param(
            {"ranks": FOLLOWER, "pending": S1, "candidates": [S1], "leaders": {S1: 0}},
            (S2, (), 0),
            [],
            {"pending": S2, "candidates": [S1, S2], "newest_followed": {0: S2}},
            id="a follower skips nothing: its commit waits for the leader",
        ),
        pytest.param(
            {"ranks": FOLLOWER, "pending": S1, "leaders": {S1: 0}},
            (S2, (), 1),
            [Skip(S1, S2, row=False, dropped=False)],
            {"pending": S2},
            id="only a tag's leader writes its skipped row",
        ),
        pytest.param(
            {"pending": None, "persistent": False, "saving": {S1}},
            (S1, ()),
            [],
            {"pending": None, "saving": set()},
            id="without a persistent tier nothing is queued",
        ),
    ],
)
def test_committed(state: dict[str, Any], commit: tuple, skips: list[Skip], left: dict) -> None:
    schedule = make(state)
    assert schedule.committed(*commit) == skips
    assert {k: getattr(schedule, k) for k in left} == left


@pytest.mark.parametrize(
    ("state", "tag", "skips", "pending"),
    [
        pytest.param(
            {"pending": S1},
            S2,
            [Skip(S1, S2, row=True, dropped=False)],
            None,
            id="a streamed commit supersedes an older pending one",
        ),
        pytest.param({"pending": S3}, S2, [], S3, id="but not a newer one"),
        pytest.param({"forced": [S1]}, S2, [], None, id="nor a forced one"),
    ],
)
def test_streamed(state: dict[str, Any], tag: str, skips: list[Skip], pending: str | None) -> None:
    schedule = make(state)
    assert schedule.streamed(tag) == skips
    assert schedule.pending == pending
    assert tag in schedule.durable_tags


# what a persist comes to ----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("state", "error", "skips", "left"),
    [
        pytest.param(
            {"inflight": S1},
            None,
            [],
            {"done": {S1: None}, "durable": S1, "durable_tags": {S1}, "pending": None},
            id="one that lands is durable",
        ),
        pytest.param(
            {"inflight": S1, "durable": S3},
            None,
            [],
            {"durable": S3, "durable_tags": {S1}},
            id="an older one landing leaves the newest durable as it was",
        ),
        pytest.param(
            {"inflight": S1},
            full(),
            [],
            {"done": {}, "pending": S1, "error": None},
            id="a store failure is retried: the unlabelled one is pending again",
        ),
        pytest.param(
            {"inflight": S1, "pending": S2, "failed_rows": {S1}},
            full(),
            [Skip(S1, S2, row=True, dropped=True)],
            {"pending": S2, "done": {}},
            id="unless a newer commit came: then it is skipped",
        ),
        pytest.param(
            {"inflight": S1, "inflight_forced": True, "forced": [S3]},
            full(),
            [],
            {"forced": [S1, S3], "pending": None},
            id="a forced one goes back first in line",
        ),
        pytest.param(
            {"inflight": S1},
            corrupt(),
            [],
            {"pending": None, "durable": None},
            id="a broken checkpoint is never retried",
        ),
        pytest.param(
            {"inflight": S1, "retries": False},
            full(),
            [],
            {"pending": None, "durable": None},
            id="on_error=raise: the failure is the answer",
        ),
        pytest.param(
            {"inflight": S1, "stopping": True},
            full(),
            [],
            {"gave_up": True, "pending": S1},
            id="the exit's last try failing gives up",
        ),
    ],
)
def test_persisted(
    state: dict[str, Any], error: PersistError | None, skips: list, left: dict
) -> None:
    schedule = make(state)
    assert schedule.persisted(S1, error, 10.0) == skips
    assert schedule.inflight is None
    assert {k: getattr(schedule, k) for k in left} == left
    if error is None:
        assert schedule.watch.outage is None and schedule.error is None
    elif S1 in schedule.done:  # kept, to be raised once
        assert schedule.done[S1] is error and schedule.error is error
    else:
        assert schedule.watch.retry_at == 10.5  # tried again after the backoff


def saved_again(tag: str = S1) -> PersistError:
    """Another rank saved the tag again before this rank's part of the earlier save was
    committed (its part of that save is gone): given up at once, never retried."""
    return _error(tag, PartSupersededError(f"/ckpt/{tag}", [1], tag=tag))


@pytest.mark.parametrize(
    ("state", "skips", "left"),
    [
        pytest.param(
            {"inflight": S1},
            [Skip(S1, S1, row=True, dropped=False)],
            {"pending": None, "forced": [], "gave_up": False},
            id="the leader's: skipped for its save again, not pending again",
        ),
        pytest.param(
            {"inflight": S1, "pending": S2},
            [Skip(S1, S1, row=True, dropped=False)],
            {"pending": S2, "forced": []},
            id="a newer commit stays pending",
        ),
        pytest.param(
            {"inflight": S1, "inflight_forced": True, "forced": [S3]},
            [Skip(S1, S1, row=True, dropped=False)],
            {"forced": [S3], "pending": None},
            id="a forced (labelled) one is not put back: its save again is queued",
        ),
        pytest.param(
            {"inflight": S1, "retries": False},
            [Skip(S1, S1, row=True, dropped=False)],
            {"pending": None},
            id="on_error=raise: nothing to raise",
        ),
        pytest.param(
            {"inflight": S1, "stopping": True},
            [Skip(S1, S1, row=True, dropped=False)],
            {"gave_up": False, "pending": None},
            id="at exit: no give-up, what is left is persisted",
        ),
        pytest.param(
            {"inflight": S1, "ranks": FOLLOWER, "leaders": {S1: 0}},
            [Skip(S1, S1, row=False, dropped=False)],
            {"pending": None, "candidates": []},
            id="a follower's: no row, not pending again",
        ),
    ],
)
def test_a_save_another_rank_saved_again_is_given_up(
    state: dict[str, Any], skips: list, left: dict
) -> None:
    """The persist of a save that can never commit (another rank saved the tag again:
    `PartSupersededError`) is given up at once. Bug caught (tests/dist/
    test_follower_catches_up.py): retried as an outage, and the leader's own save of the
    tag again waited rank_timeout_s for the persist."""
    schedule = make(state)
    error = saved_again()
    assert schedule.persisted(S1, error, 10.0) == skips
    assert {k: getattr(schedule, k) for k in left} == left
    assert schedule.inflight is None and not schedule.busy(S1)
    assert schedule.watch.outage is None and schedule.watch.retry_at is None
    assert schedule.error is None  # nothing raised on the next call
    assert schedule.done == {S1: error}  # a flush of this save hears why it is not durable
    # The rank's own save of the tag again is queued as any commit.
    schedule.committed(S1, leader=0)
    assert S1 not in schedule.done and S1 in schedule.waiting()


@pytest.mark.parametrize(
    ("failures", "wait_s"),
    [(1, 0.5), (2, 1.0), (3, 2.0), (6, 16.0), (7, RETRY_MAX_S), (12, RETRY_MAX_S)],
    ids=lambda v: str(v),
)
def test_the_retry_backoff_doubles_capped_at_30_s(failures: int, wait_s: float) -> None:
    schedule = make({"pending": S1})
    now = 0.0
    for _ in range(failures):
        now = schedule.watch.retry_at or 0.0
        tag = schedule.decide(now, Upkeep())
        assert tag is not None and tag.persist == S1
        assert schedule.persisted(S1, full(), now) == []
    assert schedule.watch.retry_at == now + wait_s
    assert schedule.decide(now + wait_s - 0.01, Upkeep()) is None  # not before the backoff
    turn = schedule.decide(now + wait_s, Upkeep())
    assert turn is not None and turn.persist == S1


def test_landing_ends_the_outage_and_resets_the_backoff() -> None:
    schedule = make({"inflight": S1, "outage": 5.0, "failed_rows": {S1}})
    schedule.persisted(S1, None, 10.0)
    assert schedule.watch.outage is None and schedule.watch.retry_at is None
    assert not schedule.failing()


# the thread's turns ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("state", "now", "upkeep", "turn"),
    [
        pytest.param({}, 0.0, Upkeep(), None, id="nothing to do: wait"),
        pytest.param(
            {"pending": S2, "last_start": 0.0},
            30.0,
            Upkeep(),
            None,
            id="the interval not elapsed: wait",
        ),
        pytest.param(
            {"pending": S2}, 0.0, Upkeep(), Turn(persist=S2), id="persist the pending one"
        ),
        pytest.param({}, 0.0, Upkeep(history_due=True), Turn(), id="history rows to write"),
        pytest.param(
            {},
            0.0,
            Upkeep(removals_due=True, removals_pending=True),
            Turn(remove=True),
            id="removals due",
        ),
        pytest.param(
            {},
            0.0,
            Upkeep(removals_pending=True),
            None,
            id="removals in their backoff: wait",
        ),
        pytest.param(
            {"stopping": True},
            0.0,
            Upkeep(removals_pending=True),
            Turn(remove=True),
            id="exiting: the removals run, backoff or not",
        ),
        pytest.param({"stopping": True}, 0.0, Upkeep(), Turn(finished=True), id="exiting, done"),
        pytest.param(
            {"stopping": True},
            0.0,
            Upkeep(history_due=True),
            Turn(),
            id="exiting: the rows are written before the end",
        ),
        pytest.param(
            {"stopping": True, "forced": [S3]},
            0.0,
            Upkeep(),
            Turn(persist=S3),
            id="exiting: what is left is persisted first",
        ),
        pytest.param(
            {"stopping": True, "gave_up": True, "forced": [S3], "outage": 99.0},
            0.0,
            Upkeep(),
            Turn(finished=True),
            id="exiting after the last try failed: what is left stays",
        ),
        pytest.param(
            {"ranks": FOLLOWER, "pending": S2, "candidates": [S1, S2], "leaders": {S2: 0}},
            0.0,
            Upkeep(),
            Turn(probe=(S1, S2)),
            id="a follower looks for its leader's markers",
        ),
        pytest.param(
            {"ranks": FOLLOWER, "parts_out": {S1}, "commits_due": 5.0},
            5.0,
            Upkeep(),
            Turn(see_commits=True),
            id="a follower's parts: look for their commits when due",
        ),
        pytest.param(
            {"ranks": FOLLOWER, "parts_out": {S1}, "commits_due": 5.0},
            4.9,
            Upkeep(),
            None,
            id="but not before",
        ),
    ],
)
def test_decide(state: dict[str, Any], now: float, upkeep: Upkeep, turn: Turn | None) -> None:
    schedule = make(state)
    assert schedule.decide(now, upkeep) == turn
    if turn is not None and turn.persist is not None:
        assert schedule.inflight == turn.persist and schedule.last_start == now


@pytest.mark.parametrize(
    ("state", "retries", "wait"),
    [
        pytest.param({}, (), None, id="idle: until told"),
        pytest.param(
            {"pending": S2, "last_start": 100.0},
            (),
            45.0,
            id="the rest of the interval",
        ),
        pytest.param({"pending": S2, "last_start": 0.0}, (), 0.0, id="overdue: at once"),
        pytest.param(
            {"forced": [S2], "outage": 120.0},
            (),
            5.0,
            id="the rest of the backoff",
        ),
        pytest.param({"outage": 120.0}, (), None, id="a backoff with nothing queued: until told"),
        pytest.param({}, (None, 117.0), 2.0, id="the history's or the removals' retry"),
        pytest.param({"parts_out": {S1}, "commits_due": 125.0}, (), 10.0, id="the next look"),
    ],
)
def test_wait_s(state: dict[str, Any], retries: tuple, wait: float | None) -> None:
    assert make(state).wait_s(115.0, retries) == wait


# what the memory tier keeps -------------------------------------------------------------------
def _versions(*tags: str) -> list[Version]:
    return [Version(t, "", (), i) for i, t in enumerate(tags)]


@pytest.mark.parametrize(
    ("state", "superseded_newest", "doomed"),
    [
        pytest.param({}, False, [S1, S2], id="the newest stays"),
        pytest.param({"pending": S2}, False, [S1], id="pending stays"),
        pytest.param({"inflight": S1}, False, [S2], id="in flight stays"),
        pytest.param({"forced": [S1, S2]}, False, [], id="queued (labelled) stays"),
        pytest.param({"candidates": [S1]}, False, [S2], id="a follower's candidate stays"),
        pytest.param({"parts_out": {S2}}, False, [S1], id="a part its leader has not committed"),
        pytest.param({}, True, [S1, S2], id="the budget: the newest stays if not durable"),
        pytest.param(
            {"durable_tags": {S3}},
            True,
            [S1, S2, S3],
            id="the budget: the newest goes if durable",
        ),
        pytest.param(
            {"durable_tags": {S4}},
            True,
            [S1, S2, S3],
            id="or if a newer one is durable",
        ),
        pytest.param(
            {"durable_tags": {S3}},
            False,
            [S1, S2],
            id="durable, but the budget did not ask",
        ),
        pytest.param(
            {"persistent": False},
            False,
            [S1],
            id="the only tier: retention applies (2)",
        ),
    ],
)
def test_evictable(state: dict[str, Any], superseded_newest: bool, doomed: list[str]) -> None:
    versions = _versions(S1, S2, S3)
    assert make(state).evictable(versions, 2, superseded_newest=superseded_newest) == doomed


@pytest.mark.parametrize(
    ("state", "replicas", "superseded_newest", "doomed"),
    [
        # The node-loss campaign's restarts behind the replicated step: the node kept its
        # partner's replica of S2 and its own part of S3 only; the partner lost, nothing
        # was complete there.
        pytest.param({}, {S2}, False, [S1], id="the own part of the replica's tag stays"),
        pytest.param(
            {},
            {S1, S2},
            False,
            [],
            id="two replicas (one while the own part of the newer is not committed)",
        ),
        pytest.param({}, {S3}, False, [S1, S2], id="a replica of the newest: nothing more"),
        pytest.param({}, {S5}, False, [S1, S2], id="a replica of a tag this rank lacks"),
        pytest.param(
            {},
            {S1},
            False,
            [],
            id="the part whose replica has not begun to arrive stays too (a step ahead)",
        ),
        pytest.param({}, set(), False, [S1, S2], id="no replica here: the newest alone"),
        pytest.param({}, {S2}, True, [S1], id="the budget: it stays while not durable"),
        pytest.param(
            {"durable_tags": {S2}},
            {S2},
            True,
            [S1, S2],
            id="the budget: it goes once durable",
        ),
        pytest.param(
            {"durable_tags": {S4}},
            {S2},
            True,
            [S1, S2, S3],
            id="the budget: or once a newer one is",
        ),
        pytest.param(
            {"durable_tags": {S2}},
            {S2},
            False,
            [S1],
            id="durable, but the budget did not ask",
        ),
        pytest.param(
            {"persistent": False},
            {S1},
            False,
            [],
            id="the only tier: it stays beside retention's (2)",
        ),
    ],
)
def test_evictable_keeps_the_own_part_of_a_replicas_tag(
    state: dict[str, Any], replicas: set[str], superseded_newest: bool, doomed: list[str]
) -> None:
    """The tags of the replicas the node keeps of its partner's parts (`replicas`): this
    rank's own part of each stays like the newest. catches: a node whose newest replica
    is a step behind its own newest part (replication is asynchronous) holding no
    checkpoint complete, so that a lost partner set the job back to the persistent tier
    (3 of 30 restarts of the node-loss campaign, 6-30 steps behind)"""
    versions = _versions(S1, S2, S3)
    schedule = make(state)
    got = schedule.evictable(versions, 2, superseded_newest=superseded_newest, replicas=replicas)
    assert got == doomed


@pytest.mark.parametrize(
    ("state", "may"),
    [
        pytest.param({}, True, id="nothing holds it"),
        pytest.param({"forced": [S1]}, False, id="a flush asked for it meanwhile"),
        pytest.param({"saving": {S1}}, False, id="the training thread saves it again"),
    ],
)
def test_may_evict(state: dict[str, Any], may: bool) -> None:
    assert make(state).may_evict(S1) is may


@pytest.mark.parametrize(
    ("files", "settled"),
    [
        pytest.param({S1: ["manifest.json"], S2: ["manifest.json"]}, [S1, S2], id="committed"),
        pytest.param(
            {S1: ["manifest.json"], S2: [".rank-0.json"]},
            [S1],
            id="a newer part the other ranks have not committed",
        ),
        pytest.param(
            {S1: [".rank-0.json"], S2: ["manifest.json"]},
            [S1, S2],
            id="an older uncommitted part may go",
        ),
        pytest.param(
            {S1: ["manifest.json"], S2: [".writer-0.json"]},
            [S1],
            id="a part being written",
        ),
        pytest.param({S1: [".rank-0.json"], S2: [".rank-0.json"]}, [S1, S2], id="none committed"),
    ],
)
def test_settled_parts(files: dict[str, list[str]], settled: list[str]) -> None:
    assert [v.tag for v in settled_parts(_versions(S1, S2), files, 0)] == settled


# following the leader -------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("state", "led", "gone", "move", "left"),
    [
        pytest.param(
            {},
            [S1],
            False,
            (Follow.PROGRESS, []),
            {"forced": [S1], "candidates": [S2]},
            id="the leader persists a candidate: persist it too",
        ),
        pytest.param(
            {},
            [S2],
            False,
            (Follow.PROGRESS, []),
            {"forced": [S2], "candidates": []},
            id="the leader persists a newer one: the older was skipped",
        ),
        pytest.param(
            {},
            [],
            False,
            (Follow.POLL, []),
            {"candidates": [S1, S2]},
            id="no marker yet: look again",
        ),
        pytest.param(
            {"stopping": True},
            [],
            False,
            (Follow.ARMED, []),
            {"candidates": [S1, S2], "follow_deadline": 108.0},
            id="exiting: the leader has rank_timeout_s to move on",
        ),
        pytest.param(
            {"stopping": True, "follow_deadline": 108.0},
            [],
            False,
            (Follow.POLL, []),
            {"candidates": [S1, S2]},
            id="exiting, within the timeout: look again",
        ),
        pytest.param(
            {"stopping": True, "follow_deadline": 99.0},
            [],
            False,
            (Follow.TIMED_OUT, [S1, S2]),
            {"candidates": []},
            id="exiting, no progress within the timeout: give up",
        ),
        pytest.param(
            {"stopping": True},
            [],
            True,
            (Follow.LEADERS_GONE, [S1, S2]),
            {"candidates": []},
            id="exiting, the leader's process ended: give up at once",
        ),
        pytest.param(
            {"stopping": True, "follow_deadline": 99.0},
            [S1],
            False,
            (Follow.PROGRESS, []),
            {"follow_deadline": None, "forced": [S1]},
            id="progress resets the timeout",
        ),
    ],
)
def test_followed(
    state: dict[str, Any], led: list[str], gone: bool, move: tuple, left: dict
) -> None:
    schedule = make({"ranks": FOLLOWER, "rank_timeout_s": 8.0, "candidates": [S1, S2], **state})
    leaders, probe = schedule.follow_probe([S1, S2])
    assert leaders == {S1: 0, S2: 0}
    assert schedule.followed([S1, S2], leaders, probe, led, 100.0, lambda: gone) == move
    assert {k: getattr(schedule, k) for k in left} == left


def test_the_leaders_newest_is_probed_too() -> None:
    # The newest, persisted by this rank at exit, is no longer a candidate: its marker
    # still tells that the older candidates were skipped.
    schedule = make({"ranks": FOLLOWER, "newest_followed": {0: S3}, "leaders": {S1: 0}})
    assert schedule.follow_probe([S1]) == ({S1: 0}, {S1: 0, S3: 0})


@pytest.mark.parametrize(
    ("parts_out", "committed", "seen", "left"),
    [
        pytest.param({S1, S2}, {S1}, True, {S2}, id="a committed part is over"),
        pytest.param({S1, S2}, {S2}, True, set(), id="an older one too: superseded"),
        pytest.param({S1, S2}, set(), False, {S1, S2}, id="none committed yet"),
    ],
)
def test_commits_seen(parts_out: set, committed: set, seen: bool, left: set) -> None:
    schedule = make({"parts_out": parts_out})
    waiting = schedule.commits_waiting(50.0)
    assert waiting == sorted(parts_out) and schedule.commits_due == 50.0 + FOLLOW_POLL_S
    assert schedule.commits_seen(waiting, committed) is seen
    assert schedule.parts_out == left


# the training thread's calls ------------------------------------------------------------------
@pytest.mark.parametrize(
    ("state", "tag", "target", "left"),
    [
        pytest.param({}, None, None, {"forced": []}, id="nothing to flush"),
        pytest.param(
            {"pending": S2},
            None,
            S2,
            {"pending": None, "forced": [S2]},
            id="the pending one is forced now, the interval ignored",
        ),
        pytest.param({"forced": [S1, S2]}, None, S2, {"forced": [S1, S2]}, id="the last queued"),
        pytest.param({"inflight": S1}, None, S1, {"forced": []}, id="the one in flight"),
        pytest.param({"inflight": S1}, S1, S1, {"forced": []}, id="asked for, in flight"),
        pytest.param(
            {"done": {S1: None}},
            S1,
            S1,
            {"forced": [S1], "done": {}},
            id="asked for again",
        ),
    ],
)
def test_flush_target(
    state: dict[str, Any], tag: str | None, target: str | None, left: dict
) -> None:
    schedule = make(state)
    assert schedule.flush_target(tag) == target
    assert {k: getattr(schedule, k) for k in left} == left


@pytest.mark.parametrize(
    ("state", "failed", "wait_out", "raises"),
    [
        pytest.param({}, None, True, False, id="no outage"),
        pytest.param({"outage": 5.0}, None, True, False, id="an older failure: try again"),
        pytest.param({"outage": 5.0}, full(), True, False, id="its own try may pass: wait it out"),
        pytest.param({"outage": 5.0}, full(), False, True, id="the budget does not wait it out"),
        pytest.param({"outage": 5.0}, corrupt(), True, True, id="no retry can fix it"),
        pytest.param(
            {"outage": 5.0, "gave_up": True},
            None,
            True,
            True,
            id="the exit gave up",
        ),
    ],
)
def test_flush_fails(
    state: dict[str, Any], failed: PersistError | None, wait_out: bool, raises: bool
) -> None:
    schedule = make(state)
    tries = schedule.watch.failures
    if failed is not None:
        schedule.watch.failed(S1, failed, 1.0)
    error = schedule.flush_fails(tries, wait_out)
    assert (error is not None) is raises
    if raises:
        assert error is schedule.watch.outage.error  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("state", "left"),
    [
        pytest.param({}, None, id="nothing left"),
        pytest.param({"inflight": S1, "pending": S2}, S2, id="the newest, not the one in flight"),
        pytest.param({"forced": [S3, S1], "pending": S2}, S3, id="a labelled one newer still"),
    ],
)
def test_unpersisted_at_exit(state: dict[str, Any], left: str | None) -> None:
    schedule = make(state)
    schedule.stop()
    assert schedule.pending is None and schedule.unpersisted() == left


@pytest.mark.parametrize(
    ("state", "queued", "start"),
    [
        pytest.param({}, [S1], Removal.GO, id="delete it"),
        pytest.param({}, [], Removal.DONE, id="called off (saved again)"),
        pytest.param({"forced": [S1]}, [S1], Removal.DONE, id="queued again: not deleted"),
        pytest.param({"saving": {S1}}, [S1], Removal.LATER, id="being saved again: later"),
    ],
)
def test_start_removal(state: dict[str, Any], queued: list[str], start: Removal) -> None:
    schedule = make(state)
    assert schedule.start_removal(S1, queued) is start
    assert schedule.removing == (S1 if start is Removal.GO else None)


@pytest.mark.parametrize(
    ("state", "superseded"),
    [
        pytest.param({"durable_tags": {S2}}, True, id="durable"),
        pytest.param({"durable_tags": {S3}}, True, id="a newer one durable"),
        pytest.param({"durable_tags": {S1}}, False, id="only older ones durable"),
        pytest.param({"durable_tags": {"best"}}, False, id="a tag without a step says nothing"),
        pytest.param({"durable_tags": {S2}, "persistent": False}, False, id="no persistent tier"),
    ],
)
def test_superseded(state: dict[str, Any], superseded: bool) -> None:
    assert make(state).superseded(S2) is superseded
