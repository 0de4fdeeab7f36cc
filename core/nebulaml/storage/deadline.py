"""Deadlines for store calls: no call into a store waits without bound (issue #43).

A store that is down answers with an error; one that hangs (a suspended server, a
half-open connection, a stuck NFS mount) may not answer for minutes. Every call the
`Store` facade makes on a network store is therefore waited for at most its policy's
`call_timeout_s` (retry.py), and any call, local ones too, at most what is left of the
deadline of the block it runs in:

    within       a block whose store calls must answer by a time (nested: the earliest
                 wins); `retry=False` also forbids retries inside it (init's first
                 look at a store: a refused connection says enough)
    remaining    the seconds left of the block's deadline, or None
    retry_allowed whether a transient failure may be tried again now, and after how long
    bounded      run a call on a worker thread and wait for it at most so long (or, with
                 a `Progress`, at most so long without progress); a call that does not
                 answer raises `StoreTimeoutError` and is left to finish on its own
                 thread, which holds nothing the caller needs

The worker thread runs in a copy of the caller's context, so the deadline reaches the
retries inside the call (retry.py) and the coroutines it starts on fsspec's event loop.
A store whose earlier calls still hang gets no new worker past `MAX_UNANSWERED`: its
calls fail at once until one of them answers.

May import: `nebulaml.errors`. Not for: which calls are bounded by how much (store.py and
its callers), or which failures may pass (runtime/outage.py).
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

from nebulaml._threads import start as start_thread
from nebulaml.errors import StoreTimeoutError

T = TypeVar("T")

# Calls of one store left hanging on their worker threads; past this many, its next calls
# fail at once instead of leaving one more thread behind.
MAX_UNANSWERED = 8


@dataclass(frozen=True, slots=True)
class _Limit:
    ends_at: float  # time.monotonic()
    retry: bool


_limit: contextvars.ContextVar[_Limit | None] = contextvars.ContextVar(
    "nebula_store_deadline", default=None
)


@contextlib.contextmanager
def within(seconds: float | None, *, retry: bool = True) -> Iterator[None]:
    """Store calls in the block answer within `seconds` (None: no deadline of its own),
    or raise `StoreTimeoutError`; an enclosing block's earlier deadline still holds.

    Example:
        >>> with within(5):
        ...     0 < remaining() <= 5
        True
        >>> remaining() is None
        True
    """
    current = _limit.get()
    ends = math.inf if seconds is None else time.monotonic() + max(0.0, seconds)
    if current is not None:
        ends, retry = min(ends, current.ends_at), retry and current.retry
    if ends == math.inf and retry:
        yield
        return
    token = _limit.set(_Limit(ends, retry))
    try:
        yield
    finally:
        _limit.reset(token)


def remaining() -> float | None:
    """Seconds left until the block's deadline (0 once passed), or None without one."""
    current = _limit.get()
    if current is None or current.ends_at == math.inf:
        return None
    return max(0.0, current.ends_at - time.monotonic())


def retry_allowed(delay_s: float) -> bool:
    """Whether a retry after `delay_s` seconds may start: retries are allowed in the block
    and the delay ends before its deadline.

    Example:
        >>> retry_allowed(1.0)
        True
        >>> with within(0.5):
        ...     retry_allowed(1.0)
        False
    """
    current = _limit.get()
    if current is None:
        return True
    return current.retry and time.monotonic() + delay_s < current.ends_at


class Progress:
    """What a long call says as it moves (bytes sent): `bounded` then waits for the next
    sign of progress, not for the whole call, at most its limit."""

    __slots__ = ("last",)

    def __init__(self) -> None:
        self.last = time.monotonic()

    def touch(self, _n: int = 0) -> None:
        self.last = time.monotonic()


_unanswered: dict[str, int] = {}
_unanswered_lock = threading.Lock()


def bounded(
    fn: Callable[[], T],
    what: str | Callable[[], str],
    limit_s: float | None,
    *,
    key: str = "",
    progress: Progress | None = None,
) -> T:
    """`fn()`, waited for at most `limit_s` seconds (None: no limit of its own) and at
    most until the enclosing block's deadline; with `progress`, `limit_s` counts from its
    last sign of progress instead. Raises `StoreTimeoutError` naming `what` when it does
    not answer in time (a callable `what` is asked only then); `key` names the store whose
    unanswered calls are counted.

    Example:
        >>> bounded(lambda: 42, "a quick call", 1.0)
        42
        >>> import threading
        >>> hang = threading.Event()
        >>> try:
        ...     bounded(lambda: hang.wait(5), "/ckpt/t/model", 0.1)
        ... except StoreTimeoutError as exc:
        ...     print(exc)
        /ckpt/t/model: no answer from the store within 0.1 s
        >>> hang.set()
    """
    block = remaining()
    if limit_s is None and block is None:
        return fn()
    with _unanswered_lock:
        if _unanswered.get(key, 0) >= MAX_UNANSWERED:
            raise StoreTimeoutError(
                f"{_name(what)}: the store has not answered {MAX_UNANSWERED} earlier calls yet"
            )
    done = threading.Event()
    answer: list[T] = []  # what fn returned, or
    failure: list[BaseException] = []  # what it raised
    abandoned = False

    def run() -> None:
        nonlocal abandoned
        try:
            answer.append(fn())
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
            failure.append(exc)
        finally:
            with _unanswered_lock:
                done.set()
                if abandoned:
                    _unanswered[key] -= 1
                    if not _unanswered[key]:
                        del _unanswered[key]

    context = contextvars.copy_context()
    worker = threading.Thread(target=context.run, args=(run,), name="nebula-store-call",
                              daemon=True)  # fmt: skip
    started = time.monotonic()
    start_thread(worker)
    block_ends = math.inf if block is None else started + block
    while True:
        base = started if progress is None else max(started, progress.last)
        ends = min(block_ends, math.inf if limit_s is None else base + limit_s)
        if done.wait(max(0.0, min(ends - time.monotonic(), 1.0))):
            break
        if time.monotonic() < ends:
            continue
        with _unanswered_lock:
            if done.is_set():
                break
            abandoned = True
            _unanswered[key] = _unanswered.get(key, 0) + 1
        waited = time.monotonic() - (started if progress is None else base)
        quiet = " without progress" if progress is not None else ""
        raise StoreTimeoutError(
            f"{_name(what)}: no answer from the store{quiet} within {waited:.1f} s"
        )
    if failure:
        raise failure[0]
    return answer[0]


def _name(what: str | Callable[[], str]) -> str:
    return what() if callable(what) else what
