"""The cold start (issue #22): the second save's buffer is made off the training thread.

After the first commit, the pool makes a spare buffer for each item in a thread of its
own (slots.SlotPool.prepare): allocated, its pages faulted in and mapped, a pool file in
`.slots/` counted in the pool's bytes. The second save then takes it and faults no page
in on the caller's thread (one that comes before the spare is ready populates the rest
itself, and takes it); where the memory budget or the memory tier's filesystem cannot
hold one more buffer, none is made.

A persist in flight (issue #49): the copy it reads is held, so the next save needs a
third buffer; the pool makes it in the background too, and keeps as many free files as
the job lately needed (runtime/buffer_need.py) instead of deleting the third at the next
eviction and faulting it in again at the next overlap. `spare_buffers=False` keeps none.

Bugs these catch: a spare never made (the second save faults its buffer in, as the first
did), made but not taken (a third buffer), made beyond the budget or the free space, and
one left behind at shutdown; no spare while a persist holds the copy before (the save
faults a new buffer in), a needed third buffer deleted at each eviction, spares kept when
told not to. Speed itself is shown by benchmarks/cold_start.py and
benchmarks/persist_stall.py.
"""

from __future__ import annotations

import os
import resource
import threading
import time
from pathlib import Path

import pytest
import torch

import nebulaml as nm
from nebulaml.runtime import budget as budget_module
from nebulaml.runtime import pages, persist_step
from nebulaml.runtime import session as _session
from nebulaml.runtime.slots import SlotPool
from nebulaml.storage.store import Store

MB = 1 << 20
PAGE = 4096
SIZE = 16 * MB


def _state(step: int, size_bytes: int = SIZE) -> dict[str, torch.Tensor]:
    return {"w": torch.full((size_bytes // 4,), float(step))}


def _save(step: int, size_bytes: int = SIZE, state: dict[str, torch.Tensor] | None = None) -> None:
    state = _state(step, size_bytes) if state is None else state
    nm.Checkpoint(f"global_step{step}").save("model", state)


def _pool_files(root: Path) -> dict[str, os.stat_result]:
    slots = Path(nm.memory_tier_path(str(root))) / ".slots"
    if not slots.is_dir():
        return {}
    return {p.name: p.stat() for p in slots.iterdir()}


def _item(root: Path, step: int) -> os.stat_result:
    return (Path(nm.memory_tier_path(str(root))) / f"global_step{step}" / "model").stat()


def _thread_faults() -> int:
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt


def _resident_bytes(address: int) -> int:
    """Rss of this process's mapping that starts at `address` (/proc/self/smaps): the
    bytes of its pages present in the page table, i.e. faulted in."""
    lines = Path("/proc/self/smaps").read_text().splitlines()
    for i, line in enumerate(lines):
        if line.split("-", 1)[0] == f"{address:x}":
            for field in lines[i + 1 :]:
                if field.startswith("Rss:"):
                    return int(field.split()[1]) * 1024
    raise AssertionError(f"no mapping at {address:#x}")


def _pool() -> SlotPool:
    session = _session.live()
    assert session is not None
    return session.pool


def test_the_second_save_takes_a_buffer_made_and_populated_in_the_background(
    root: Path,
) -> None:
    nm.init(str(root), persistent_time_interval=0)
    _save(1)
    size = _item(root, 1).st_size
    pool = _pool()
    assert pool.wait_spares(timeout_s=60)
    spares = _pool_files(root)
    assert [name.rsplit(".", 1)[0] for name in spares] == ["model"]
    (spare,) = spares.values()
    assert spare.st_size == size
    assert spare.st_blocks * 512 >= size  # allocated, not a sparse file
    assert pool.pool_bytes() == size
    # The pool holds it mapped, every page faulted in (by its own thread).
    mapped = pool._maps[(spare.st_dev, spare.st_ino)]
    assert _resident_bytes(mapped.tensor.data_ptr()) >= size

    state = _state(2)
    faults = _thread_faults()
    _save(2, state=state)
    faults = _thread_faults() - faults
    # The second save reuses the spare's mapping: no page of its buffer faults here. (A
    # buffer mapped with MAP_POPULATE, as the second save's was before issue #22, faults
    # every page again when the copy writes it: MAP_POPULATE maps a shared file's pages
    # read-only, on tmpfs as on disk.)
    assert faults < size // PAGE // 8, f"{faults} page faults on the saving thread"
    taken = _item(root, 2)
    assert (taken.st_dev, taken.st_ino) == (spare.st_dev, spare.st_ino)
    assert torch.equal(nm.get_checkpoint("global_step2").load("model")["w"], _state(2)["w"])


def test_a_save_before_its_spare_is_ready_finishes_it_and_takes_it(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    populated_by: list[str] = []
    populate, work = pages._populate, pages.Population.work

    def recording_populate(address: int, length: int) -> None:
        populated_by.append(threading.current_thread().name)
        populate(address, length)

    def slow_spare_work(self: pages.Population) -> None:
        if threading.current_thread().name.startswith("nebula-spare"):
            time.sleep(0.5)  # the spare's thread is late: the second save comes first
        work(self)

    monkeypatch.setattr(pages, "_populate", recording_populate)
    monkeypatch.setattr(pages.Population, "work", slow_spare_work)
    nm.init(str(root), persistent_time_interval=0)
    _save(1)
    (spare,) = _pool_files(root).values()  # being made
    populated_by.clear()
    _save(2)
    taken = _item(root, 2)
    assert (taken.st_dev, taken.st_ino) == (spare.st_dev, spare.st_ino)
    assert populated_by and not any(n.startswith("nebula-spare") for n in populated_by)
    assert torch.equal(nm.get_checkpoint("global_step2").load("model")["w"], _state(2)["w"])


def test_steady_state_keeps_two_buffers_per_item(root: Path) -> None:
    nm.init(str(root), persistent_time_interval=0)
    for step in range(1, 6):
        _save(step)
        nm.flush_persistence()
        assert _pool().wait_spares(timeout_s=60)
        memory = Path(nm.memory_tier_path(str(root)))
        tags = [p for p in memory.iterdir() if (p / "model").exists()]
        # The newest copy and one buffer for the next save: never a third.
        assert len(tags) + len(_pool_files(root)) <= 2, (step, tags, _pool_files(root))
    assert torch.equal(nm.get_latest_checkpoint().load("model")["w"], _state(5)["w"])


def test_the_lazy_mode_prepares_the_second_buffer_too(root: Path) -> None:
    nm.init(str(root), persistent_time_interval=0, lazy_snapshot=True)
    _save(1)
    nm.wait_for_snapshot()
    assert _pool().wait_spares(timeout_s=60)
    (spare,) = _pool_files(root).values()
    _save(2)
    nm.wait_for_snapshot()
    taken = _item(root, 2)
    assert (taken.st_dev, taken.st_ino) == (spare.st_dev, spare.st_ino)


@pytest.mark.parametrize("room", [1.5, 2.5])
def test_no_spare_beyond_the_memory_budget(
    root: Path, monkeypatch: pytest.MonkeyPatch, room: float
) -> None:
    # Half of NEBULA_MEMORY_BUFFER_SIZE is the checkpoints' share (the seed's rule).
    limit = int(room * SIZE)
    monkeypatch.setenv("NEBULA_MEMORY_BUFFER_SIZE", str(2 * limit))
    nm.init(str(root), persistent_time_interval=0)
    _save(1)
    pool = _pool()
    assert pool.wait_spares(timeout_s=60)
    assert pool.usage_bytes() <= limit
    assert bool(_pool_files(root)) == (room > 2)
    _save(2)  # with or without a spare
    nm.flush_persistence()
    assert pool.usage_bytes() <= limit
    assert torch.equal(nm.get_latest_checkpoint().load("model")["w"], _state(2)["w"])


def test_no_spare_beyond_the_free_space_of_the_memory_tier(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    nm.init(str(root), persistent_time_interval=0)
    pool = _pool()
    # A filesystem with room for one and a half buffers (what the memory tier holds is
    # taken from it), as a small /dev/shm would be.
    capacity = SIZE + SIZE // 2
    monkeypatch.setattr(budget_module, "free_bytes", lambda _path: capacity - pool.usage_bytes())
    _save(1)
    assert pool.wait_spares(timeout_s=60)
    assert _pool_files(root) == {}
    _save(2)  # waits for the first persist, then takes the first buffer's room
    assert torch.equal(nm.get_latest_checkpoint().load("model")["w"], _state(2)["w"])


def test_a_spare_being_made_is_gone_after_shutdown(root: Path) -> None:
    nm.init(str(root), persistent_time_interval=0, keep_memory_tier=True)
    _save(1, 64 * MB)
    nm.shutdown()  # at once: the spare may still be being made
    assert _pool_files(root) == {}


def _commit(step: int, state: dict[str, torch.Tensor] | None = None) -> None:
    checkpoint = nm.Checkpoint(f"global_step{step}")
    checkpoint.save("model", _state(step) if state is None else state)
    checkpoint.commit()


def test_a_save_while_a_persist_holds_the_copy_before_takes_a_buffer_made_beforehand(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    entered, release = threading.Event(), threading.Event()
    copy = persist_step.copy_alongside

    def held_copy(src, *args, **kwargs):  # type: ignore[no-untyped-def]
        if src.tag == "global_step1":
            entered.set()
            assert release.wait(60)
        return copy(src, *args, **kwargs)

    monkeypatch.setattr(persist_step, "copy_alongside", held_copy)
    nm.init(str(root), persistent_time_interval=0)
    try:
        _commit(1)
        assert entered.wait(60)  # global_step1's persist is in flight, and stays so
        assert _pool().wait_spares(timeout_s=60)
        _commit(2)  # takes the spare; global_step1 is still held by its persist
        assert _pool().wait_spares(timeout_s=60)
        spares = {(s.st_dev, s.st_ino) for s in _pool_files(root).values()}
        assert len(spares) == 1, "no buffer made for the save after the held copy"
        state = _state(3)
        faults = _thread_faults()
        _commit(3, state)
        faults = _thread_faults() - faults
        taken = _item(root, 3)
        assert (taken.st_dev, taken.st_ino) in spares
        assert faults < SIZE // PAGE // 8, f"{faults} page faults on the saving thread"
    finally:
        release.set()
    nm.flush_persistence()
    assert torch.equal(nm.get_latest_checkpoint().load("model")["w"], _state(3)["w"])


def test_the_pool_keeps_the_buffers_a_job_lately_needed_at_once(tmp_path: Path) -> None:
    pool = SlotPool(Store(str(tmp_path), durable=False))
    for tag in ("t1", "t2", "t3"):  # three in use at once: a persist held two
        pool.store.make_dir(tag)
        pool.open_item(tag, "model", 4096)
    assert pool.need.of("model") == 3
    assert pool.recycle("t1", "model") and pool.recycle("t2", "model")  # both kept
    assert len(pool._free_files("model", 4096)) == 2

    lean = SlotPool(Store(str(tmp_path / "lean"), durable=False))
    for tag in ("t1", "t2"):  # two at once: the newest and the one being filled
        lean.store.make_dir(tag)
        lean.open_item(tag, "model", 4096)
    lean.store.make_dir("t3")  # a third copy not of a save's buffer (a restore's, say)
    (tmp_path / "lean" / "t3" / "model").write_bytes(bytes(4096))
    kept = [lean.recycle(tag, "model") for tag in ("t1", "t2", "t3")]
    assert kept.count(True) == 2 == len(lean._free_files("model", 4096)), kept
    pool.close()
    lean.close()


def test_spare_buffers_off_keeps_no_buffer_between_saves(root: Path) -> None:
    nm.init(str(root), persistent_time_interval=0, spare_buffers=False)
    for step in range(1, 4):
        _commit(step)
        nm.flush_persistence()
        assert _pool().wait_spares(timeout_s=60)
        assert _pool_files(root) == {}
    memory = Path(nm.memory_tier_path(str(root)))
    assert [p.name for p in memory.iterdir() if (p / "model").exists()] == ["global_step3"]
    assert torch.equal(nm.get_latest_checkpoint().load("model")["w"], _state(3)["w"])


def test_a_buffer_being_freed_holds_no_lock_a_save_needs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Freeing a large buffer (its last close) takes tens of ms; the eviction that drops it
    runs beside the next save, which looks at the pool (the budget's free space, its
    buffer) under the pool's lock. The close runs after that lock is let go."""
    pool = SlotPool(Store(str(tmp_path), durable=False), spares=False)  # recycled: removed
    pool.store.make_dir("t1")
    mapped = pool.open_item("t1", "model", 1 << 20)
    closing, release = threading.Event(), threading.Event()
    real_close = type(mapped).close

    def slow_close(self: object, **kwargs: bool) -> None:
        closing.set()
        assert release.wait(30)
        real_close(self, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(type(mapped), "close", slow_close)
    evict = threading.Thread(target=lambda: pool.recycle("t1", "model"))
    evict.start()
    try:
        assert closing.wait(30)
        looked: list[int] = []
        look = threading.Thread(target=lambda: looked.append(pool.unallocated_bytes()))
        look.start()
        look.join(5)
        assert looked == [0], "the save's look at the pool waited for a buffer being freed"
        pool.store.make_dir("t2")
        taken = threading.Thread(target=lambda: pool.open_item("t2", "model", 1 << 20))
        taken.start()
        taken.join(5)
        assert not taken.is_alive()
    finally:
        release.set()
        evict.join(30)
    assert not (tmp_path / "t1" / "model").exists()
    pool.close()


def test_what_the_pool_drops_is_closed_also_when_the_locked_work_fails(tmp_path: Path) -> None:
    # Catches: the closes deferred past the lock skipped when the work under it raised
    # (a mapping and its descriptor left open until the process ends).
    pool = SlotPool(Store(str(tmp_path), durable=False))
    pool.store.make_dir("t1")
    mapped = pool.open_item("t1", "model", 1 << 20)
    with pytest.raises(RuntimeError), pool._locked():
        pool._drop(next(iter(pool._maps)))
        assert mapped.tensor is not None  # not closed under the lock
        raise RuntimeError("the work under the lock failed")
    assert mapped.tensor is None  # closed once the lock was let go
    with pytest.raises(OSError):
        os.fstat(mapped.fd)
    pool.close()


def test_one_close_that_fails_leaves_no_other_dropped_buffer_open(tmp_path: Path) -> None:
    # Catches: the closes deferred past the lock stopped at the first that raised (an
    # unpin, say), leaving every mapping dropped after it open.
    pool = SlotPool(Store(str(tmp_path), durable=False))
    closed: list[str] = []

    class Failing:
        def close(self) -> None:
            closed.append("failing")
            raise OSError("unpin failed")

    class Fine:
        def close(self) -> None:
            closed.append("fine")

    with pytest.raises(OSError, match="unpin failed"), pool._locked():
        pool._dispose(Fine())  # type: ignore[arg-type]
        pool._dispose(Failing())  # type: ignore[arg-type]
    assert sorted(closed) == ["failing", "fine"]
    pool.close()
