"""Process-wide state: the configuration given to `init()`, the tiers, the persister.

`init()` may be called on every rank and several times; the same configuration is a
no-op. At interpreter exit the newest unpersisted checkpoint is persisted within a bounded
wait, or the process says on stderr which checkpoint was not. After a crash, the next
`init()` for the same root persists what the memory tier still holds that is newer than
the persistent tier, and removes what dead writers left half-written in the memory tier.

Not for: the save and load logic (checkpoint.py) or the public functions (api.py).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import signal
import socket
import sys
import threading
import warnings
from dataclasses import dataclass
from typing import Any

from nebulaml.errors import InvalidArgumentError, NebulaError, NotInitializedError
from nebulaml.format.names import order_key
from nebulaml.protocol.catalog import list_committed, list_incomplete
from nebulaml.protocol.commit import (
    WRITER_PREFIX,
    delete_checkpoint,
    delete_part,
    own_parts,
    read_writers,
    writer_alive,
)
from nebulaml.protocol.tiers import TierHold, TierSet, claim_tiers, release_memory_tier
from nebulaml.runtime.budget import MemoryBudget
from nebulaml.runtime.fence import SnapshotWorker
from nebulaml.runtime.persister import Persister
from nebulaml.runtime.ranks import RankInfo, detect_ranks, memory_budget_bytes
from nebulaml.runtime.slots import SlotPool
from nebulaml.runtime.snapshot import LayoutCache
from nebulaml.storage.store import Store

log = logging.getLogger("nebulaml")

ENV_PATH = "NEBULA_PERSISTENT_STORAGE_PATH"
ENV_INTERVAL = "NEBULA_PERSISTENT_TIME_INTERVAL"
ENV_RETENTION = "NEBULA_NUM_OF_VERSION_IN_RETENTION"
ENV_EXIT_TIMEOUT = "NEBULA_EXIT_TIMEOUT_S"
ENV_RANK_TIMEOUT = "NEBULA_RANK_TIMEOUT_S"
ENV_LAZY = "NEBULA_LAZY_SNAPSHOT"
ENV_KEEP_MEMORY_TIER = "NEBULA_KEEP_MEMORY_TIER"
DEFAULT_RANK_TIMEOUT_S = 300.0
EXIT_NOT_PERSISTED = 1  # the exit status when a checkpoint could not be persisted at exit
DEFAULT_INTERVAL_S = 100.0
DEFAULT_RETENTION = 2
DEFAULT_EXIT_TIMEOUT_S = 600.0
KNOWN_OPTIONS = (
    "storage_options",
    "exit_timeout_s",
    "rank_timeout_s",
    "lazy_snapshot",
    "keep_memory_tier",
)
_TRUE = ("1", "true", "yes", "on")


@dataclass(frozen=True, slots=True)
class Config:
    """What `init()` resolved from its arguments and the environment."""

    persistent_storage_path: str | None
    persistent_time_interval_s: float
    num_of_version_in_retention: int
    exit_timeout_s: float
    rank_timeout_s: float = DEFAULT_RANK_TIMEOUT_S
    storage_options: tuple[tuple[str, Any], ...] = ()
    lazy_snapshot: bool = False
    keep_memory_tier: bool = False


def _number(value: object, source: str, kind: type, minimum: float) -> Any:
    try:
        if isinstance(value, bool):
            raise ValueError
        number = kind(value)
        if kind is int and isinstance(value, float) and not value.is_integer():
            raise ValueError
    except (TypeError, ValueError):
        raise InvalidArgumentError(f"{source} must be a {kind.__name__}, not {value!r}") from None
    if number < minimum:
        raise InvalidArgumentError(f"{source} must be at least {minimum}, not {value!r}")
    return number


def resolve_config(
    persistent_storage_path: Any,
    persistent_time_interval: Any,
    num_of_version_in_retention: Any,
    options: dict[str, Any],
) -> Config:
    """Arguments first, then the environment, then the defaults; bad values are refused."""
    unknown = sorted(set(options) - set(KNOWN_OPTIONS))
    if unknown:
        warnings.warn(
            f"nm.init() ignores unknown option(s) {', '.join(unknown)}; "
            f"it knows {', '.join(KNOWN_OPTIONS)}",
            stacklevel=3,
        )
    path = persistent_storage_path
    # The seed writes `persistent_storage_path="/tmp/test",` (a one-element tuple).
    if isinstance(path, (tuple, list)) and len(path) == 1:
        path = path[0]
    if path is None:
        path = os.environ.get(ENV_PATH) or None
    if path is not None:
        if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
            raise InvalidArgumentError(
                f"persistent_storage_path must be a path or URL, not {persistent_storage_path!r}"
            )
        path = os.fspath(path)
    interval = persistent_time_interval
    if interval is None:
        interval = os.environ.get(ENV_INTERVAL, DEFAULT_INTERVAL_S)
        interval_src = ENV_INTERVAL if ENV_INTERVAL in os.environ else "persistent_time_interval"
    else:
        interval_src = "persistent_time_interval"
    retention = num_of_version_in_retention
    retention_src = "num_of_version_in_retention"
    if retention is None:
        retention = os.environ.get(ENV_RETENTION, DEFAULT_RETENTION)
        retention_src = ENV_RETENTION if ENV_RETENTION in os.environ else retention_src
    rank_timeout = options.get("rank_timeout_s")
    if rank_timeout is None:
        rank_timeout = os.environ.get(ENV_RANK_TIMEOUT, DEFAULT_RANK_TIMEOUT_S)
    exit_timeout = options.get("exit_timeout_s")
    if exit_timeout is None:
        exit_timeout = os.environ.get(ENV_EXIT_TIMEOUT, DEFAULT_EXIT_TIMEOUT_S)
    lazy = options.get("lazy_snapshot")
    if lazy is None:
        lazy = os.environ.get(ENV_LAZY, "0").strip().lower() in _TRUE
    if not isinstance(lazy, bool):
        raise InvalidArgumentError(f"lazy_snapshot must be True or False, not {lazy!r}")
    keep = options.get("keep_memory_tier")
    if keep is None:
        keep = os.environ.get(ENV_KEEP_MEMORY_TIER, "0").strip().lower() in _TRUE
    if not isinstance(keep, bool):
        raise InvalidArgumentError(f"keep_memory_tier must be True or False, not {keep!r}")
    storage_options = options.get("storage_options") or {}
    if not isinstance(storage_options, dict):
        raise InvalidArgumentError("storage_options must be a dict")
    return Config(
        persistent_storage_path=path,
        persistent_time_interval_s=_number(interval, interval_src, float, 0),
        num_of_version_in_retention=_number(retention, retention_src, int, 1),
        exit_timeout_s=_number(exit_timeout, "exit_timeout_s", float, 0),
        rank_timeout_s=_number(rank_timeout, "rank_timeout_s", float, 0),
        storage_options=tuple(sorted(storage_options.items())),
        lazy_snapshot=lazy,
        keep_memory_tier=keep,
    )


class Session:
    """The tiers and persister of this process, for one configuration."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.ranks: RankInfo = detect_ranks()
        self.rank = self.ranks.rank
        self.world_size = self.ranks.world_size
        # The persistent root with its identity; this root's memory tier, checked private,
        # held while this session lives, and released first if an earlier root left it.
        self.tiers: TierSet
        self.hold: TierHold
        self.tiers, self.hold = claim_tiers(
            config.persistent_storage_path, dict(config.storage_options)
        )
        # Leftovers of this node's crashed saves and persists; other nodes' are theirs.
        for _tier, store in self.tiers.stores:
            remove_dead_writers(store)
        share = memory_budget_bytes(self.ranks)
        # The budget is per process, the memory tier shared by the node's processes.
        limit = None if share is None else share * self.ranks.local_world_size
        self.pool = SlotPool(self.tiers.memory, limit_bytes=limit)
        self.layouts = LayoutCache()  # each item name's last layout (snapshot.py)
        self.persister = Persister(
            self.tiers,
            interval_s=config.persistent_time_interval_s,
            retention=config.num_of_version_in_retention,
            ranks=self.ranks,
            rank_timeout_s=config.rank_timeout_s,
            pool=self.pool,
        )
        self.budget = MemoryBudget(
            limit, pool=self.pool, persister=self.persister, wait_s=config.exit_timeout_s
        )
        self.recovered: str | None = self._recover()
        self.snapshots: SnapshotWorker | None = None
        if config.lazy_snapshot:
            self.snapshots = SnapshotWorker()
            self.snapshots.install_fence()

    def wait_for_snapshots(self) -> None:
        """The fence: every lazy save's snapshot and commit done; raises their failure."""
        if self.snapshots is not None:
            self.snapshots.wait()

    def _recover(self) -> str | None:
        """Queue the memory tier's newest checkpoint (this rank's part of it) if the
        persistent tier lacks it."""
        if self.tiers.persistent is None:
            return None
        if self.ranks.all_local:
            committed = list_committed(self.tiers.memory)
            in_memory = [(c.tag, c.sort_key) for c in committed]
            # A labelled checkpoint is always persisted (persister.py), even one a crash
            # left unpersisted behind a newer one.
            if self.world_size == 1:
                durable = {c.tag for c in list_committed(self.tiers.persistent)}
                for c in committed[:-1]:
                    if c.manifest.labels and c.tag not in durable:
                        log.info("persisting %r (labelled), left in the memory tier", c.tag)
                        self.persister.request(c.tag)
        else:  # the node holds only its ranks' parts, never a manifest of the whole
            parts = own_parts(self.tiers.memory, self.rank)
            in_memory = sorted((tag, order_key(tag, created)) for tag, created in parts)
            in_memory.sort(key=lambda pair: pair[1])
        if not in_memory:
            return None
        persisted = list_committed(self.tiers.persistent)
        newest, newest_key = in_memory[-1]
        if persisted and persisted[-1].sort_key >= newest_key:
            return None
        log.info("persisting %r, left in the memory tier by an earlier process", newest)
        self.persister.request(newest)
        return newest

    def close(self, timeout_s: float | None = None) -> str | None:
        """Persist what is pending and stop; returns a tag left unpersisted, if any."""
        if self.snapshots is not None:
            self.snapshots.close()  # the lazy saves commit first, then are persisted
        left = self.persister.close(timeout_s)
        # The free buffers are a cache of this process's; left behind they would hold RAM
        # (/dev/shm) after the job. The checkpoints themselves stay.
        self.pool.trim()
        self.pool.close()
        try:
            if left is None and self._releasable():
                tags, size = release_memory_tier(self.tiers.memory, self.hold)
                if tags or size:
                    log.info("released the memory tier %s (%s: %d bytes, all persisted)",
                             self.tiers.memory.url, ", ".join(tags) or "empty", size)  # fmt: skip
        except (NebulaError, OSError) as exc:
            log.warning("could not release the memory tier %s: %s", self.tiers.memory.url, exc)
        finally:
            self.hold.close()
        return left

    def _releasable(self) -> bool:
        """Whether the memory tier may go at close: there is a persistent tier, it was not
        asked to be kept, nothing failed, and every checkpoint of this rank's in the memory
        tier is persisted (or older than one that is). With several ranks on the node,
        this rank's parts go now, and the last rank out removes the folder."""
        persistent = self.tiers.persistent
        if persistent is None or self.config.keep_memory_tier or self.persister.error:
            return False
        memory = self.tiers.memory
        persisted = list_committed(persistent)
        newest = persisted[-1].sort_key if persisted else None
        durable = {info.tag: info.manifest.items for info in persisted}
        if self.world_size > 1:
            mine = own_parts(memory, self.rank)
            for tag, created in mine:
                if tag not in durable and (newest is None or order_key(tag, created) >= newest):
                    return False
            for tag, _created in mine:
                delete_part(memory, tag, self.rank)
            return not any(True for _ in memory.list_dirs())
        for info in list_committed(memory):
            same = durable.get(info.tag) == info.manifest.items
            if not same and (newest is None or info.sort_key >= newest):
                return False
        return True


def remove_dead_writers(store: Store) -> list[str]:
    """Delete uncommitted tags whose writers ran on this host and are all gone.

    A tag being written by a live process, or by another host, is left alone.
    """
    removed = []
    host = socket.gethostname()
    for tag in list_incomplete(store):
        if not any(n.startswith(WRITER_PREFIX) for n in store.list_files(tag)):
            continue  # not started by a writer we can judge
        writers = read_writers(store, tag)
        if not any(w.get("host") != host or writer_alive(w, host) for w in writers):
            delete_checkpoint(store, tag)
            removed.append(tag)
    return removed


_lock = threading.RLock()
_session: Session | None = None


def start(config: Config) -> Session:
    """Make `config` the process's configuration (a no-op if it already is)."""
    global _session
    with _lock:
        if _session is not None and _session.config == config:
            _session.persister.raise_pending_error()
            return _session
        if _session is not None:
            old, _session = _session, None
            left = old.close(config.exit_timeout_s)
            if left is not None:
                log.warning("re-init: checkpoint %r was not persisted before the switch", left)
            old.persister.raise_pending_error()
        _session = Session(config)
        install_sigterm_handler()
        return _session


def current(what: str, *, raise_pending: bool = True, fence: bool = True) -> Session:
    """The live session, after the lazy snapshots are done (unless `fence` is False: a
    save or commit queues behind them) and any pending background failure is raised
    (unless the caller raises it itself, later)."""
    session = _session
    if session is None:
        raise NotInitializedError(what)
    if fence:
        session.wait_for_snapshots()
    if raise_pending:
        session.persister.raise_pending_error()
    return session


def current_or_none() -> Session | None:
    session = _session
    if session is not None:
        session.wait_for_snapshots()
        session.persister.raise_pending_error()
    return session


def stop(timeout_s: float | None = None) -> str | None:
    """Close the session (persisting what is pending); returns a tag left unpersisted."""
    global _session
    with _lock:
        session, _session = _session, None
    if session is None:
        return None
    left = session.close(timeout_s if timeout_s is not None else session.config.exit_timeout_s)
    session.persister.raise_pending_error()
    return left


# The exit path ---------------------------------------------------------------------------
# The exit persist runs in a hook of `threading._shutdown()`, which the interpreter calls
# once the main thread is done (return, exception, sys.exit, nebula's SIGTERM exit):
# before it joins the non-daemon threads, and before the atexit handlers. Those hooks run
# newest first, and concurrent.futures registers one that shuts every ThreadPoolExecutor
# down; asyncio's default executor goes with it, and aiohttp (under adlfs and the Azure
# SDK) asks it for each request. From an atexit handler an az:// persist therefore failed
# with "cannot schedule new futures after shutdown" (issue #16); nebula's hook, registered
# after that one, runs before it. The atexit handler stays for what the hook leaves: a
# session begun after it ran, or one that non-daemon threads may still use (see
# _other_threads_running).


def _say(line: str) -> None:
    """One line on stderr; from a signal handler too, which may interrupt a write."""
    try:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
    except Exception:  # noqa: BLE001 - a reentrant or closed stream: the descriptor itself
        with contextlib.suppress(OSError):
            os.write(2, (line + "\n").encode(errors="replace"))


def _unpersisted(session: Session) -> list[str]:
    """The tags the exit persist has yet to persist (pending, queued, in flight)."""
    if session.tiers.persistent is None:
        return []
    return sorted(session.persister.protected(), key=lambda tag: order_key(tag, ""))


def _report_unpersisted(session: Session, tags: list[str], why: str) -> None:
    where = session.tiers.display
    listed = ", ".join(map(repr, tags))
    what = f"checkpoint {listed} was" if len(tags) == 1 else f"checkpoints {listed} were"
    _say(
        f"nebula: {what} not persisted to {where}: {why}; it is still in the memory tier "
        f"({session.tiers.memory.url}), and the next nm.init({where!r}) on this node, or "
        f"`nebula flush {where}`, persists it"
    )


def _exit_now() -> None:
    """Exit with EXIT_NOT_PERSISTED at once. Never a silent 0 (or 128+signum) when a
    checkpoint was not made durable: the process has said so and its status says so.
    os._exit skips what would run after (the atexit handlers): flush what they would."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    with contextlib.suppress(Exception):
        logging.shutdown()
    os._exit(EXIT_NOT_PERSISTED)


class _ExitSignals:
    """SIGTERM and SIGINT while the exit persist runs. torchrun and Kubernetes signal
    again after the first SIGTERM, and people press Ctrl-C twice: the first one during
    the persist says on stderr what nebula is finishing, where, and how long it waits at
    most (what is left of exit_timeout_s), and the persist goes on; the next one abandons
    it: the checkpoint is named as not persisted and the process exits at once with
    EXIT_NOT_PERSISTED. Installed in the main thread only, not over a signal that is
    ignored; the previous handlers come back after.

    The handler never raises: an exception thrown into `Thread.join` marks the thread
    it waited for as stopped while it still runs (CPython 3.11, bpo-45274's fix), and
    the persist would look finished."""

    def __init__(self, session: Session, started: float) -> None:
        self.session = session
        self.started = started
        self.received: list[int] = []
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for signum in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(ValueError, OSError, TypeError):
                previous = signal.getsignal(signum)
                if previous is not signal.SIG_IGN:
                    signal.signal(signum, self._handle)
                    self._previous[signum] = previous

    def restore(self) -> None:
        for signum, previous in self._previous.items():
            with contextlib.suppress(ValueError, OSError, TypeError):
                signal.signal(signum, signal.SIG_DFL if previous is None else previous)
        self._previous.clear()

    def _handle(self, signum: int, _frame: object) -> None:
        from time import monotonic

        tags = _unpersisted(self.session)
        if not tags:
            return  # nothing left to persist: the exit goes on, and soon ends
        self.received.append(signum)
        name = signal.Signals(signum).name
        elapsed = monotonic() - self.started
        timeout_s = self.session.config.exit_timeout_s
        if len(self.received) == 1:
            _say(
                f"nebula: {name} during exit: finishing the persist of "
                f"{', '.join(map(repr, tags))} to {self.session.tiers.display}, waiting at "
                f"most {max(0.0, timeout_s - elapsed):.0f} s more (exit_timeout_s="
                f"{timeout_s:g}); signal again to abandon it"
            )
            return
        _report_unpersisted(
            self.session, tags, f"its exit persist was abandoned on {name} after {elapsed:.1f} s"
        )
        with contextlib.suppress(Exception):
            self.session.pool.trim()  # the free buffers, as close() would have
        _exit_now()


def _exit_persist() -> None:
    """Close the session: persist what is pending within exit_timeout_s. What was not
    persisted is named on stderr, with where it still is, and the process exits with
    EXIT_NOT_PERSISTED (after a signal too: never 0 nor 128+signum then)."""
    from time import monotonic

    global _session
    session = _session
    if session is None:
        return
    timeout_s = session.config.exit_timeout_s
    signals = _ExitSignals(session, monotonic())
    left: str | None = None
    failure: BaseException | None = None
    try:
        signals.install()  # before the session is taken: a signal cannot lose it
        _session = None
        try:
            left = session.close(timeout_s)
        except Exception as exc:  # noqa: BLE001 - reported below, and by the exit status
            failure = exc
            with contextlib.suppress(Exception):
                left = session.persister.close(0)  # the tag it has not finished, if any
    finally:
        signals.restore()
    if left is not None:
        why = f"its persist did not finish within {timeout_s:g} s (exit_timeout_s)"
        _report_unpersisted(session, [left], why)
    error: BaseException | None = failure or session.persister.error
    if error is None and session.snapshots is not None:
        try:
            session.snapshots.wait()
        except Exception as exc:  # noqa: BLE001 - reported below, and by the exit status
            error = exc
    if error is not None:
        _say(f"nebula: error: {error}")
    if left is not None or error is not None:
        _exit_now()
    with contextlib.suppress(Exception):
        sys.stderr.flush()


def _other_threads_running() -> bool:
    """Whether a non-daemon thread besides this one still runs (the pools' workers of
    concurrent.futures aside: its own hook stops them, after nebula's). Such a thread may
    still save: the exit persist then waits for the atexit handler, after it is joined."""
    pools: set[threading.Thread] = set()
    for module, name in (
        ("concurrent.futures.thread", "_threads_queues"),
        ("concurrent.futures.process", "_threads_wakeups"),
    ):
        workers = getattr(sys.modules.get(module), name, None)
        if workers:
            pools.update(list(workers.keys()))
    me = threading.current_thread()
    return any(
        t is not me and not t.daemon and t.is_alive() and t not in pools
        for t in threading.enumerate()
    )


def _at_threading_exit() -> None:
    if _session is not None and not _other_threads_running():
        _exit_persist()


def _at_exit() -> None:
    _exit_persist()


def _terminate(signum: int, _frame: object) -> None:
    # SIGTERM's default kills without running exit handlers; as an exit, the pending
    # checkpoint is persisted (or the process says it was not).
    raise SystemExit(128 + signum)


def install_sigterm_handler() -> bool:
    """Make SIGTERM a normal exit (status 143) when nobody else handles it, so that exit
    persists the pending checkpoint. Returns whether it was installed."""
    if threading.current_thread() is not threading.main_thread():
        return False
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return False  # the application (or its framework) handles it
    signal.signal(signal.SIGTERM, _terminate)
    return True


def _register_exit_handlers() -> None:
    # Imported first, so that its hook is registered before nebula's (and runs after it).
    import concurrent.futures.thread  # noqa: F401

    atexit.register(_at_exit)
    register = getattr(threading, "_register_atexit", None)
    if register is not None:
        with contextlib.suppress(RuntimeError):  # imported during shutdown: atexit does it
            register(_at_threading_exit)


_register_exit_handlers()
