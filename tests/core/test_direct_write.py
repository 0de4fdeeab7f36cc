"""Persist writes (`Store.write_view`, local_files.DirectFile): the bytes land whole, with
any tail, through O_DIRECT where the filesystem allows it (so a persist leaves nothing in
the page cache), buffered where it does not (tmpfs), and a failure leaves no file."""

from __future__ import annotations

import errno
import hashlib
import mmap
import os
from pathlib import Path

import pytest

from benchmarks.measure import resident_fraction
from nebulaml.errors import StorageError
from nebulaml.storage import view_writes
from nebulaml.storage.local_files import DIRECT_ALIGN, DirectFile
from nebulaml.storage.store import Store

PIECE = 16 * DIRECT_ALIGN


def _source(size: int) -> mmap.mmap:
    """Page-aligned memory with bytes that differ from piece to piece."""
    buf = mmap.mmap(-1, max(size, 1))
    pattern = hashlib.sha256(str(size).encode()).digest() * (size // 32 + 1)
    buf[:size] = pattern[:size]
    return buf


def _direct_allowed(folder: Path) -> bool:
    try:
        fd = os.open(folder / ".probe", os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600)
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            return False
        raise
    os.close(fd)
    os.unlink(folder / ".probe")
    return True


@pytest.fixture(autouse=True)
def small_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(view_writes, "VIEW_CHUNK_BYTES", PIECE)  # several pieces per file


@pytest.mark.parametrize("size", [1, DIRECT_ALIGN - 1, DIRECT_ALIGN, 3 * PIECE + 5])
def test_write_view_writes_every_byte_and_hashes_every_piece_in_order(
    tmp_path: Path, size: int
) -> None:
    src = _source(size)
    seen: list[bytes] = []
    view = memoryview(src)[:size]
    store = Store(str(tmp_path))
    store.make_dir("tag")
    store.write_view(("tag", "item"), view, lambda p: seen.append(bytes(p)))
    view.release()
    assert (tmp_path / "tag" / "item").read_bytes() == src[:size]
    assert b"".join(seen) == src[:size]
    assert all(len(p) == PIECE for p in seen[:-1])


def test_direct_writes_leave_the_page_cache_alone(tmp_path: Path) -> None:
    if not _direct_allowed(tmp_path):
        pytest.skip("this filesystem refuses O_DIRECT")
    size = 64 * PIECE + 123  # 4 MiB and a tail
    src = _source(size)
    store = Store(str(tmp_path))
    store.make_dir("tag")
    with memoryview(src)[:size] as view:
        store.write_view(("tag", "item"), view, lambda _p: None)
    path = tmp_path / "tag" / "item"
    # Only the unaligned tail went through the cache; a buffered write leaves it all there.
    assert resident_fraction([path]) < 0.05
    with open(path, "rb") as f:
        assert f.read() == src[:size]
    # The control: the same bytes written buffered are resident.
    buffered = tmp_path / "buffered"
    buffered.write_bytes(src[:size])
    assert resident_fraction([buffered]) > 0.5


def test_tmpfs_takes_buffered_writes() -> None:
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    path = f"/dev/shm/nebula-test-{os.getpid()}"
    try:
        out = DirectFile(path, durable=True)
        src = _source(DIRECT_ALIGN + 7)
        out.write_at(memoryview(src)[: DIRECT_ALIGN + 7], 0)
        out.close()
        assert not out.direct  # tmpfs refuses O_DIRECT: the file took buffered writes
        with open(path, "rb") as f:
            assert f.read() == src[: DIRECT_ALIGN + 7]
    finally:
        os.unlink(path)


def test_a_failure_mid_file_removes_it_and_is_raised(tmp_path: Path) -> None:
    src = _source(3 * PIECE)
    calls = 0

    def fail_on_the_third_piece(_piece: memoryview) -> None:
        nonlocal calls
        calls += 1
        if calls == 3:
            raise RuntimeError("hash failed")

    store = Store(str(tmp_path))
    store.make_dir("tag")
    with memoryview(src) as view, pytest.raises(RuntimeError, match="hash failed"):
        store.write_view(("tag", "item"), view, fail_on_the_third_piece)
    assert not (tmp_path / "tag" / "item").exists()
    src.close()  # no piece of the view is still exported (a write left running would be)


def test_a_failed_write_is_raised_as_a_storage_error(tmp_path: Path) -> None:
    store = Store(str(tmp_path))
    store.make_dir("tag")
    (tmp_path / "tag" / "item").mkdir()  # the file cannot be created
    src = _source(PIECE)
    with memoryview(src) as view, pytest.raises(StorageError, match="tag/item"):
        store.write_view(("tag", "item"), view, lambda _p: None)
