"""What the persister does next: its state, and every decision on it, with no I/O.

    Schedule        the persister's state (pending, queued, in flight, followed, durable,
                    the outage) and its decisions: which tag to persist next and when the
                    interval makes it due, which pending one a newer commit supersedes,
                    what follows a failed persist (the capped backoff of outage.py, or
                    the error kept), which tags the memory tier must keep (eviction
                    weighs them in evict_plan.py), what a follower does after looking
                    for its leaders' markers, and when the thread is done
    Turn            what the thread does on one turn of its loop (`Schedule.decide`)
    Upkeep          what the other queues of the thread say before a turn
    Skip            a persist skipped, and the newer commit that superseded it
    Follow          a follower's next move after looking for its leaders' markers
    Removal         what becomes of a removal the thread is about to run
    saved_again     whether a persist failed because another rank saved its tag again

Nothing here reads a clock, a store or a thread: a decision that depends on the time takes
it (`now`, monotonic seconds), and what a decision means for the stores and the history
is its caller's to do. The persister (persister.py) holds one `Schedule` under its lock;
the actions (persist_actions.py) and the loop (persist_loop.py) read and record it under
the same lock. A labelled checkpoint (or one a flush or the exit asks for) is "forced":
persisted in order as soon as the thread is free, never superseded. The newest unlabelled
commit is "pending": persisted once the interval since the last persist's start has
passed (at once during an outage, whose backoff paces the tries instead, and at exit);
a newer commit supersedes it. A follower rank (not its tag's leader, the lowest rank that
writes it) persists what the leader persists: its tags are "candidates" until it sees the
leader's marker of them, or of a newer one. Older candidates are given up (`expired`, then `let_go`:
evict_plan.py says which) once a look finds that their leader has not begun them.

May import: `nebulaml.errors`, `nebulaml.format`, protocol.retention, runtime.evict_plan,
runtime.outage and runtime.ranks. Not for: I/O of any kind (persist_actions.py), which
memory copies may go given what the schedule keeps (evict_plan.py), the thread
(persist_loop.py), or what the training thread calls (persister.py).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from nebulaml.errors import NebulaError, PartSupersededError, PersistError, exception_chain
from nebulaml.format.names import order_key
from nebulaml.protocol.retention import Version
from nebulaml.runtime import evict_plan
from nebulaml.runtime.outage import OutageWatch, is_broken
from nebulaml.runtime.ranks import RankInfo

FOLLOW_POLL_S = 0.2  # how often a follower looks for its leaders' markers and commits


def _newest(tags: Iterable[str]) -> str:
    return max(tags, key=lambda t: order_key(t, ""))


def saved_again(error: BaseException) -> bool:
    """Whether a persist failed because another rank saved its tag again before this
    rank's part of the earlier save was committed (`PartSupersededError`, down the chain
    of causes): that save can never be committed, and this rank's save of the tag again
    follows (every rank saves a tag as often as the others)."""
    return any(isinstance(current, PartSupersededError) for current in exception_chain(error))


class Skip(NamedTuple):
    """`tag`'s persist is skipped: the newer `by` superseded it. `row`: this rank leads
    `tag` and writes its `skipped` history row. `dropped`: its persist failed in this
    outage, so it was never durable (the outage's record counted it)."""

    tag: str
    by: str
    row: bool
    dropped: bool


class Upkeep(NamedTuple):
    """What the thread's other queues say (history_queue.py, removal_queue.py), read
    before a decision: history rows to write, removals due now (not in their backoff),
    removals left at all."""

    history_due: bool = False
    removals_due: bool = False
    removals_pending: bool = False


class Turn(NamedTuple):
    """One turn of the thread: `persist` this tag (None: none); `probe` these candidates
    for their leaders' markers (a follower); `see_commits`: look for the commits of this
    rank's parts; `remove`: run the removals first; `finished`: the thread ends."""

    persist: str | None = None
    probe: tuple[str, ...] = ()
    see_commits: bool = False
    remove: bool = False
    finished: bool = False


class Follow(enum.Enum):
    """A follower's move after looking for its leaders' markers."""

    PROGRESS = "progress"  # a leader moved on: look again at once
    POLL = "poll"  # nothing yet: look again after FOLLOW_POLL_S
    ARMED = "armed"  # exiting: the leaders have rank_timeout_s from now to move on
    LEADERS_GONE = "leaders gone"  # exiting, and the leaders' processes ended: give up
    TIMED_OUT = "timed out"  # exiting, and no progress within rank_timeout_s: give up


class Removal(enum.Enum):
    """What becomes of a removal the thread is about to run (`Schedule.start_removal`)."""

    DONE = "done"  # nothing to delete: called off, or the tag is queued again
    LATER = "later"  # the training thread is saving it again right now
    GO = "go"  # delete it now (`Schedule.removing` says which)


@dataclass(slots=True)
class Schedule:
    """The persister's state and its decisions; used under the persister's lock.

    Example:
        >>> s = Schedule(interval_s=60)
        >>> s.committed("global_step1"), s.decide(0.0, Upkeep()).persist
        ([], 'global_step1')
        >>> s.persisted("global_step1", None, 1.0)
        []
        >>> s.committed("global_step2"), s.decide(30.0, Upkeep())  # within the interval
        ([], None)
        >>> s.committed("global_step3")
        [Skip(tag='global_step2', by='global_step3', row=True, dropped=False)]
        >>> s.decide(60.0, Upkeep()).persist
        'global_step3'
    """

    interval_s: float
    ranks: RankInfo = field(default_factory=RankInfo)
    persistent: bool = True  # the job has a persistent tier
    retries: bool = True  # on_error="retry": a failed persist is tried again
    rank_timeout_s: float = 300.0
    watch: OutageWatch = field(default_factory=lambda: OutageWatch(""))
    reached: bool = True  # the persistent tier was reached (session.py's `connect`)
    pending: str | None = None  # the newest unlabelled commit, not yet persisted
    # Flush requests and labelled checkpoints: persisted in order, the interval ignored,
    # never superseded.
    forced: list[str] = field(default_factory=list)
    inflight: str | None = None
    inflight_forced: bool = False  # the one in flight was forced
    last_start: float | None = None  # when the last persist started
    done: dict[str, BaseException | None] = field(default_factory=dict)
    error: NebulaError | None = None  # raised once, on the next call into the library
    stopping: bool = False
    gave_up: bool = False  # exiting, and the last try failed: what is left stays
    # A follower persists exactly what the tag's leader persists: the tags it holds and
    # has not yet seen the leader's marker for, oldest first.
    candidates: list[str] = field(default_factory=list)
    # When each candidate was committed (`now` of `committed`), and those labelled: a
    # follower never gives up a labelled one (its leader persists every labelled tag).
    candidate_since: dict[str, float] = field(default_factory=dict)
    labelled: set[str] = field(default_factory=set)
    leaders: dict[str, int] = field(default_factory=dict)
    newest_followed: dict[int, str] = field(default_factory=dict)  # each leader's newest
    follow_deadline: float | None = None  # exiting: when a follower gives up
    # A follower's parts persisted whose commit (by the leader) it has not yet seen: kept
    # in the memory tier until then (the checkpoint would be committed nowhere for a
    # moment otherwise), and when the thread looks for their commits next.
    parts_out: set[str] = field(default_factory=set)
    commits_due: float = 0.0
    durable: str | None = None  # the newest tag this process made durable
    # What the persistent tier holds committed, as this job knows it (its start's
    # listing, then each persist and retention), and the highest commit sequence there.
    durable_tags: set[str] = field(default_factory=set)
    held_listed: bool = False  # durable_tags set from a listing of the manifests (retention)
    sequence: int = 0
    # Tags the training thread is saving again (`release`, until it commits them), those
    # an eviction is deleting now, and the one the thread is removing now (`forget`).
    saving: set[str] = field(default_factory=set)
    evicting: set[str] = field(default_factory=set)
    removing: str | None = None

    @property
    def rank(self) -> int:
        return self.ranks.rank

    # what the training thread tells ------------------------------------------------------
    def follows(self, tag: str) -> bool:
        """Whether another rank, the tag's leader, decides its persist."""
        return (
            self.ranks.world_size > 1 and self.leaders.get(tag, 0) != self.rank and self.persistent
        )

    def leads(self, tag: str) -> bool:
        """Whether this rank leads `tag`: it commits it, writes its rows, retires others."""
        return self.leaders.get(tag, 0) == self.rank

    def committed(
        self, tag: str, labels: Sequence[str] = (), leader: int = 0, now: float = 0.0
    ) -> list[Skip]:
        """`tag` was committed in the memory tier (at `now`): it becomes the one to persist
        next, superseding the pending one; labelled, it is forced instead (and never
        superseded). A follower's tag waits for its leader instead. What it skipped."""
        self.saving.discard(tag)
        if not self.persistent:
            return []
        self.done.pop(tag, None)
        self.leaders[tag] = leader
        if self.follows(tag):
            # Its leader decides what is persisted and what skipped; this follows.
            self.pending = tag
            if tag not in self.candidates:
                self.candidates.append(tag)
            self.candidate_since[tag] = now
            if labels:
                self.labelled.add(tag)
            else:
                self.labelled.discard(tag)
            newest = self.newest_followed.get(leader)
            if newest is None or order_key(tag, "") >= order_key(newest, ""):
                self.newest_followed[leader] = tag
            return []
        skips = self.supersede_pending(tag)
        if not labels:
            self.pending = tag
        elif tag not in self.forced:
            self.forced.append(tag)
        return skips

    def streamed(self, tag: str, leader: int = 0) -> list[Skip]:
        """`tag` was committed straight to the persistent tier: it supersedes a pending
        tag of a step no higher (a tag-only key orders by step; tags without one compare
        equal). What it skipped."""
        self.saving.discard(tag)
        self.leaders[tag] = leader
        self.durable_tags.add(tag)
        if self.pending is not None and order_key(self.pending)[0] <= order_key(tag)[0]:
            return self.supersede_pending(tag)
        return []

    def supersede_pending(self, by: str) -> list[Skip]:
        """The newer commit `by` supersedes the pending tag, whose persist is skipped
        (unless it is in flight or forced: persisted anyway)."""
        old, self.pending = self.pending, None
        if old is None or old == by or old == self.inflight or old in self.forced:
            return []
        return [self.skip(old, by)]

    def skip(self, old: str, by: str) -> Skip:
        """`old`'s persist is skipped for the newer `by` (its memory copy goes at the next
        eviction). One that failed in this outage is dropped without ever being durable:
        the outage's record counts it. Its leader (which decides what is skipped; the
        other ranks follow it) writes the `skipped` row."""
        dropped = old in self.watch.failed_rows
        if dropped:
            self.watch.superseded(old, by)  # warned once an outage, then counted
        return Skip(old, by, row=self.leads(old), dropped=dropped)

    def request(self, tag: str) -> None:
        """Persist `tag` as soon as possible (forced)."""
        if not self.persistent:
            return
        if tag not in self.forced:
            self.forced.append(tag)
        self.done.pop(tag, None)

    def unqueue(self, tag: str) -> None:
        """`tag` is no longer to be persisted."""
        if self.pending == tag:
            self.pending = None
        for queue in (self.forced, self.candidates):
            while tag in queue:
                queue.remove(tag)

    def busy(self, tag: str) -> bool:
        """Whether the thread or an eviction works on `tag` now (a save of it waits)."""
        return tag in (self.inflight, self.removing) or tag in self.evicting

    def flush_target(self, tag: str | None) -> str | None:
        """What a flush of `tag` (None: the newest unpersisted) waits for, forced now:
        the pending one, the interval ignored; with nothing pending, the last forced one
        (persists are done in order), else the one in flight; None: nothing."""
        if tag is None and self.pending is not None:
            tag = self.pending
        if tag is None:
            return self.forced[-1] if self.forced else self.inflight
        if tag != self.inflight:
            if tag == self.pending:
                self.pending = None
            if tag not in self.forced:
                self.forced.append(tag)
            self.done.pop(tag, None)
        return tag

    def flush_fails(self, tries: int, wait_out: bool) -> PersistError | None:
        """The error a flush raises now rather than wait on, given the watch's failure
        count when it began: the exit gave up, or its own try failed in a way no retry
        can fix (or one it does not wait out)."""
        outage = self.watch.outage
        fresh = self.watch.failures > tries
        if outage is not None and (self.gave_up or (fresh and (outage.hopeless or not wait_out))):
            return outage.error
        return None

    def stop(self) -> None:
        """The exit: what is pending is forced, and the thread ends once it is done."""
        self.stopping = True
        if self.pending is not None:
            self.forced.append(self.pending)
            self.pending = None

    def unpersisted(self) -> str | None:
        """The newest tag not persisted (in flight, forced or pending), if any: the one
        the memory tier keeps (an older one in flight is superseded by it)."""
        left = [t for t in (self.inflight, *self.forced, self.pending) if t]
        return _newest(left) if left else None

    # what the memory tier keeps ----------------------------------------------------------
    def protected(self) -> set[str]:
        """Tags the memory tier must keep: pending, in flight, or queued (asked for, or
        labelled and not yet persisted), and a follower's parts not yet committed."""
        queued = (self.pending, self.inflight, *self.forced, *self.candidates)
        return {t for t in queued if t} | self.parts_out

    def waiting(self) -> list[str]:
        """What is not durable yet, in the order it is persisted (`persistence_status`)."""
        waiting = [t for t in (self.inflight, *self.forced, self.pending) if t]
        waiting += [t for t in self.candidates if t not in waiting]
        return list(dict.fromkeys(waiting))

    def failing(self) -> bool:
        """Whether the persistent tier is failing now, or was never reached."""
        return self.watch.outage is not None or not self.reached

    def superseded(self, tag: str) -> bool:
        """Whether the persistent tier holds `tag`, or a newer checkpoint, committed, as
        this job knows it (evict_plan.py)."""
        return self.persistent and evict_plan.superseded(tag, self.durable_tags)

    def evictable(
        self,
        versions: Sequence[Version],
        retention: int,
        *,
        superseded_newest: bool = False,
        replicas: Collection[str] = (),
    ) -> list[str]:
        """Which of the memory tier's `versions` may go (evict_plan.py's `evictable`),
        never a protected one: with a persistent tier its newest stays (unless
        `superseded_newest` and the persistent tier holds it or a newer one), without
        one retention (`retention`) applies; this rank's own parts of the tags of
        `replicas` stay too."""
        durable = self.durable_tags if self.persistent else None
        return evict_plan.evictable(
            versions,
            retention,
            self.protected(),
            durable,
            superseded_newest=superseded_newest,
            replicas=replicas,
        )

    def may_evict(self, tag: str) -> bool:
        """Checked again just before a delete: a flush may have asked for `tag`, or the
        training thread begun saving it again (`release`), meanwhile."""
        return tag not in self.protected() and tag not in self.saving

    # the thread's turns ------------------------------------------------------------------
    def next_tag(self, now: float) -> str | None:
        """The tag to persist now, taken off the queue, or None to keep waiting."""
        if self.watch.waiting(now):
            return None  # the persistent tier failed: not before the backoff is over
        self.inflight_forced = bool(self.forced)
        if self.forced:
            tag = self.forced.pop(0)
            if tag in self.candidates:
                self.candidates.remove(tag)
            return tag
        if self.pending is None or self.follows(self.pending):
            return None
        # During an outage the backoff paces the tries, not the interval.
        due = (
            self.last_start is None
            or self.watch.outage is not None
            or now - self.last_start >= self.interval_s
        )
        if due or self.stopping:
            tag, self.pending = self.pending, None
            return tag
        return None

    def finished(self, removals_pending: bool) -> bool:
        """Whether the thread's work is over: exiting, and nothing left (or the exit's
        last try failed)."""
        if self.stopping and self.gave_up:
            return True
        return (
            self.stopping
            and self.pending is None
            and not self.forced
            and not self.candidates
            and not removals_pending
        )

    def commits_to_see(self, now: float) -> bool:
        """Whether the thread should look for its leaders' commits now."""
        return bool(self.parts_out) and now >= self.commits_due

    def decide(self, now: float, upkeep: Upkeep) -> Turn | None:
        """The thread's next turn, or None to wait (`wait_s`). A tag to persist is taken
        off the queue and marked in flight."""
        tag = self.next_tag(now)
        probe: tuple[str, ...] = ()
        if tag is None and not upkeep.history_due and not self.finished(upkeep.removals_pending):
            if upkeep.removals_due or (self.stopping and upkeep.removals_pending):
                pass
            elif self.candidates and self.persistent:
                probe = tuple(self.candidates)
            elif not self.commits_to_see(now):
                return None
        if tag is not None:
            self.inflight = tag
            self.last_start = now
        finished = (
            tag is None
            and not upkeep.history_due
            and not probe
            and self.finished(upkeep.removals_pending)
        )
        return Turn(
            persist=tag,
            probe=probe,
            see_commits=self.commits_to_see(now),
            remove=tag is None and upkeep.removals_pending,
            finished=finished,
        )

    def wait_s(self, now: float, retries: Iterable[float | None] = ()) -> float | None:
        """How long the thread may sleep before something is due (None: until told):
        the interval, the next look for commits, the backoff, and `retries` (the other
        queues' retry times)."""
        due: list[float] = []
        if self.pending is not None and self.last_start is not None:
            due.append(self.last_start + self.interval_s)
        if self.parts_out:
            due.append(self.commits_due)
        if self.watch.retry_at is not None and (self.pending or self.forced):
            due.append(self.watch.retry_at)
        due += [retry for retry in retries if retry is not None]
        return max(0.0, min(due) - now) if due else None

    # what a persist comes to -------------------------------------------------------------
    def repeated_failure(self, tag: str) -> bool:
        """Whether `tag`'s failure repeats one of this outage (its `failed` row is written;
        the `ok` row comes when it lands), or is the first (it gets the row)."""
        return not self.watch.first_row(tag) and self.retries

    def part_out(self, tag: str, now: float) -> None:
        """A follower's part of `tag` is persisted: durable once its leader commits."""
        self.parts_out.add(tag)
        self.commits_due = now

    def persisted(self, tag: str, error: PersistError | None, now: float) -> list[Skip]:
        """The persist of `tag` ended, with `error` or not. A failure the store may get
        over (on_error="retry") is tried again (`failed`); one of a save another rank
        saved again is given up (`abandoned`); any other is its answer, and kept to be
        raised. What it skipped."""
        self.inflight = None
        if error is not None and saved_again(error):
            return self.abandoned(tag, error)
        if error is not None and self.retries and not is_broken(error):
            return self.failed(tag, error, now)
        self.done[tag] = error
        if tag != self.pending and tag not in self.forced + self.candidates:
            self.leaders.pop(tag, None)
        if error is not None:
            self.error = error
        else:
            self.landed(tag)
        return []

    def abandoned(self, tag: str, error: PersistError) -> list[Skip]:
        """The persist of `tag` was given up at once: another rank saved the tag again
        before its part of this save was committed (`saved_again`). Never retried (it can
        never commit), no outage, no error kept: this rank's own save of the tag again
        follows and is queued as any commit. A flush of this save gets the error (it
        cannot become durable). Its leader writes the `skipped` row."""
        self.done[tag] = error
        skip = Skip(tag, tag, row=self.leads(tag), dropped=False)
        if tag != self.pending and tag not in self.forced + self.candidates:
            self.leaders.pop(tag, None)
        return [skip]

    def failed(self, tag: str, error: PersistError, now: float) -> list[Skip]:
        """The persist of `tag` failed ("retry"): it stays queued where it was (a newer
        commit still supersedes an unlabelled one), and the next try waits a capped
        backoff. Exiting, this was the last try: the memory tier keeps the checkpoint for
        the next init on this node, and the exit names it and the failure."""
        self.watch.failed(tag, error, now)
        if self.stopping:
            self.error = error
            self.gave_up = True
        if self.inflight_forced:
            if tag not in self.forced:
                self.forced.insert(0, tag)
            return []
        # An unlabelled one waits again, unless a newer commit came meanwhile (pending, or
        # taken by a flush): that one is persisted instead, this one skipped.
        key = order_key(tag, "")
        newer = [t for t in (self.pending, *self.forced) if t and order_key(t, "") > key]
        if newer:
            return [self.skip(tag, _newest(newer))]
        if self.pending is None:
            self.pending = tag
        return []

    def landed(self, tag: str) -> None:
        """`tag` is durable; an outage, if any, is over."""
        self.durable_tags.add(tag)
        if self.durable is None or order_key(tag, "") >= order_key(self.durable, ""):
            self.durable = tag
        self.watch.landed(tag)

    def learn(self, tags: Iterable[str], sequence: int) -> None:
        """What the persistent tier holds committed, as listed or left by retention."""
        self.sequence = max(self.sequence, sequence)
        self.durable_tags |= set(tags)

    # following the leaders ---------------------------------------------------------------
    def follow_probe(self, candidates: Sequence[str]) -> tuple[dict[str, int], dict[str, int]]:
        """The leader of each candidate, and the tags whose leaders' markers to look for:
        the candidates, and each of their leaders' newest (persisted by this rank at exit,
        no longer a candidate: its marker tells that every older candidate was skipped)."""
        leaders = {t: self.leaders.get(t, 0) for t in candidates}
        probe = {**leaders}
        for leader, latest in self.newest_followed.items():
            if leader in leaders.values():
                probe.setdefault(latest, leader)
        return leaders, probe

    def followed(
        self,
        candidates: Sequence[str],
        leaders: Mapping[str, int],
        probe: Mapping[str, int],
        led: Collection[str],
        now: float,
        leaders_gone: Callable[[], bool],
    ) -> tuple[Follow, list[str]]:
        """What the follower does, now that it saw the leaders' markers of `led` (of
        `probe`): queue the candidates their leader has started to persist, drop older
        ones it skipped. A leader persists tags in order, one at a time, so once its
        marker of a tag is visible, the markers of every older tag it persisted are too.
        Exiting, it waits `rank_timeout_s` for the leaders' progress, or none once they
        are gone (`leaders_gone`, asked only then). The move, and the candidates given up."""
        progress = False
        newest: dict[int, str] = {}  # each leader's newest persisted tag
        for t in sorted(led, key=lambda t: order_key(t, "")):
            newest[probe[t]] = t
        for tag in candidates:
            last = newest.get(leaders[tag])
            if tag in self.candidates and (
                tag in led or (last is not None and order_key(tag, "") < order_key(last, ""))
            ):
                progress = True
                self.candidates.remove(tag)
                if tag in led and tag not in self.forced:
                    self.forced.append(tag)
        if self.pending in led:
            self.pending = None
        if progress:
            self.follow_deadline = None
            return Follow.PROGRESS, []
        if not self.stopping:
            return Follow.POLL, []
        if self.follow_deadline is None and not leaders_gone():
            self.follow_deadline = now + self.rank_timeout_s
            return Follow.ARMED, []
        if self.follow_deadline is None or now >= self.follow_deadline:
            # Exiting, and the leaders are gone (their newest, persisted by this rank at
            # exit, took their parts along) or showed no progress for rank_timeout_s:
            # what they have not started by now, they will not.
            move = Follow.LEADERS_GONE if self.follow_deadline is None else Follow.TIMED_OUT
            dropped, self.candidates = self.candidates, []
            return move, dropped
        return Follow.POLL, []

    def expired(self, now: float) -> list[str]:
        """The candidates a follower may give up now, if a look that starts after this
        call finds no marker of their leaders (`let_go`): evict_plan.py's `expired`,
        never one labelled, queued or in flight.

        Example:
            >>> s = Schedule(interval_s=3600, ranks=RankInfo(rank=1, world_size=2))
            >>> for step in (1, 2, 3, 4, 5):
            ...     _ = s.committed(f"global_step{step}", now=step)
            >>> s.expired(10.0), s.let_go(s.expired(70.0), begun={"global_step2"})
            (['global_step1'], ['global_step1', 'global_step3', 'global_step4'])
            >>> s.candidates
            ['global_step2', 'global_step5']
        """
        for tag in [t for t in self.candidate_since if t not in self.candidates]:
            del self.candidate_since[tag]  # persisted or dropped meanwhile
        self.labelled &= set(self.candidates)
        never = {*self.labelled, *self.forced, self.inflight}
        return evict_plan.expired(self.candidate_since, never, now)

    def let_go(self, expired: Collection[str], begun: Collection[str]) -> list[str]:
        """Give up the `expired` candidates (`expired`, asked before the look) whose
        leader has not begun to persist them (`begun`: its writer's or its rank's marker
        was there); their parts may be evicted. Those given up."""
        gone = [t for t in expired if t in self.candidates and t not in begun]
        for tag in gone:
            self.candidates.remove(tag)
            self.candidate_since.pop(tag, None)
            if self.pending == tag:
                self.pending = None
        return gone

    def commits_waiting(self, now: float) -> list[str]:
        """This rank's parts whose commits to look for now, oldest first; the next look
        is FOLLOW_POLL_S later."""
        self.commits_due = now + FOLLOW_POLL_S
        return sorted(self.parts_out, key=lambda t: order_key(t, ""))

    def commits_seen(self, waiting: Sequence[str], committed: Collection[str]) -> bool:
        """The parts of `waiting` now `committed` on the persistent tier, and those a newer
        committed checkpoint superseded (their leader's persist of them is over), are no
        longer kept; whether any was (the memory tier may evict them)."""
        newest = _newest(committed) if committed else None
        over = {
            t
            for t in waiting
            if t in committed or (newest is not None and order_key(t, "") < order_key(newest, ""))
        }
        self.parts_out -= over  # durable already as this rank knows it (`landed`)
        return bool(over)

    # removals ----------------------------------------------------------------------------
    def start_removal(self, tag: str, queued: Collection[str]) -> Removal:
        """Whether the thread deletes `tag` (a framework removed it) now. Between
        persists: one no longer `queued`, or protected, was saved again (`release`
        called the removal off; the new version is queued)."""
        if tag not in queued or tag in self.protected():
            return Removal.DONE
        if tag in self.saving:
            return Removal.LATER  # being saved again right now: looked at again later
        self.removing = tag
        return Removal.GO
