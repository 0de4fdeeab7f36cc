"""The kernel's record of which pages of a process were written: every writer seen.

A lazy snapshot (fence.py) copies the saved tensors after `save()` returns, so it must see
any write to them before the copy. Version counters miss writes through `.data`, NumPy
views, pointers and kernels that do not bump them; a guard in Python misses other threads
and compiled code (`benchmarks/lazy_guard_cost.py`). The kernel misses none of them: a
`userfaultfd` registered in write-protect mode with `UFFD_FEATURE_WP_ASYNC` (Linux 6.7)
lets every write to a protected page through at once and marks the page written, and the
`PAGEMAP_SCAN` ioctl of /proc/self/pagemap lists the written pages of a range. No fault
handler runs, so no writer waits for anything (a handler in Python would wait for the
GIL a writer may hold).

A `WriteWatch` registers page ranges once (`register`; it splits the process's mappings,
so a session keeps them), protects them (`protect`: at each save, on the caller's thread),
lists what was written since (`written`), and lifts the protection (`protect(False)`).
Only whole pages can be watched: the bytes of a storage in a page it shares with other
memory (at most a page at each end, `inner_pages`) must be taken at once by the caller.
Costs, measured by `benchmarks/write_watch_probe.py` on a 2-core VM: protecting 0.195 GB
1.9 ms and 1.49 GB 11.4 ms, a scan 0.3 and 1.2 ms; a forward and backward with the state
protected wrote none of its pages; writes through a NumPy view, `.data` and another
thread were each found.

Where the kernel is older, the architecture unknown to this module, or userfaultfd not
allowed (a seccomp profile, `vm.unprivileged_userfaultfd` without user-mode faults, which
this asks for), `unavailable()` says why and nothing is watched.

May import: nothing of nebula's (system calls on memory it is given). Not for: what is
watched or what a written page means to a save (fence.py).
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
import platform
from collections.abc import Iterable

PAGE = mmap.PAGESIZE
_SYSCALL = {"x86_64": 323, "aarch64": 282, "arm64": 282}  # __NR_userfaultfd
_USER_MODE_ONLY = 1  # UFFD_USER_MODE_ONLY: what an unprivileged process may ask for
_API = 0xAA
_WP_UNPOPULATED = 1 << 14  # pages never touched are protected too
_WP_ASYNC = 1 << 15
_UFFDIO_API = 0xC018AA3F
_UFFDIO_REGISTER = 0xC020AA00
_UFFDIO_UNREGISTER = 0x8010AA01
_UFFDIO_WRITEPROTECT = 0xC018AA06
_REGISTER_MODE_WP = 1 << 1
_WRITEPROTECT_MODE_WP = 1
_PAGEMAP_SCAN = 0xC0606610
_SCAN_CHECK_WPASYNC = 1 << 1
_PAGE_IS_WRITTEN = 1 << 1
_MADV_COLLAPSE = 25  # Linux 6.1: back a range with transparent huge pages now
_HUGE_PAGE_SIZE = "/sys/kernel/mm/transparent_hugepage/hpage_pmd_size"


class _Api(ctypes.Structure):
    _fields_ = [("api", ctypes.c_uint64), ("features", ctypes.c_uint64),
                ("ioctls", ctypes.c_uint64)]  # fmt: skip


class _Register(ctypes.Structure):
    _fields_ = [("start", ctypes.c_uint64), ("len", ctypes.c_uint64),
                ("mode", ctypes.c_uint64), ("ioctls", ctypes.c_uint64)]  # fmt: skip


class _Range(ctypes.Structure):
    _fields_ = [("start", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Protect(ctypes.Structure):
    _fields_ = [("start", ctypes.c_uint64), ("len", ctypes.c_uint64),
                ("mode", ctypes.c_uint64)]  # fmt: skip


class _Region(ctypes.Structure):
    _fields_ = [("start", ctypes.c_uint64), ("end", ctypes.c_uint64),
                ("categories", ctypes.c_uint64)]  # fmt: skip


class _Scan(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in (
        "size", "flags", "start", "end", "walk_end", "vec", "vec_len", "max_pages",
        "category_inverted", "category_mask", "category_anyof_mask", "return_mask")]  # fmt: skip


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _ioctl(fd: int, request: int, arg: ctypes.Structure) -> int:
    result = _libc().ioctl(fd, ctypes.c_ulong(request), ctypes.byref(arg))
    if result < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"ioctl {request:#x}: {os.strerror(err)}")
    return int(result)


def whole_pages(address: int, size: int, page: int = PAGE) -> tuple[int, int]:
    """(start, end) of the whole pages (of `page` bytes: a huge page's, say) inside
    `size` bytes at `address` (end <= start: none).

    Example:
        >>> whole_pages(PAGE + 8, 3 * PAGE) == (2 * PAGE, 4 * PAGE)
        True
    """
    return -(-address // page) * page, (address + size) // page * page


def inner_pages(spans: Iterable[tuple[int, int]]) -> tuple[list[tuple[int, int]], int]:
    """The whole pages inside each (address, bytes) span, merged where they touch, and the
    bytes of the spans left out (in pages they share with other memory).

    Example:
        >>> inner_pages([(PAGE + 8, 3 * PAGE)]) == ([(2 * PAGE, 4 * PAGE)], PAGE)
        True
    """
    ranges: list[tuple[int, int]] = []
    outside = 0
    for address, size in sorted(spans):
        start, end = whole_pages(address, size)
        if end <= start:
            outside += size
            continue
        outside += size - (end - start)
        if ranges and ranges[-1][1] >= start:
            ranges[-1] = (ranges[-1][0], max(ranges[-1][1], end))
        else:
            ranges.append((start, end))
    return ranges, outside


@functools.cache
def _huge_page() -> int:
    """The size of a transparent huge page here (0: none)."""
    try:
        with open(_HUGE_PAGE_SIZE) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return 0


def collapse(spans: Iterable[tuple[int, int]]) -> int:
    """Back the whole huge pages inside each (address, bytes) span with transparent huge
    pages (`madvise(MADV_COLLAPSE)`, Linux 6.1, where the system allows them: the
    "madvise" or "always" mode), so that protecting them later costs one page table entry
    per huge page instead of 512 (1.4 GB: 7-11 ms instead of 30 on a 2-core VM). The
    bytes stay where they are, the memory used the same. Returns the bytes collapsed; a
    block the kernel refuses (huge pages off, none free, a page protected meanwhile)
    stays in small pages.

    Example:
        >>> collapse([(PAGE, PAGE)])  # no whole huge page inside
        0
    """
    huge = _huge_page()
    if not huge:
        return 0
    done = 0
    for address, size in spans:
        start, end = whole_pages(address, size, huge)
        if end > start and _libc().madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start),
                                           _MADV_COLLAPSE) == 0:  # fmt: skip
            done += end - start
    return done


class WriteWatch:
    """Page ranges of this process, write-protected in the kernel's asynchronous mode:
    every write goes through and marks its page written.

    Example:
        >>> import mmap
        >>> if unavailable() is None:
        ...     memory = mmap.mmap(-1, 4 * PAGE)
        ...     address = ctypes.addressof(ctypes.c_char.from_buffer(memory))
        ...     watch = WriteWatch()
        ...     watch.register([(address, address + 4 * PAGE)])
        ...     watch.protect()
        ...     memory[2 * PAGE] = 1
        ...     assert watch.written() == [(address + 2 * PAGE, address + 3 * PAGE)]
        ...     watch.close()
    """

    def __init__(self) -> None:
        number = _SYSCALL.get(platform.machine())
        if number is None:
            raise OSError(0, f"no userfaultfd system call known for {platform.machine()}")
        fd = _libc().syscall(number, os.O_CLOEXEC | os.O_NONBLOCK | _USER_MODE_ONLY)
        if fd < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"userfaultfd: {os.strerror(err)}")
        try:
            want = _WP_ASYNC | _WP_UNPOPULATED
            api = _Api(_API, want, 0)
            _ioctl(fd, _UFFDIO_API, api)
            if api.features & want != want:
                raise OSError(0, "the kernel has no asynchronous write-protect (Linux 6.7)")
            self._pagemap = os.open("/proc/self/pagemap", os.O_RDONLY | os.O_CLOEXEC)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        self.ranges: list[tuple[int, int]] = []
        self._vec = (_Region * 256)()

    def register(self, ranges: Iterable[tuple[int, int]]) -> None:
        """Register (start, end) page-aligned ranges of mapped memory for `protect`."""
        for start, end in ranges:
            if start % PAGE or end % PAGE or end <= start:
                raise ValueError(f"not a range of whole pages: {start:#x}-{end:#x}")
            _ioctl(self._fd, _UFFDIO_REGISTER,
                   _Register(start, end - start, _REGISTER_MODE_WP, 0))  # fmt: skip
            self.ranges.append((start, end))

    def unregister(self, ranges: Iterable[tuple[int, int]]) -> None:
        """Forget registered ranges (their protection lifted first)."""
        for start, end in list(ranges):
            self.ranges.remove((start, end))
            try:
                _ioctl(self._fd, _UFFDIO_WRITEPROTECT, _Protect(start, end - start, 0))
                _ioctl(self._fd, _UFFDIO_UNREGISTER, _Range(start, end - start))
            except OSError:
                pass  # unmapped since: nothing left to lift

    def protect(self, on: bool = True, ranges: Iterable[tuple[int, int]] | None = None) -> None:
        """Protect the registered ranges, or those of `ranges` (registered, or inside one):
        what was written is forgotten, and the next write to each page marks it. Or lift
        the protection (`on` False): writes mark nothing."""
        mode = _WRITEPROTECT_MODE_WP if on else 0
        for start, end in self.ranges if ranges is None else ranges:
            _ioctl(self._fd, _UFFDIO_WRITEPROTECT, _Protect(start, end - start, mode))

    def written(self, ranges: Iterable[tuple[int, int]] | None = None) -> list[tuple[int, int]]:
        """The (start, end) runs of pages written since `protect`, of the registered
        ranges or of `ranges`, in their order. Every page of a range whose protection was
        lifted counts as written: nothing can be told of it."""
        found = []
        vec = self._vec
        for start, end in self.ranges if ranges is None else ranges:
            at = start
            while at < end:
                scan = _Scan(ctypes.sizeof(_Scan), _SCAN_CHECK_WPASYNC, at, end, 0,
                             ctypes.addressof(vec), len(vec), 0, 0, _PAGE_IS_WRITTEN, 0,
                             _PAGE_IS_WRITTEN)  # fmt: skip
                n = _ioctl(self._pagemap, _PAGEMAP_SCAN, scan)
                found += [(vec[i].start, vec[i].end) for i in range(n)]
                at = scan.walk_end if n == len(vec) and scan.walk_end > at else end
        return found

    def close(self) -> None:
        """Lift the protection, unregister, and close the descriptors."""
        try:
            self.unregister(self.ranges)
        finally:
            self.ranges = []
            os.close(self._fd)
            os.close(self._pagemap)


@functools.cache
def unavailable() -> str | None:
    """None where a `WriteWatch` works here (checked once, on a page of its own), else
    why not."""
    try:
        memory = mmap.mmap(-1, 2 * PAGE)
        address = ctypes.addressof(ctypes.c_char.from_buffer(memory))
        watch = WriteWatch()
    except OSError as exc:
        return str(exc)
    try:
        watch.register([(address, address + 2 * PAGE)])
        watch.protect()
        memory[PAGE] = 1
        if watch.written() != [(address + PAGE, address + 2 * PAGE)]:
            return "the kernel did not mark the page written"
        return None
    except OSError as exc:
        return str(exc)
    finally:
        watch.close()
