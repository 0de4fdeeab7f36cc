"""The threads nebula starts take no signal: a signal sent to the process reaches the main
thread.

A signal sent to a process (Ctrl-C's SIGINT, a launcher's SIGTERM) waits in the process's
pending set until a thread that does not block it takes it: the thread the kernel wakes
(the main thread, when it sleeps), or any other that passes through the kernel first (one
busy with file or network calls). Python runs the handler in the main thread only, and a
main thread asleep (`time.sleep`, a join) wakes only for a signal it took itself: a SIGTERM
or SIGINT that one of nebula's threads took (one busy with store calls as the signal came)
left the program asleep until its sleep ended. So each thread nebula starts is started
while the starting thread blocks the asynchronous signals (a new thread inherits the mask,
so it never holds them unblocked, not even for its first instruction), and so are the
threads the libraries start for nebula (fsspec's event loop and the executor it starts).
The starting thread's own mask comes back at once; a signal that came meanwhile waits
for it, and it takes the signal as it unblocks it.

    start    start a thread that takes no asynchronous signal
    quiet    a block whose new threads take no asynchronous signal

May import: nothing of nebulaml (the base layer). Not for: what the threads do.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import Any

# The signals a process is sent; the synchronous ones (SIGSEGV, SIGFPE, ...) are the
# faulting thread's own and are never blocked.
_ASYNC = frozenset(
    getattr(signal, name)
    for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2", "SIGALRM")
    if hasattr(signal, name)
)


def _block() -> Any:
    if not hasattr(signal, "pthread_sigmask"):
        return None
    return signal.pthread_sigmask(signal.SIG_BLOCK, _ASYNC)


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Block the asynchronous signals in this thread for the block: threads started in it
    inherit the mask (a library's threads, which nebula does not start itself).

    Example:
        >>> import signal
        >>> with quiet():
        ...     signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, [])
        True
    """
    previous = _block()
    try:
        yield
    finally:
        if previous is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def start(thread: threading.Thread) -> threading.Thread:
    """Start `thread` so that it takes no asynchronous signal from its first instruction
    (it inherits the mask this thread holds while starting it); returns it.

    Example:
        >>> import signal, threading
        >>> seen = []
        >>> def look():
        ...     seen.append(signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, []))
        >>> start(threading.Thread(target=look)).join()
        >>> seen
        [True]
    """
    with quiet():
        thread.start()
    return thread
