"""runtime/write_watch.py: the kernel's record of written pages sees the writers that
version counters and guards in Python miss, and nothing else."""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from nebulaml.runtime import write_watch
from nebulaml.runtime.write_watch import PAGE, WriteWatch, inner_pages, unavailable


def _refused() -> str | None:
    """Why this machine refuses a userfaultfd of the kind asked for (the kernel, a seccomp
    profile), else None: then every test here runs, and `unavailable()` must say yes."""
    try:
        WriteWatch().close()
    except OSError as exc:
        return str(exc)
    return None


pytestmark = pytest.mark.skipif(_refused() is not None, reason=f"refused here: {_refused()}")


def test_where_the_kernel_allows_it_the_watch_is_available() -> None:
    assert unavailable() is None


@pytest.fixture
def watched() -> Iterator[tuple[torch.Tensor, WriteWatch, int]]:
    """A tensor of 64 pages, its whole pages watched and protected; the address of its
    first whole page."""
    tensor = torch.arange(64 * PAGE // 4, dtype=torch.float32)
    ranges, _ = inner_pages([(tensor.data_ptr(), tensor.nbytes)])
    watch = WriteWatch()
    watch.register(ranges)
    watch.protect()
    yield tensor, watch, ranges[0][0]
    watch.close()


def _index(tensor: torch.Tensor, address: int) -> int:
    return (address - tensor.data_ptr()) // tensor.element_size()


def _page(address: int) -> list[tuple[int, int]]:
    return [(address, address + PAGE)]


def test_reading_a_watched_tensor_writes_nothing(watched: tuple) -> None:
    tensor, watch, _ = watched
    copy = tensor.clone()
    assert float(tensor.sum()) == float(copy.sum())
    torch.nn.functional.linear(torch.ones(2, 8), tensor[: 8 * 8].view(8, 8))
    assert watch.written() == []


@pytest.mark.parametrize("writer", ["numpy", "data", "thread", "pointer", "kernel"])
def test_every_writer_a_version_counter_misses_is_seen(
    watched: tuple, writer: str, tmp_path: Path
) -> None:
    """Bug it would catch: a write that leaves no mark (a lazy copy then takes a state that
    no save had). Each writer here bumps no version counter, or runs where no guard in
    Python sees it."""
    tensor, watch, first = watched
    at = first + 5 * PAGE  # a page well inside
    version = tensor._version
    if writer == "numpy":
        tensor.numpy()[_index(tensor, at)] = -1.0
    elif writer == "data":
        tensor.data[_index(tensor, at)] = -1.0
        assert tensor._version == version  # unseen by the version counter
    elif writer == "thread":
        thread = threading.Thread(target=lambda: tensor[_index(tensor, at)].fill_(-1.0))
        thread.start()
        thread.join()
    elif writer == "pointer":
        ctypes.memset(at, 0xFF, 16)
    else:  # the kernel, on the process's behalf: a read from a file into the tensor
        source = tmp_path / "bytes"
        source.write_bytes(b"\xff" * 16)
        fd = os.open(source, os.O_RDONLY)
        try:
            view = memoryview(tensor.numpy()).cast("B")
            offset = at - tensor.data_ptr()
            assert os.readv(fd, [view[offset : offset + 16]]) == 16
        finally:
            os.close(fd)
    assert watch.written() == _page(at)


def test_protecting_again_forgets_and_a_lifted_watch_counts_every_page_written(
    watched: tuple,
) -> None:
    """Bug it would catch: a copy trusting a watch whose protection was lifted early."""
    tensor, watch, first = watched
    tensor.numpy()[_index(tensor, first)] = -1.0
    assert watch.written() == _page(first)
    watch.protect()
    assert watch.written() == []  # a new save: what was written before is not its own
    watch.protect(False)
    assert watch.written() == watch.ranges  # nothing can be told: every page counts


def test_a_run_of_written_pages_is_one_region_and_many_regions_are_all_listed(
    watched: tuple,
) -> None:
    tensor, watch, first = watched
    flat = tensor.numpy()
    flat[_index(tensor, first) : _index(tensor, first + 3 * PAGE)] = -1.0
    every_other = [first + k * PAGE for k in range(8, 60, 2)]
    for address in every_other:
        flat[_index(tensor, address)] = -1.0
    written = watch.written()
    assert written[0] == (first, first + 3 * PAGE)
    assert written[1:] == [(a, a + PAGE) for a in every_other]


def test_inner_pages_merges_touching_storages_and_counts_the_bytes_left_out() -> None:
    spans = [(10 * PAGE, 2 * PAGE), (12 * PAGE, PAGE + 100), (20 * PAGE + 1, PAGE)]
    ranges, outside = inner_pages(spans)
    assert ranges == [(10 * PAGE, 13 * PAGE)]
    assert outside == 100 + PAGE  # the tail of the second; all of the third


def test_watch_registers_only_whole_pages(watched: tuple) -> None:
    _, watch, first = watched
    with pytest.raises(ValueError, match="whole pages"):
        watch.register([(first + 8, first + PAGE)])


def test_where_the_system_call_is_unknown_it_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(write_watch, "_SYSCALL", {})
    why = unavailable.__wrapped__()
    assert why is not None and "no userfaultfd system call" in why


def test_a_watch_over_huge_pages_still_sees_each_written_page() -> None:
    # Lazy saves collapse what they watch into huge pages (write_watch.collapse) so that
    # protecting it costs less. Catches: a protect or a scan that loses the small page
    # written (or reports none) once the range is one huge page, a collapse that moves or
    # changes the bytes, and one asked for a range not cut at huge pages.
    huge = write_watch._huge_page()
    if not huge:
        pytest.skip("no transparent huge pages here")
    tensor = torch.arange(3 * huge // 4, dtype=torch.float32)
    before = tensor.clone()
    ranges, _ = inner_pages([(tensor.data_ptr(), tensor.nbytes)])
    watch = WriteWatch()
    watch.register(ranges)
    try:
        watch.protect()
        watch.protect(False)
        done = write_watch.collapse([(tensor.data_ptr(), tensor.nbytes)])
        if done < huge:
            pytest.skip("the kernel collapsed nothing here (huge pages off, or none free)")
        assert done % huge == 0  # whole huge pages inside the tensor, none beyond it
        assert torch.equal(tensor, before)
        watch.protect()
        assert watch.written() == []
        inside = -(-tensor.data_ptr() // huge) * huge + 5 * PAGE + 8  # a huge page's 6th
        tensor.data[_index(tensor, inside)] = -1.0
        written = watch.written()
        assert written and all(lo <= inside < hi for lo, hi in written[:1]), written
        assert sum(hi - lo for lo, hi in written) < huge  # that page, not the whole block
    finally:
        watch.close()
