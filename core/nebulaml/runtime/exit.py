"""The exit path: at interpreter exit, persist what is pending, or say what was not.

The exit persist closes the session within `exit_timeout_s`. A checkpoint it could not
persist is named on stderr, with where it still is, and the process exits with
`EXIT_NOT_PERSISTED` (never a silent 0). SIGTERM and SIGINT during it are handled
(`_ExitSignals`: the first one says what nebula finishes, the next one abandons it), and
SIGTERM itself becomes a normal exit when nobody else handles it
(`install_sigterm_handler`, which `nm.init()` passes to `session.start`), so that a
terminated job persists its last checkpoint too.

May import: every layer below runtime, and runtime.session (the session it closes).
Not for: the session itself or its `close` (session.py), or persisting (persister.py).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import signal
import sys
import threading
from typing import Any

from nebulaml.format.names import order_key
from nebulaml.runtime import session as _session
from nebulaml.runtime.session import Session

EXIT_NOT_PERSISTED = 1  # the exit status when a checkpoint could not be persisted at exit

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

    session = _session.live()
    if session is None:
        return
    timeout_s = session.config.exit_timeout_s
    signals = _ExitSignals(session, monotonic())
    left: str | None = None
    failure: BaseException | None = None
    try:
        signals.install()  # before the session is taken: a signal cannot lose it
        _session.detach()
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
        if session.persister.gave_up:
            why = "its persist failed at exit (the error follows)"
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


_shutting_down = False  # the interpreter's exit has begun (nebula's first hook ran)


def _at_threading_exit() -> None:
    global _shutting_down
    _shutting_down = True
    if _session.live() is not None and not _other_threads_running():
        _exit_persist()


def _at_exit() -> None:
    global _shutting_down
    _shutting_down = True
    _exit_persist()


def _terminate(signum: int, _frame: object) -> None:
    # SIGTERM's default kills without running exit handlers; as an exit, the pending
    # checkpoint is persisted (or the process says it was not). Once the interpreter is
    # exiting (the exit persist done or not begun, other exit handlers running), a
    # SystemExit raised into them would only print "Exception ignored in atexit
    # callback" and a traceback: the process ends at once instead, as terminated.
    if _shutting_down:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(128 + signum)
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
