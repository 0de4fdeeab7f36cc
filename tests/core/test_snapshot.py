"""The fast snapshot: a laid-out item refilled in a reused buffer is what torch.load reads.

Each test names the bug it catches: a storage copied to another storage's place, stale
bytes of an earlier checkpoint left in a reused buffer, a layout reused after the shapes
changed, an object the layout cannot map written wrongly instead of by torch.save.
"""

from __future__ import annotations

import collections
import dataclasses
import errno
import gc
import io
import itertools
import mmap
import os
import threading
import time
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch

import nebulaml as nm
from nebulaml.format import checksum
from nebulaml.format.checksum import CHECKSUM_ALGO, checksum_of
from nebulaml.runtime import session as nm_session
from nebulaml.runtime import snapshot
from nebulaml.runtime.slots import SlotPool
from nebulaml.runtime.snapshot import Layout, LayoutCache, fill, plan_layout
from nebulaml.storage import mapped_reads as storage
from nebulaml.storage.store import Store


def _assert_same(a: Any, b: Any) -> None:
    assert type(a) is type(b) or (isinstance(a, dict) and isinstance(b, dict))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for key in a:
            _assert_same(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _assert_same(x, y)
    else:
        assert a == b


def _state() -> dict[str, Any]:
    torch.manual_seed(0)
    big = torch.randn(64, 33)
    shared = torch.arange(100, dtype=torch.int64)
    return {
        "model": collections.OrderedDict(w=big, b=torch.randn(33), t=big.t()),
        "views": [shared[10:20], shared[50:], shared],  # one storage, three tensors
        "dtypes": (torch.ones(3, dtype=torch.bfloat16), torch.tensor([True, False])),
        "half": torch.randn(7, dtype=torch.float16),
        "empty": torch.empty(0),
        "scalar": torch.tensor(3.5),
        "param": torch.nn.Parameter(torch.randn(5)),
        "meta": {"step": 7, "lr": 0.1, "name": "x", "none": None, "size": torch.Size([2, 3])},
    }


def _fill_file(path: Path, obj: Any, workers: int = 1) -> str:
    layout = plan_layout(obj)
    assert layout is not None
    pool = SlotPool(Store(path.parent, durable=False))
    mapped = pool.open_item(".", path.name, layout.size_bytes)
    digest = fill(mapped.tensor, mapped.view, layout, workers=workers)
    assert digest == checksum_of(mapped.view)  # the hash taken on the way is the file's
    pool.close()
    return digest


def test_a_filled_buffer_loads_as_the_object_with_torch_load(tmp_path: Path) -> None:
    state = _state()
    _fill_file(tmp_path / "item", state)
    loaded = torch.load(tmp_path / "item", weights_only=True)
    _assert_same(state, loaded)
    # Views keep sharing one storage, as torch.save writes them.
    views = loaded["views"]
    assert views[0].untyped_storage().data_ptr() == views[2].untyped_storage().data_ptr()


def test_the_file_is_byte_for_byte_what_torch_save_writes(tmp_path: Path) -> None:
    # The same bytes as torch.save (CRC off, as nebula writes), so every reader of torch's
    # format reads it; only the archive's random serialization id may differ.
    from torch.utils.serialization import config

    state = _state()
    _fill_file(tmp_path / "item", state)
    previous = config.save.compute_crc32
    config.save.compute_crc32 = False
    try:
        buffer = io.BytesIO()
        torch.save(state, buffer)
    finally:
        config.save.compute_crc32 = previous
    ours, theirs = (tmp_path / "item").read_bytes(), buffer.getvalue()
    assert len(ours) == len(theirs)
    differing = [i for i in range(len(ours)) if ours[i] != theirs[i]]
    # serialization_id is a 20-character random id: nothing else may differ
    assert len(differing) <= 20, differing[:40]


def _lora_like() -> dict[str, torch.Tensor]:
    """Two 16 MiB frozen weights, each after small records (a bias and an adapter): the
    sizes the layout reorders (a record of `ALIGN_MIN_UNITS` pieces and more)."""
    torch.manual_seed(3)
    return {
        "adapter0": torch.randn(5_000),
        "w1": torch.randn(4 << 20),
        "bias": torch.randn(1_000),
        "adapter1": torch.randn(5_000),
        "w2": torch.randn(4 << 20),
        "tail": torch.randn(3),
    }


def test_records_lie_largest_first_and_the_small_ones_together_from_a_piece(
    tmp_path: Path,
) -> None:
    # Catches: a layout whose small records (a LoRA model's adapters) lie between the
    # large frozen ones (a store whose parts are 5 MiB sends 5 MiB for each; a fill hashes
    # the frozen bytes beside each adapter again), one whose small records share a piece
    # with a large one, or members moved where a zip reader (or an mmap load, which needs
    # torch's 64-byte alignment) does not find them.
    import zipfile

    from nebulaml.format.torchzip import ALIGN_MIN_UNITS

    state = _lora_like()
    layout = plan_layout(state)
    assert layout is not None
    piece = snapshot._PIECE_BYTES
    adapter0, w1, bias, adapter1, w2, tail = layout.regions
    assert w1[0] < w2[0] < adapter0[0] < adapter1[0] < bias[0] < tail[0]  # largest first
    assert w1[1] >= ALIGN_MIN_UNITS * piece and adapter0[0] % piece == 0
    small = [adapter0, adapter1, bias, tail]
    assert all(b[0] - (a[0] + a[1]) < 256 for a, b in itertools.pairwise(small))  # together
    assert all(offset % 64 == 0 for offset, _ in layout.regions)
    buffer = io.BytesIO()
    torch.save(state, buffer)
    assert layout.size_bytes - len(buffer.getvalue()) < piece  # the zeros: under a piece
    _fill_file(tmp_path / "item", state)
    for mmap_load in (False, True):
        loaded = torch.load(tmp_path / "item", weights_only=True, mmap=mmap_load)
        _assert_same(state, loaded)
    with zipfile.ZipFile(tmp_path / "item") as ours, zipfile.ZipFile(buffer) as theirs:
        assert sorted(
            (i.filename.split("/", 1)[1], i.file_size) for i in ours.infolist()
        ) == sorted((i.filename.split("/", 1)[1], i.file_size) for i in theirs.infolist())


def test_a_layout_without_large_records_is_torchs_own() -> None:
    # Catches: records moved in an item that gains nothing from it (no record is large
    # enough, or the records lie largest first already).
    from nebulaml.format.torchzip import (
        largest_records_first,
        record_layout,
        storages_and_signature,
    )

    state = _state()
    storages = storages_and_signature(state)[0]
    assert record_layout(state, storages, align=snapshot._PIECE_BYTES) is not None
    assert plan_layout(state).size_bytes == record_layout(state, storages).size_bytes
    big = {"w1": torch.zeros(4 << 20), "w2": torch.zeros(4 << 20)}  # large after large
    plain = record_layout(big, storages_and_signature(big)[0])
    assert plain is not None and plan_layout(big).size_bytes == plain.size_bytes
    assert plan_layout(big).regions == plain.regions
    assert largest_records_first([(0, b"not a zip")], 9, 1 << 20) is None


def test_a_reused_buffer_carries_nothing_over(tmp_path: Path) -> None:
    state = _state()
    first = _fill_file(tmp_path / "item", state)
    with open(tmp_path / "item", "r+b") as f:  # garbage everywhere, gaps included
        f.write(b"\xff" * os.path.getsize(tmp_path / "item"))
    assert _fill_file(tmp_path / "item", state) == first


@pytest.mark.parametrize("workers", [1, 2, 3])
def test_every_worker_count_writes_and_hashes_the_same_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, workers: int
) -> None:
    # Small, odd pieces: many of them, so that the workers meet mid-tensor, and helpers
    # copy pieces the first worker must hash after them (a hash that skips or reorders
    # their pieces, or runs before they are copied, gives another digest or file).
    monkeypatch.setattr(snapshot, "_PIECE_BYTES", 4096 + 8)
    monkeypatch.setattr(checksum, "LEAF_BYTES", 4096 + 8)  # a piece is a checksum leaf
    torch.manual_seed(1)
    state = {**_state(), "odd": torch.randn(12_345), "big": torch.randn(3, 50_001)}
    expected_digest = _fill_file(tmp_path / "one", state, workers=1)
    digest = _fill_file(tmp_path / "item", state, workers=workers)
    assert digest == expected_digest
    assert (tmp_path / "item").read_bytes() == (tmp_path / "one").read_bytes()
    _assert_same(state, torch.load(tmp_path / "item", weights_only=True))


def test_a_fill_refuses_a_buffer_of_another_size(tmp_path: Path) -> None:
    # memmove checks no bounds: a buffer too small must be refused, not overrun.
    layout = plan_layout({"w": torch.ones(1000)})
    assert layout is not None
    pool = SlotPool(Store(tmp_path, durable=False))
    mapped = pool.open_item(".", "item", layout.size_bytes - 4096)
    with pytest.raises(ValueError, match="bytes for an item of"):
        fill(mapped.tensor, mapped.view, layout)
    pool.close()


def _same_layout(a: Layout | None, b: Layout | None) -> bool:
    if a is None or b is None:
        return a is b
    same_storages = [x._cdata for x in a.storages] == [y._cdata for y in b.storages]
    return (a.size_bytes, a.regions, a.gaps, a.segments) == (
        b.size_bytes,
        b.regions,
        b.gaps,
        b.segments,
    ) and same_storages


def _without_serialization_id(layout: Layout) -> Layout:
    # torch writes a random id into every archive; a reused layout keeps the old one.
    return dataclasses.replace(
        layout, segments=tuple(seg for seg in layout.segments if b"serialization_id" not in seg[1])
    )


def test_a_reused_layout_is_the_one_a_fresh_plan_gives() -> None:
    # Each step changes one thing the pickle depends on (or nothing): a reused layout
    # that missed it would write a file torch.load reads wrongly, with a valid checksum.
    w = torch.randn(8, 4)
    other = torch.randn(8, 4)
    steps: list[tuple[str, Any, bool]] = [
        ("first", {"w": w, "lr": 0.5, "k": "a"}, False),
        ("new bytes only", {"w": w.add_(1), "lr": 0.5, "k": "a"}, True),
        ("a plain value", {"w": w, "lr": 0.25, "k": "a"}, False),
        ("-0.0 for 0.0", {"w": w, "lr": -0.0, "k": "a"}, False),
        ("back to 0.0", {"w": w, "lr": 0.0, "k": "a"}, False),
        ("another storage", {"w": other, "lr": 0.0, "k": "a"}, True),
        ("a reshaped view", {"w": other.view(4, 8), "lr": 0.0, "k": "a"}, False),
        ("a transposed view", {"w": other.view(4, 8).t(), "lr": 0.0, "k": "a"}, False),
        ("another dtype", {"w": other.view(torch.int32), "lr": 0.0, "k": "a"}, False),
        ("key order", {"lr": 0.0, "w": other, "k": "a"}, False),
        ("an int for a float", {"lr": 0, "w": other, "k": "a"}, False),
        ("a list for a tuple", {"lr": 0, "w": other, "k": ["a"]}, False),
        ("a tuple", {"lr": 0, "w": other, "k": ("a",)}, False),
        ("one tensor twice", {"a": w, "b": w}, False),
        ("two views of one storage", {"a": w, "b": w[1:]}, False),
        ("two storages", {"a": w, "b": other}, False),
        ("same again", {"a": w, "b": other}, True),
        ("one string object twice", {"a": [KEY, KEY]}, False),
        ("two equal strings", {"a": [KEY, "".join(["st", "ep"])]}, False),
        ("a defaultdict", collections.defaultdict(list, w=w), False),
        ("the same defaultdict", collections.defaultdict(list, w=w), False),
    ]
    cache = LayoutCache()
    for what, obj, reused in steps:
        hits = cache.hits
        got = cache.plan("item", obj)
        fresh = plan_layout(obj)
        assert got is not None and fresh is not None, what
        assert cache.hits == hits + reused, what
        assert _same_layout(_without_serialization_id(got), _without_serialization_id(fresh)), what


KEY = "step"


def test_a_layout_cache_keeps_no_tensor_alive() -> None:
    # A cached layout that held its storages would keep a saved model's memory alive
    # after the training script dropped it, for as long as the session lives.
    cache = LayoutCache()
    w = torch.randn(1000)
    cache.plan("item", {"w": w})
    alive = weakref.ref(w.untyped_storage())  # torch keeps one Python storage per storage
    del w
    gc.collect()
    assert alive() is None


def test_saves_of_an_unchanged_structure_reuse_the_layout(root: Path) -> None:
    nm.init(str(root), persistent_time_interval=0)
    w = torch.zeros(1000)
    for step in range(1, 5):
        w.fill_(step)
        nm.Checkpoint(f"global_step{step}").save("model", {"w": w, "epoch": 1})
    session = nm_session.current("test")
    assert (session.layouts.hits, session.layouts.misses) == (3, 1)
    nm.flush_persistence()
    for info in nm.list_checkpoints():
        step = int(info["tag"].removeprefix("global_step"))
        assert torch.equal(
            nm.get_checkpoint(info["tag"]).load("model")["w"], torch.full((1000,), float(step))
        )


def test_objects_the_layout_cannot_map_fall_back_to_torch_save(tmp_path: Path) -> None:
    class Opaque:
        def __init__(self) -> None:
            self.t = torch.ones(2)

    assert plan_layout({"x": Opaque()}) is None
    assert plan_layout({"x": torch.ones(2).to_sparse()}) is None
    nm.init(str(tmp_path / "p"), persistent_time_interval=0)
    nm.Checkpoint("global_step1").save("item", {"x": [1, 2], "s": torch.ones(2).to_sparse()})
    loaded = nm.get_latest_checkpoint().load("item")
    assert torch.equal(loaded["s"].to_dense(), torch.ones(2))


def _memory_file(root: Path, tag: str, item: str) -> os.stat_result:
    return os.stat(os.path.join(nm.memory_tier_path(str(root)), tag, item))


def test_saves_reuse_two_buffers_and_every_committed_copy_stays_intact(root: Path) -> None:
    nm.init(str(root), persistent_time_interval=0, num_of_version_in_retention=3)
    weights = torch.zeros(4096)
    inodes: dict[int, int] = {}
    for step in range(1, 7):
        weights.fill_(step)
        nm.Checkpoint(f"global_step{step}").save("model", {"w": weights})
        inodes[step] = _memory_file(root, f"global_step{step}", "model").st_ino
        nm.flush_persistence()
        # Every copy still committed anywhere holds exactly what was saved at its step.
        for info in nm.list_checkpoints():
            tag = info["tag"]
            got = nm.get_checkpoint(tag).load("model")["w"]
            assert torch.equal(got, torch.full((4096,), float(tag.removeprefix("global_step"))))
            del got  # a dropped load no longer holds its file (and the pool may reuse it)
    # Steady state: two files take turns (the newest copy, and the one being filled).
    assert len(set(inodes.values())) == 2
    assert inodes[3] == inodes[1] and inodes[4] == inodes[2]


def test_a_loaded_object_does_not_change_when_its_buffer_is_reused(root: Path) -> None:
    nm.init(str(root), persistent_time_interval=0, num_of_version_in_retention=1)
    nm.Checkpoint("global_step1").save("model", {"w": torch.full((1000,), 1.0)})
    nm.flush_persistence()
    loaded = nm.get_latest_checkpoint().load("model")  # from the memory tier, mapped
    for step in range(2, 5):
        nm.Checkpoint(f"global_step{step}").save("model", {"w": torch.full((1000,), step)})
        nm.flush_persistence()
    assert torch.equal(loaded["w"], torch.full((1000,), 1.0))


def test_a_layout_is_laid_out_again_when_the_shapes_change(root: Path) -> None:
    nm.init(str(root), persistent_time_interval=0)
    for step, n in enumerate([10, 5000, 7, 5000, 0], start=1):
        state = {"w": torch.arange(n, dtype=torch.float32), "n": n}
        nm.Checkpoint(f"global_step{step}").save("model", state)
        nm.flush_persistence()
        _assert_same(nm.get_latest_checkpoint().load("model"), state)


@pytest.mark.parametrize("weights_only", [True, False])
def test_memory_tier_loads_verify_before_unpickling(root: Path, weights_only: bool) -> None:
    nm.init(str(root), persistent_time_interval=3600)  # stays in the memory tier only
    nm.Checkpoint("global_step1").save("model", {"w": torch.ones(64)})
    path = os.path.join(nm.memory_tier_path(str(root)), "global_step1", "model")
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        f.write(b"\x00\x01\x02")
    with pytest.raises(nm.CorruptCheckpointError):
        nm.get_checkpoint("global_step1").load("model", weights_only=weights_only)


def test_free_buffers_are_released_at_shutdown_and_checkpoints_kept(root: Path) -> None:
    nm.init(str(root), persistent_time_interval=0, keep_memory_tier=True)
    for step in (1, 2, 3):
        nm.Checkpoint(f"global_step{step}").save("model", {"w": torch.ones(1000)})
        nm.flush_persistence()
    memory = Path(nm.memory_tier_path(str(root)))
    assert list((memory / ".slots").iterdir())  # a free buffer waits for the next save
    nm.shutdown()
    assert not list((memory / ".slots").iterdir())  # RAM given back when the job ends
    assert (memory / "global_step3" / "manifest.json").exists()


def _mapping_of(address: int) -> str | None:
    """The path of the file mapped at `address` in this process, or None."""
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if lo <= address < hi:
                return fields[5].strip() if len(fields) == 6 else None
    return None


def test_a_memory_tier_load_maps_the_file_instead_of_copying_it(root: Path) -> None:
    nm.init(str(root), persistent_time_interval=3600)  # in the memory tier only
    nm.Checkpoint("global_step1").save("model", {"w": torch.arange(100_000.0)})
    loaded = nm.get_checkpoint("global_step1").load("model")
    path = os.path.join(nm.memory_tier_path(str(root)), "global_step1", "model")
    assert _mapping_of(loaded["w"].data_ptr()) == path
    assert torch.equal(loaded["w"], torch.arange(100_000.0))


def test_writes_to_a_loaded_tensor_stay_in_this_process(root: Path) -> None:
    nm.init(str(root), persistent_time_interval=3600)
    nm.Checkpoint("global_step1").save("model", {"w": torch.ones(50_000)})
    loaded = nm.get_checkpoint("global_step1").load("model")
    loaded["w"].add_(1)  # copy-on-write: the file keeps what was saved
    assert torch.equal(nm.get_checkpoint("global_step1").load("model")["w"], torch.ones(50_000))
    assert torch.equal(loaded["w"], torch.full((50_000,), 2.0))


def _pooled(memory: Path) -> set[int]:
    slots = memory / ".slots"
    return {p.stat().st_ino for p in slots.iterdir()} if slots.exists() else set()


def _evicted(folder: Path) -> None:
    """Wait until `folder` (a tag of the memory tier) is gone: the eviction its successor's
    commit asks for runs on the eviction thread and may come after a flush returns (a CI
    run under load); it must come within 30 s."""
    deadline = time.monotonic() + 30
    while folder.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not folder.exists()


def test_the_pool_never_takes_a_file_a_load_holds(root: Path) -> None:
    nm.init(str(root), persistent_time_interval=0, num_of_version_in_retention=1)
    nm.Checkpoint("global_step1").save("model", {"w": torch.ones(50_000)})
    nm.flush_persistence()
    memory = Path(nm.memory_tier_path(str(root)))
    held = nm.get_checkpoint("global_step1").load("model")
    inode = os.stat(memory / "global_step1" / "model").st_ino
    nm.Checkpoint("global_step2").save("model", {"w": torch.zeros(50_000)})
    nm.flush_persistence()  # global_step1 leaves the memory tier: its file is not pooled
    _evicted(memory / "global_step1")
    assert inode not in _pooled(memory)
    assert torch.equal(held["w"], torch.ones(50_000))
    del held  # once dropped, the files of loads are pooled again
    dropped = nm.get_checkpoint("global_step2").load("model")
    inode = os.stat(memory / "global_step2" / "model").st_ino
    del dropped
    nm.Checkpoint("global_step3").save("model", {"w": torch.zeros(50_000)})
    nm.flush_persistence()
    _evicted(memory / "global_step2")
    assert inode in _pooled(memory) | {os.stat(memory / "global_step3" / "model").st_ino}


def test_recycle_removes_a_file_a_load_has_marked(tmp_path: Path) -> None:
    from nebulaml.storage.mapped_reads import mark_in_use

    store = Store(str(tmp_path), durable=False)
    pool = SlotPool(store)
    (tmp_path / "t1").mkdir()
    (tmp_path / "t1" / "model").write_bytes(b"x" * 8192)
    fd = os.open(tmp_path / "t1" / "model", os.O_RDONLY)  # another open file, as a loader's
    try:
        mark_in_use(fd)
        assert pool.recycle("t1", "model") is False
        assert not (tmp_path / "t1" / "model").exists()
        assert pool.pool_bytes() == 0
        assert os.pread(fd, 4, 0) == b"xxxx"  # the loader's file lives on, unnamed
    finally:
        os.close(fd)
    pool.close()


def test_a_file_recycled_before_its_load_marked_it_is_read_from_the_next_tier(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import nebulaml.storage.mapped_reads as storage

    nm.init(str(root), persistent_time_interval=0)
    nm.Checkpoint("global_step1").save("model", {"w": torch.ones(50_000)})
    nm.flush_persistence()
    memory_file = Path(nm.memory_tier_path(str(root))) / "global_step1" / "model"
    mark = storage.mark_in_use

    def recycled_first(fd: int) -> None:
        # The slot pool won the race: the file went (to be refilled) and another took the name.
        memory_file.rename(memory_file.with_name("elsewhere"))
        memory_file.write_bytes(memory_file.with_name("elsewhere").read_bytes())
        mark(fd)

    monkeypatch.setattr(storage, "mark_in_use", recycled_first)
    loaded = nm.get_checkpoint("global_step1").load("model")
    assert _mapping_of(loaded["w"].data_ptr()) != str(memory_file)  # the persistent copy
    assert torch.equal(loaded["w"], torch.ones(50_000))


def _minor_faults() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def test_a_persist_reads_the_pools_mapping_and_faults_nothing_in(tmp_path: Path) -> None:
    # The persister hashes and writes memory-tier files through Store.map_read; a fresh
    # mapping of 1.5 GB costs 0.15 s of page faults beside training. The pool's own
    # mapping is populated already.
    size = 32 << 20
    pool = SlotPool(Store(tmp_path, durable=False))
    pool.store.make_dir("t")
    mapped = pool.open_item("t", "model", size)
    mapped.tensor.fill_(7)
    with pool.store.map_read("t", "model") as view:
        assert view is not None and view.readonly
        before = _minor_faults()
        assert bytes(view[::4096]) == b"\x07" * (size // 4096)
        lent_faults = _minor_faults() - before
    with Store(tmp_path, durable=False).map_read("t", "model") as view:  # the control
        assert view is not None
        before = _minor_faults()
        assert bytes(view[::4096]) == b"\x07" * (size // 4096)
        fresh_faults = _minor_faults() - before
    # A fresh mapping faults its pages in 16 at a time (fault-around): ~512 faults here.
    assert fresh_faults > (size // 4096) // 32  # the measure sees faults where there are
    assert lent_faults < 20
    pool.close()


def test_a_lent_mapping_outlives_the_pool_dropping_the_file(tmp_path: Path) -> None:
    pool = SlotPool(Store(tmp_path, durable=False))
    pool.store.make_dir("t")
    pool.open_item("t", "model", 1 << 20).tensor.fill_(3)
    with pool.store.map_read("t", "model") as view:
        assert view is not None
        os.unlink(tmp_path / "t" / "model")
        pool.close()  # unmaps what it can: not what a reader still holds
        assert bytes(view) == b"\x03" * (1 << 20)


def _persisted_only(root: Path, tag_state: dict[str, Any]) -> None:
    """Commit each tag's "model" and persist it; then drop the memory tier, so that
    loads read the persistent tier."""
    nm.init(str(root), persistent_time_interval=0, num_of_version_in_retention=5)
    for tag, state in tag_state.items():
        nm.Checkpoint(tag).save("model", state)
    nm.flush_persistence()
    nm.shutdown()  # everything persisted: the memory tier is released
    assert not os.path.exists(nm.memory_tier_path(str(root)))
    nm.init(str(root), persistent_time_interval=0, num_of_version_in_retention=5)


def test_a_disk_load_maps_the_persisted_file(root: Path) -> None:
    # Mapped, not read into fresh memory: the disk's read speed, no copy, no zeroing.
    _persisted_only(root, {"global_step1": {"w": torch.arange(100_000.0)}})
    loaded = nm.get_checkpoint("global_step1").load("model")
    assert _mapping_of(loaded["w"].data_ptr()) == str(root / "global_step1" / "model")
    assert torch.equal(loaded["w"], torch.arange(100_000.0))
    loaded["w"].add_(1)  # copy-on-write: the file keeps what was saved
    again = nm.get_checkpoint("global_step1").load("model")
    assert torch.equal(again["w"], torch.arange(100_000.0))


def test_a_mapped_disk_load_survives_an_overwrite_of_its_checkpoint(root: Path) -> None:
    # A truncated or rewritten mapped file would change the loaded tensors (or kill the
    # process with SIGBUS when they are read): an overwrite must write new files.
    _persisted_only(root, {"global_step1": {"w": torch.ones(300_000)}})
    loaded = nm.get_checkpoint("global_step1").load("model")
    nm.Checkpoint("global_step1", overwrite=True).save("model", {"w": torch.zeros(1000)})
    nm.flush_persistence()
    assert torch.equal(loaded["w"], torch.ones(300_000))
    assert torch.equal(nm.get_checkpoint("global_step1").load("model")["w"], torch.zeros(1000))


def test_a_disk_load_on_a_network_filesystem_reads_the_file(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # NFS and FUSE mounts are not mapped: a page read again after another host removed
    # the file would be a SIGBUS in training instead of an error at load time.
    monkeypatch.setattr(storage, "_MAPPABLE_FS", {})
    _persisted_only(root, {"global_step1": {"w": torch.arange(100_000.0)}})
    loaded = nm.get_checkpoint("global_step1").load("model")
    assert _mapping_of(loaded["w"].data_ptr()) != str(root / "global_step1" / "model")
    assert torch.equal(loaded["w"], torch.arange(100_000.0))


def test_a_disk_load_hashes_while_it_reads_and_finds_a_flipped_byte(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Small read-ahead chunks: many of them, so that hashing runs beside reading. Catches:
    # a checksum of fewer bytes than the file (a chunk skipped, hashed before it was read),
    # or one computed while reading but never compared.
    monkeypatch.setattr(storage, "_POPULATE_CHUNK_BYTES", 64 << 10)
    hashed: list[str | None] = []
    real_map_file = storage._map_file

    def spying(f: Any, size: int, algo: str | None = None) -> Any:
        mapped = real_map_file(f, size, algo)
        hashed.append(None if mapped is None else mapped[1])
        return mapped

    monkeypatch.setattr(storage, "_map_file", spying)
    _persisted_only(root, {"global_step1": {"w": torch.arange(300_000.0)}})
    path = root / "global_step1" / "model"
    loaded = nm.get_checkpoint("global_step1").load("model")
    assert torch.equal(loaded["w"], torch.arange(300_000.0))
    assert hashed == [checksum_of(path.read_bytes())]
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01  # inside the tensor bytes, in a middle chunk
    path.write_bytes(bytes(data))
    with pytest.raises(nm.CorruptCheckpointError, match="model: corrupt item"):
        nm.get_checkpoint("global_step1").load("model")


def test_a_read_error_part_way_through_a_mapped_load_raises(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A file truncated under its mapping: pages past its new end cannot be read in, so
    # the fifth chunk fails (EFAULT, where touching the page would be a SIGBUS). Catches:
    # an error in the reading thread lost (a hang, or bytes never read hashed as if they
    # were), or the thread left running.
    monkeypatch.setattr(storage, "_POPULATE_CHUNK_BYTES", 256 << 10)
    path = tmp_path / "shrinks"
    path.write_bytes(os.urandom(3 << 20))
    before = threading.active_count()
    with path.open("r+b") as f:
        mapped = mmap.mmap(f.fileno(), 3 << 20, flags=mmap.MAP_PRIVATE)
        f.truncate(1 << 20)
        with pytest.raises(OSError) as err:
            storage._populate_hashing(mapped, 3 << 20, CHECKSUM_ALGO)
        mapped.close()  # nothing holds the mapping any more
    assert err.value.errno == errno.EFAULT
    assert threading.active_count() == before


@pytest.mark.parametrize("chunk", [64 << 10, (1 << 20) + 4096, 3 << 20])
@pytest.mark.parametrize("algo", [CHECKSUM_ALGO, "xxh3_64"])
def test_a_mapped_read_hashes_every_byte_once_whatever_its_chunks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, chunk: int, algo: str
) -> None:
    # Chunks smaller than a checksum piece, across pieces, and larger; a file that ends
    # mid-piece. Catches: a piece hashed before all of it is read, hashed twice, or the
    # short last piece dropped, for either algorithm.
    monkeypatch.setattr(storage, "_POPULATE_CHUNK_BYTES", chunk)
    path = tmp_path / "item"
    path.write_bytes(os.urandom((5 << 20) + 12_345))
    with path.open("rb") as f:
        mapped = storage._map_file(f, path.stat().st_size, algo)
    assert mapped is not None
    buffer, digest = mapped
    assert digest == checksum_of(path.read_bytes(), algo)
    buffer.close()
