"""Progress on stderr for the commands that move bytes (copy, export, flush, latest --local,
verify): a bar on a terminal, plain lines in a pipe, nothing with --quiet.

An operation may have phases that alternate (a copy writes an item, then reads it back
from the destination to verify it): `phases` gives each its own row on a terminal and its
own lines in a pipe, so that a copy never sits at 100% saying nothing while it verifies.

Not for: tables (tables.py), errors (exits.py) or retries and warnings (logs.py).
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from rich.console import Console
from rich.text import Text

from .console import stderr
from .formatting import human_bytes

# Off a terminal, progress is a plain line on stderr at most this often (none for an
# operation that ends sooner).
PROGRESS_INTERVAL_S = 2.0

Progress = Callable[[int, int], None]


@contextlib.contextmanager
def progress(
    label: str, *, quiet: bool = False, transient: bool = False
) -> Iterator[Progress | None]:
    """A progress reporter on stderr for `callback(bytes_done, bytes_total)`.

    On a terminal: a bar with bytes, rate and time left, shown from the first bytes (so an
    error found first is alone on stderr). Off a terminal: a plain line every
    PROGRESS_INTERVAL_S seconds while it runs, and a last one when it ends (nothing for
    an operation that ends sooner). `quiet`: nothing (None is yielded).
    """
    with phases([label], quiet=quiet, transient=transient) as (update,):
        yield update


@contextlib.contextmanager
def phases(
    labels: list[str], *, quiet: bool = False, transient: bool = False
) -> Iterator[tuple[Progress | None, ...]]:
    """One reporter per phase of an operation (`labels`: "copying global_step5",
    "verifying global_step5"), as `progress` gives one: on a terminal, a row of the same
    bar each, shown from its phase's first report; off a terminal, lines of their own.

    Example:
        >>> with phases(["copying x", "verifying x"], quiet=True) as (copied, verified):
        ...     copied is verified is None
        True
    """
    if quiet:
        yield tuple(None for _ in labels)
        return
    console = stderr()
    if console.is_terminal:
        with _bar(labels, console, transient) as updates:
            yield updates
        return
    lines = tuple(_Lines(label) for label in labels)
    try:
        yield lines
    finally:
        for each in lines:
            each.finish()


class _Lines:
    """Progress off a terminal: `nebula: copying global_step5: 96.0 MiB of 200.8 MiB (47%),
    48.1 MiB/s`, periodically; the last one says how long it took."""

    def __init__(self, label: str) -> None:
        self.label = label
        self.t0 = self.last = self.latest = 0.0  # from the first report, not the start
        self.done = self.total = 0
        self.started = False
        self.printed = False
        self.lock = threading.Lock()

    def __call__(self, done: int, total: int) -> None:
        with self.lock:
            self.done, self.total = done, total
            now = self.latest = time.monotonic()
            if not self.started:
                self.started, self.t0, self.last = True, now, now
            elif now - self.last >= PROGRESS_INTERVAL_S:
                self.last = now
                self._write(now, final=False)

    def _write(self, now: float, *, final: bool) -> None:
        elapsed = max(now - self.t0, 1e-9)
        pct = 100 if not self.total else min(100, int(100 * self.done / self.total))
        what = f"{human_bytes(self.done)} of {human_bytes(self.total)} ({pct}%)"
        if final:
            what += f" in {elapsed:.1f} s"
        else:
            what += f", {human_bytes(int(self.done / elapsed))}/s"
        sys.stderr.write(f"nebula: {self.label}: {what}\n")
        sys.stderr.flush()
        self.printed = True

    def finish(self) -> None:
        """The last line, if any was printed: the time of this phase's last report (a phase
        that alternates with another does not count the other's time after it)."""
        with self.lock:
            if self.printed:
                self._write(self.latest, final=True)


@contextlib.contextmanager
def _bar(labels: list[str], console: Console, transient: bool) -> Iterator[tuple[Progress, ...]]:
    from rich.progress import BarColumn, ProgressColumn, TaskID, TextColumn, TimeRemainingColumn
    from rich.progress import Progress as RichProgress

    class Bytes(ProgressColumn):
        def render(self, task: Any) -> Text:
            total = "?" if task.total is None else human_bytes(int(task.total))
            return Text(f"{human_bytes(int(task.completed))} / {total}", style="green")

    class Rate(ProgressColumn):
        def render(self, task: Any) -> Text:
            speed = task.finished_speed or task.speed
            return Text("" if speed is None else f"{human_bytes(int(speed))}/s", style="red")

    bar = RichProgress(
        TextColumn("{task.description}"),
        BarColumn(),
        Bytes(),
        Rate(),
        TimeRemainingColumn(),
        console=console,
        transient=transient,
    )
    tasks: dict[int, TaskID] = {}
    lock = threading.Lock()

    def reporter(index: int) -> Progress:
        def update(done: int, total: int) -> None:
            with lock:
                if not tasks:
                    bar.start()
                if index not in tasks:
                    tasks[index] = bar.add_task(labels[index], total=total)
                bar.update(tasks[index], completed=done, total=total)

        return update

    try:
        yield tuple(reporter(i) for i in range(len(labels)))
    finally:
        if tasks:
            bar.stop()
