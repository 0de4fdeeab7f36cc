"""Fresh buffer pages, faulted in ahead of the copy: several threads, and off the caller's.

A snapshot buffer that is new (the first save of an item, or the spare one made for the
next save: slots.py) is a memory-tier file whose pages do not exist yet, and the kernel
hands out fresh /dev/shm pages far slower than a copy into touched ones runs (allocating,
zeroing, and on a VM the hypervisor's first touch of each page). 1 GB on the 2-core VM
(issue #22; wall time, 3 runs each): `posix_fallocate` then `mmap(MAP_POPULATE)`, as
before, 0.72-0.84 s, and MAP_POPULATE maps a shared file's pages read-only, so the copy
faults each one again; `madvise(MADV_POPULATE_WRITE)` 0.46-0.65 s from one thread,
0.37-0.77 s from two; writing zeros 0.59-0.83 s; a copy into touched pages 0.1 s. In CPU
seconds (5 runs, a busy machine): 0.79 with MAP_POPULATE, 0.49-0.56 with madvise.

A `Population` faults in the pages of a mapped range, writable, with
`madvise(MADV_POPULATE_WRITE)` (Linux 5.14; 23, through ctypes: Python's mmap module has
no such constant before 3.13), in `CHUNK_BYTES` chunks that any number of threads take
in turn, each chunk of the file allocated first when the caller gives its descriptor (so
that a full filesystem is an ENOSPC there, never a SIGBUS later). A first save populates
with two threads (`populate`); a spare buffer is populated by a background thread at low
priority, and a save that needs it before it is done takes the remaining chunks itself
(`Population.run`). A kernel without MADV_POPULATE_WRITE gets a memset of the (allocated)
chunk instead; any other failure leaves the rest to be faulted in by the copy. Populating
does not change the bytes.

May import: nothing of nebula's (it only touches memory and files it is given). Not for:
which files are buffers (slots.py) or what is copied into them (snapshot.py).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import threading

from nebulaml._threads import start as start_thread

CHUNK_BYTES = 16 << 20  # a thread's unit of work: small enough to share, large per call
POPULATE_THREADS = 2  # a first save's (snapshot.FILL_WORKERS: the copy's own threads)
SPARE_NICE = 10  # a spare buffer is populated this much nicer than training
MADV_POPULATE_WRITE = 23  # <linux/mman.h>, Linux 5.14+

_libc = ctypes.CDLL(None, use_errno=True)
_madvise = _libc.madvise
_madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_madvise.restype = ctypes.c_int
_supported = True  # False once the kernel refused MADV_POPULATE_WRITE (EINVAL)


class Population:
    """The pages of `length` bytes at `address` (a shared mapping of an allocated file),
    faulted in writable in chunks by whichever threads call `work`.

    Example:
        >>> import mmap
        >>> mm = mmap.mmap(-1, 3 << 20)
        >>> address = ctypes.addressof(ctypes.c_char.from_buffer(mm))
        >>> p = Population(address, len(mm), chunk_bytes=1 << 20)
        >>> p.run(threads=2)
        >>> p.done(), p.cancelled, p.error
        (True, False, None)
        >>> mm.close()
    """

    def __init__(
        self,
        address: int,
        length: int,
        *,
        fd: int | None = None,
        chunk_bytes: int = CHUNK_BYTES,
    ) -> None:
        self.address = address
        self.length = length
        self.fd = fd  # given: each chunk of the file is allocated first (posix_fallocate)
        self.chunk_bytes = chunk_bytes
        self.cancelled = False
        self.error: OSError | None = None  # the first allocation that failed (ENOSPC)
        self._chunks = -(-length // chunk_bytes)
        self._taken = 0  # chunks handed out
        self._finished = 0  # chunks handed out and done
        self._cond = threading.Condition()

    def _take(self) -> int | None:
        with self._cond:
            if self.cancelled or self._taken >= self._chunks:
                return None
            self._taken += 1
            return self._taken - 1

    def work(self) -> None:
        """Populate chunks in this thread until none is left (or the population is
        cancelled); returns without waiting for the chunks other threads hold."""
        while (i := self._take()) is not None:
            try:
                offset = i * self.chunk_bytes
                length = min(self.chunk_bytes, self.length - offset)
                if self.fd is not None:
                    os.posix_fallocate(self.fd, offset, length)
                _populate(self.address + offset, length)
            except OSError as exc:
                with self._cond:
                    self.error = self.error or exc
                    self.cancelled = True  # the rest is not allocated: never touched
            finally:
                with self._cond:
                    self._finished += 1
                    self._cond.notify_all()

    def run(self, threads: int = POPULATE_THREADS) -> None:
        """Populate every chunk with `threads` threads, this one included; returns when
        all are done (also those another thread took meanwhile), or raises the error of
        an allocation that failed."""
        with self._cond:
            threads = min(threads, self._chunks - self._taken)  # no helper without work
        helpers = [threading.Thread(target=self.work, daemon=True) for _ in range(threads - 1)]
        for helper in helpers:
            start_thread(helper)
        try:
            self.work()
        finally:
            for helper in helpers:
                helper.join()
        self.wait()
        if self.error is not None:
            raise self.error

    def wait(self) -> None:
        """Until every chunk handed out is done (a chunk is a few milliseconds)."""
        with self._cond:
            self._cond.wait_for(lambda: self._finished == self._taken)

    def cancel(self) -> None:
        """Hand out no more chunks, and wait for those being populated."""
        with self._cond:
            self.cancelled = True
        self.wait()

    def done(self) -> bool:
        """Whether every chunk was populated (not cancelled before the end)."""
        with self._cond:
            return self._finished == self._chunks


def populate(
    address: int, length: int, *, fd: int | None = None, threads: int = POPULATE_THREADS
) -> None:
    """Fault in the pages of a shared mapping, `threads` threads at once: of the file
    `fd`, allocated chunk by chunk first (an OSError, e.g. ENOSPC, if one cannot be), or
    of a range already allocated."""
    Population(address, length, fd=fd).run(threads)


def lower_priority() -> None:
    """Run this thread `SPARE_NICE` steps nicer than it was (a background thread's work
    yields to training's)."""
    with contextlib.suppress(OSError, AttributeError):
        tid = threading.get_native_id()
        nice = os.getpriority(os.PRIO_PROCESS, tid)
        os.setpriority(os.PRIO_PROCESS, tid, min(19, nice + SPARE_NICE))


def _populate(address: int, length: int) -> None:
    global _supported
    if _supported:
        if _madvise(address, length, MADV_POPULATE_WRITE) == 0:
            return
        if ctypes.get_errno() != errno.EINVAL:
            return  # e.g. out of memory: the copy faults the rest in (or fails) itself
        _supported = False
    ctypes.memset(address, 0, length)  # allocated and about to be overwritten whole
