"""Measuring tools for the peer benchmark: memory sampling, page cache, fsync, sizes.

`MemorySampler` samples, in a background thread, this process's anonymous resident memory
(`RssAnon` in /proc/self/status: heap and anonymous mappings, not the page cache and not
file-backed or shared-memory mappings, so nothing is counted twice) and the allocated size
of the folders a method keeps in RAM (nebula's memory tier in /dev/shm). `drop_page_cache`
evicts files from the page cache with posix_fadvise(DONTNEED) after fsync, and
`resident_fraction` checks with mincore(2) how much of a file is still cached.

Not for: deciding what to measure (bench.py) or driving the methods (peers.py).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import resource
import statistics
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from types import TracebackType

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
_MAP_FAILED = ctypes.c_void_p(-1).value


def rss_anon_bytes() -> int:
    """This process's anonymous resident memory (RssAnon), in bytes."""
    with open("/proc/self/status", "rb") as f:
        for line in f:
            if line.startswith(b"RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


def write_bytes() -> int | None:
    """This process's `write_bytes` from /proc/self/io: what every thread of it (the
    exited ones too) sent toward a block device, counted when a page is dirtied or a
    direct write submitted (tmpfs counts nothing); None where the file or field is not
    there."""
    try:
        with open("/proc/self/io", "rb") as f:
            for line in f:
                if line.startswith(b"write_bytes:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


PROBE_BYTES = 1 << 20


def disk_writes_counted(folder: Path) -> bool:
    """Whether this process's writes into `folder` show in its `write_bytes`: 1 MiB
    written and fsynced there must raise it by at least 1 MiB (not on tmpfs, nor where
    the kernel keeps no task I/O accounting). The file is removed."""
    before = write_bytes()
    if before is None:
        return False
    probe = folder / ".write-bytes-probe"
    try:
        with open(probe, "wb") as f:
            f.write(os.urandom(PROBE_BYTES))
            f.flush()
            os.fsync(f.fileno())
        after = write_bytes()
    finally:
        probe.unlink(missing_ok=True)
    return after is not None and after - before >= PROBE_BYTES


def files_under(paths: Iterable[Path]) -> Iterator[Path]:
    """Every regular file under `paths` (files or folders; missing ones are skipped)."""
    for path in paths:
        if path.is_file():
            yield path
        elif path.is_dir():
            for folder, _dirs, names in os.walk(path):
                for name in names:
                    full = Path(folder, name)
                    if full.is_file() and not full.is_symlink():
                        yield full


def tree_bytes(paths: Iterable[Path], *, allocated: bool = False) -> int:
    """Total size of the files under `paths`: apparent (st_size) or allocated (st_blocks)."""
    total = 0
    for path in files_under(paths):
        try:
            st = path.stat()
        except FileNotFoundError:  # removed while we walk (nebula evicting a copy)
            continue
        total += st.st_blocks * 512 if allocated else st.st_size
    return total


def fsync_tree(paths: Iterable[Path]) -> None:
    """fsync every file under `paths`, then their folders (what makes a peer's files durable
    when the peer itself does not)."""
    folders: set[Path] = set()
    for path in files_under(paths):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        folders.add(path.parent)
    for folder in folders:
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def drop_page_cache(paths: Iterable[Path]) -> None:
    """Write back and evict the files under `paths` from the page cache
    (fsync, then posix_fadvise(POSIX_FADV_DONTNEED)); needs no privileges."""
    for path in files_under(paths):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def resident_fraction(paths: Iterable[Path]) -> float:
    """The fraction of the pages of the files under `paths` that are in the page cache
    (mincore(2)); 0.0 means a read must go to the device."""
    page = mmap.PAGESIZE
    resident = total = 0
    for path in files_under(paths):
        size = path.stat().st_size
        if size == 0:
            continue
        pages = (size + page - 1) // page
        fd = os.open(path, os.O_RDONLY)
        try:
            addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if addr in (None, _MAP_FAILED):
                raise OSError(ctypes.get_errno(), f"mmap {path}")
            try:
                vec = (ctypes.c_ubyte * pages)()
                if _libc.mincore(addr, size, vec) != 0:
                    raise OSError(ctypes.get_errno(), f"mincore {path}")
                resident += sum(b & 1 for b in vec)
            finally:
                _libc.munmap(addr, size)
        finally:
            os.close(fd)
        total += pages
    return resident / total if total else 0.0


class MemorySampler:
    """Peak extra memory during a window, sampled every `interval_s` in a thread.

    Extra memory at a sample = (RssAnon - RssAnon at the start of the window
    - `discount_bytes`) + `retained_bytes` (what the method holds from earlier saves,
    e.g. a reused staging buffer) + the allocated size of the files under `shm_dirs`
    (e.g. nebula's memory tier, which belongs to the method alone, so its baseline is
    zero). The caller sets `discount_bytes` while training work that is not the
    method's runs inside the window (a forward/backward's own activations and buffers).
    """

    def __init__(
        self, shm_dirs: Sequence[Path] = (), *, retained_bytes: int = 0, interval_s: float = 0.005
    ) -> None:
        self.shm_dirs = list(shm_dirs)
        self.retained_bytes = retained_bytes
        self.interval_s = interval_s
        self.peak_extra_bytes = 0
        self.peak_anon_bytes = 0  # RssAnon above the baseline, plus retained_bytes
        self.peak_shm_bytes = 0
        self.samples = 0
        self.discount_bytes = 0
        self._base_anon = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-mem-sampler", daemon=True)

    def __enter__(self) -> MemorySampler:
        self._base_anon = rss_anon_bytes()
        self._sample()
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()

    def _sample(self) -> None:
        anon = rss_anon_bytes() - self._base_anon - self.discount_bytes
        anon = max(0, anon) + self.retained_bytes
        shm = tree_bytes(self.shm_dirs, allocated=True) if self.shm_dirs else 0
        self.peak_anon_bytes = max(self.peak_anon_bytes, anon)
        self.peak_shm_bytes = max(self.peak_shm_bytes, shm)
        self.peak_extra_bytes = max(self.peak_extra_bytes, anon + shm)
        self.samples += 1

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()


class CpuShare:
    """How much of the machine's CPU time other processes used during a window: the
    system's busy time (/proc/stat) minus this process's own (getrusage), over wall time
    times the CPU count. Above a few percent, the timings are disturbed."""

    def __init__(self) -> None:
        self._start = self._read()

    @staticmethod
    def _read() -> tuple[float, float, float]:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        # user nice system idle iowait irq softirq steal ...: busy = all but idle, iowait
        busy = (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return time.perf_counter(), busy, usage.ru_utime + usage.ru_stime

    def other_share(self) -> float:
        """Other processes' share of all CPUs since this object was made (0..1)."""
        t1, busy1, own1 = self._read()
        t0, busy0, own0 = self._start
        wall = (t1 - t0) * (os.cpu_count() or 1)
        return max(0.0, ((busy1 - busy0) - (own1 - own0)) / wall) if wall > 0 else 0.0


def summarize(values: Sequence[float]) -> dict[str, float]:
    """Median, min and max of `values` (the repeats of one figure)."""
    if not values:
        return {}
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "n": len(values),
    }


class Stopwatch:
    """`with Stopwatch() as sw: ...` then `sw.seconds`."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._t0 = 0.0

    def __enter__(self) -> Stopwatch:
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *_exc: object) -> None:
        self.seconds = time.perf_counter() - self._t0
