"""A save does not copy again what its buffer still holds (runtime/unchanged.py), and a
tensor changed by any route a user can write still ends up in the checkpoint: counted
routes by the evidence, uncounted ones by the samples, or, at worst, named by a warning
at the next save and copied from then on. Never silently stale."""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import nebulaml as nm
from nebulaml.runtime.session import current

ROWS, COLS = 1024, 2048  # the frozen base: 8 MiB of float32, eight buffer pieces


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.base = torch.nn.Linear(COLS, ROWS, bias=False)
        self.base.requires_grad_(False)
        self.adapter = torch.nn.Linear(COLS, 8)


def _save(model: Model, step: int, optimizer: torch.optim.Optimizer | None = None) -> None:
    objects = {"model": model.state_dict()}
    if optimizer is not None:
        objects["optimizer"] = optimizer.state_dict()
    checkpoint = nm.Checkpoint(f"global_step{step}", len(objects))
    for name, obj in objects.items():
        checkpoint.save(name, obj)
    assert nm.flush_persistence()


def _pool():  # type: ignore[no-untyped-def]
    return current("a test").pool


def _warm(root: Path, model: Model, **options: object) -> None:
    """Saves 1-4 with nothing changed: from the third on, the base is not copied."""
    nm.init(str(root), persistent_time_interval=0, num_of_version_in_retention=10, **options)
    for step in range(1, 5):
        _save(model, step)
    _pool().settle_audits()


def _saved_base(root: Path, step: int) -> torch.Tensor:
    return torch.load(root / f"global_step{step}" / "model", weights_only=True)["base.weight"]


def _buffer_for(
    state: dict[str, torch.Tensor],
) -> tuple[Any, Any, Any, torch.Tensor, memoryview]:
    """A layout cache that has planned `state` as "item", a buffer's memory, that layout,
    and a buffer of the item's size (a tensor, and a view of its bytes)."""
    from nebulaml.runtime.snapshot import LayoutCache
    from nebulaml.runtime.unchanged import BufferMemory

    cache = LayoutCache()
    layout = cache.plan("item", state)
    assert layout is not None
    buffer = torch.empty(layout.size_bytes, dtype=torch.uint8)
    return cache, BufferMemory(), layout, buffer, memoryview(buffer.numpy()).cast("B")


def _heads_hashed_again(
    monkeypatch: pytest.MonkeyPatch, state: dict[str, torch.Tensor], changed: list[str]
) -> tuple[list[int], Any, Any]:
    """Fill a buffer with `state` in full, change the tensors `changed` in place, and fill
    it again: (the lengths of the piece heads the second fill hashed again, the buffer's
    memory, the second layout). The second fill's checksum is checked against its bytes."""
    import nebulaml.runtime.snapshot as snapshot
    from nebulaml.format.checksum import checksum_of
    from nebulaml.runtime.snapshot import fill

    cache, memory, layout, buffer, view = _buffer_for(state)
    fill(buffer, view, layout, memory=memory)  # full: the buffer held nothing
    heads: list[int] = []
    real = snapshot.leaf_hasher
    monkeypatch.setattr(snapshot, "leaf_hasher", lambda head: heads.append(len(head)) or real(head))
    with torch.no_grad():
        for name in changed:
            state[name].add_(1.0)
    layout = cache.plan("item", state)
    assert layout is not None
    digest = fill(buffer, view, layout, memory=memory)
    memory.settle()
    assert digest == checksum_of(bytes(view))
    return heads, memory, layout


def test_a_frozen_base_is_not_copied_again_and_stays_right(tmp_path: Path) -> None:
    # Catches: reuse that never happens (the stall stays that of a full copy), or a
    # reused buffer whose bytes or checksum are not the tensor's (a load that differs).
    model = Model()
    random.seed(11)
    expected = random.random()
    random.seed(11)
    _warm(tmp_path, model)
    assert random.random() == expected  # the samples use their own generator
    reused = _pool().reused_bytes
    assert reused >= 2 * ROWS * COLS * 4  # saves 3 and 4 skipped the base
    df = nm.read_history(str(tmp_path))
    saves = df[df["tier"] == "memory"]
    assert saves["bytes_reused"].tolist()[:2] == [0, 0]
    assert all(saves["bytes_reused"].iloc[2:] >= ROWS * COLS * 4)
    for step in range(1, 5):
        assert torch.equal(_saved_base(tmp_path, step), model.base.weight)
    report = nm.verify_checkpoints(str(tmp_path))
    assert all(r["status"] == "ok" for r in report), report
    nm.shutdown()


def test_reuse_unchanged_false_copies_everything(tmp_path: Path) -> None:
    # Catches: a setting that does not turn the skipping off.
    model = Model()
    _warm(tmp_path, model, reuse_unchanged=False)
    assert _pool().reused_bytes == 0
    nm.shutdown()


def _no_grad_in_place(model: Model) -> None:
    with torch.no_grad():
        model.base.weight[3, 5] += 1.0


def _copy_into_a_slice(model: Model) -> None:
    with torch.no_grad():
        model.base.weight[10:12].copy_(torch.full((2, COLS), 7.0))


def _through_a_view(model: Model) -> None:
    flat = model.base.weight.view(-1)
    with torch.no_grad():
        flat[123_456] = -3.0


def _set_another_storage(model: Model) -> None:
    other = model.base.weight.detach().clone()
    other[0, 0] = 42.0
    with torch.no_grad():
        model.base.weight.set_(other)


def _an_optimizer_steps_a_frozen_parameter(model: Model) -> None:
    weight = model.base.weight
    weight.grad = torch.ones_like(weight)
    torch.optim.SGD([weight], lr=0.5).step()
    weight.grad = None


def _data_whole(model: Model) -> None:
    model.base.weight.data.mul_(0.5)  # an EMA-like update through .data: uncounted


def _numpy_whole(model: Model) -> None:
    model.base.weight.detach().numpy()[:] += 1.0  # uncounted too


@pytest.mark.parametrize(
    "route",
    [
        _no_grad_in_place,
        _copy_into_a_slice,
        _through_a_view,
        _set_another_storage,
        _an_optimizer_steps_a_frozen_parameter,
        _data_whole,
        _numpy_whole,
    ],
    ids=["no-grad", "copy_", "view", "set_", "optimizer", ".data", "numpy"],
)
def test_a_change_by_any_route_is_in_the_next_checkpoint(
    tmp_path: Path, route: Callable[[Model], None]
) -> None:
    # Catches, per route: a storage taken for unchanged although PyTorch counted the change
    # (no_grad, copy_, view, optimizer), was swapped (set_), or changed everywhere
    # unseen (.data, numpy: the samples must see it).
    model = Model()
    _warm(tmp_path, model)
    before = model.base.weight.detach().clone()
    route(model)
    assert not torch.equal(model.base.weight, before)  # the route did change it
    _save(model, 5)
    assert torch.equal(_saved_base(tmp_path, 5), model.base.weight)
    nm.shutdown()


@pytest.mark.parametrize("via", [".data", "numpy"])
def test_a_small_uncounted_change_is_never_silently_stale(
    tmp_path: Path, via: str, caplog: pytest.LogCaptureFixture
) -> None:
    # One element written where PyTorch counts nothing: the samples may miss it. Then the
    # audit after the save finds it, the next save says which checkpoint may hold the old
    # value and copies the tensor, and so does every save after. Catches: a stale
    # checkpoint nobody is told of, or a tensor that stays skipped once caught.
    model = Model()
    _warm(tmp_path, model)
    if via == ".data":
        model.base.weight.data[700, 1500] = 99.0
    else:
        model.base.weight.detach().numpy()[700, 1500] = 99.0
    caplog.set_level(logging.WARNING, logger="nebulaml")
    _save(model, 5)
    _pool().settle_audits()
    stale = not torch.equal(_saved_base(tmp_path, 5), model.base.weight)
    _save(model, 6)
    said = [r.getMessage() for r in caplog.records if "version counter" in r.getMessage()]
    if stale:
        assert len(said) == 1 and "'global_step5'" in said[0], said
    assert torch.equal(_saved_base(tmp_path, 6), model.base.weight)
    model.base.weight.data[701, 1500] = 98.0  # once caught, always copied
    _save(model, 7)
    _save(model, 8)
    assert torch.equal(_saved_base(tmp_path, 7), model.base.weight)
    assert torch.equal(_saved_base(tmp_path, 8), model.base.weight)
    nm.shutdown()


def test_an_optimizers_state_is_copied_every_step(tmp_path: Path) -> None:
    # Catches: optimizer state (moments that change in place every step) taken for
    # unchanged: a resume would restart Adam from stale moments.
    model = Model()
    optimizer = torch.optim.Adam(model.adapter.parameters(), lr=0.01)
    nm.init(str(tmp_path), persistent_time_interval=0, num_of_version_in_retention=10)
    for step in range(1, 7):
        model.adapter(torch.randn(2, COLS)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        _save(model, step, optimizer)
        saved = torch.load(tmp_path / f"global_step{step}" / "optimizer", weights_only=True)
        live = optimizer.state_dict()["state"]
        for index, state in live.items():
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(saved["state"][index][key], state[key]), (step, key)
        model_saved = torch.load(tmp_path / f"global_step{step}" / "model", weights_only=True)
        assert torch.equal(model_saved["adapter.weight"], model.adapter.weight)
    assert _pool().reused_bytes > 0  # the base was still skipped
    nm.shutdown()


def test_a_piece_hashed_from_its_kept_head_hashes_the_bytes_of_each_fill() -> None:
    # Catches: a piece whose head the fill did not write hashed from a hasher state kept
    # for another head (the fill's first copy in that piece begins elsewhere now): its
    # leaf then covers the wrong bytes, and the item's checksum is not the buffer's.
    from nebulaml.format.checksum import checksum_of
    from nebulaml.runtime.snapshot import fill

    torch.manual_seed(5)
    # Small tensors between 1.5 MiB frozen ones: pieces whose copies begin mid-piece.
    state = {
        "a": torch.randn(5_000),
        "frozen1": torch.randn(393_216),
        "b": torch.randn(7_000),
        "c": torch.randn(3_000),
        "frozen2": torch.randn(393_216),
        "d": torch.randn(11_000),
    }
    cache, memory, layout, buffer, view = _buffer_for(state)
    changes = [(), ("b",), ("b",), ("c",), ("b", "c"), ("a", "d"), ("b",), ("b",), ("d",)]
    for step, changed in enumerate(changes):
        for name in changed:
            with torch.no_grad():
                state[name].add_(1.0)
        layout = cache.plan("item", state)
        assert layout is not None
        digest = fill(buffer, view, layout, memory=memory)
        memory.settle()
        assert digest == checksum_of(bytes(view)), (step, changed)
    record = memory.record
    assert record is not None and record.prefixes  # heads were kept and used
    assert memory.reused_bytes >= 2 * 393_216 * 4


def test_the_first_fill_that_skips_after_a_full_one_hashes_no_head(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Catches: a full fill that keeps no hash state where a later copy in a piece begins:
    # the next fill, the first to skip storages (the first save after a start, or after
    # the periodic full fill), hashes every such piece's head again.

    torch.manual_seed(6)
    state = {
        "frozen1": torch.randn(393_216),
        "b": torch.randn(7_000),
        "frozen2": torch.randn(393_216),
    }
    heads, memory, layout = _heads_hashed_again(monkeypatch, state, ["b"])
    torchs = layout.size_bytes - layout.tensor_bytes  # the pickle and zip headers: held too
    assert memory.reused_bytes == 2 * 393_216 * 4 + torchs  # both frozen tensors skipped
    assert heads == []  # b's piece hashed on from the state the full fill kept


def test_a_kept_bias_before_an_adapter_costs_no_head_either(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Catches: a piece whose first copy does not begin at its start (a kept bias the
    # layout puts first among a LoRA layer's small records: they lie largest first, after
    # the frozen weights) keeping the hash state at that copy alone: the next fill, which
    # keeps the bias and copies the adapters after it, hashes the piece's head again.
    import nebulaml.runtime.snapshot as snapshot

    torch.manual_seed(8)
    state = {
        "a0": torch.randn(5_000),
        "w1": torch.randn(4 << 20),
        "bias": torch.randn(6_000),
        "adapter": torch.randn(5_000),
        "w2": torch.randn(4 << 20),
    }
    heads, memory, layout = _heads_hashed_again(monkeypatch, state, ["adapter", "a0"])
    piece = snapshot._PIECE_BYTES
    a0, w1, bias, adapter, w2 = (offset for offset, _ in layout.regions)
    assert max(w1, w2) < bias < min(a0, adapter)  # the bias first among the small ones
    assert bias // piece == a0 // piece == adapter // piece  # its piece begins with bytes
    # no fill copies (the kept bias), the adapters after them
    torchs = layout.size_bytes - layout.tensor_bytes  # zeros, pickle and headers: held too
    assert memory.reused_bytes == 2 * (4 << 20) * 4 + 6_000 * 4 + torchs  # w1, w2, the bias
    assert heads == []


def test_a_fill_of_thin_parts_copies_alone_and_a_full_one_is_helped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Catches: a helper woken for a fill whose parts are spread thin over many pieces (a
    # LoRA's adapters between frozen weights), where taking turns at the GIL costs more
    # than the second core gains; or a full fill that is never helped.
    import nebulaml.runtime.snapshot as snapshot
    from nebulaml.format import checksum
    from nebulaml.format.checksum import checksum_of
    from nebulaml.runtime.crew import FILL_CREW
    from nebulaml.runtime.snapshot import fill

    monkeypatch.setattr(snapshot, "_PIECE_BYTES", 4096 + 8)
    monkeypatch.setattr(checksum, "LEAF_BYTES", 4096 + 8)
    torch.manual_seed(9)
    state: dict[str, torch.Tensor] = {}
    for i in range(100):
        state[f"w{i}"] = torch.randn(4_104)  # four pieces, frozen
        state[f"a{i}"] = torch.randn(200)  # 800 bytes, trained
    cache, memory, layout, buffer, view = _buffer_for(state)
    helped: list[bool] = []
    real = FILL_CREW.submit
    monkeypatch.setattr(FILL_CREW, "submit", lambda fn: helped.append(True) or real(fn))
    fill(buffer, view, layout, memory=memory)  # every byte: 1.7 MB in full pieces
    assert helped
    helped.clear()
    with torch.no_grad():
        for i in range(100):
            state[f"a{i}"].add_(1.0)
    layout = cache.plan("item", state)
    assert layout is not None
    digest = fill(buffer, view, layout, memory=memory)  # 80 kB, 800 bytes a piece
    memory.settle()
    assert digest == checksum_of(bytes(view))
    assert memory.reused_bytes >= 100 * 4_104 * 4
    assert helped == []


def test_a_checkpoints_audits_start_once_it_is_committed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Catches: an audit started as an item's fill ends, which then runs beside the
    # checkpoint's next item's copy (on 2 cores, a share of the frozen-base save).
    from nebulaml.runtime.crew import AUDIT_CREW

    model = Model()
    _warm(tmp_path, model)
    started: list[bool] = []
    real = AUDIT_CREW.submit
    monkeypatch.setattr(AUDIT_CREW, "submit", lambda fn: started.append(True) or real(fn))
    checkpoint = nm.Checkpoint("global_step5", 2)
    checkpoint.save("model", model.state_dict())  # the base skipped: its audit is due
    assert started == []
    checkpoint.save("extra", {"step": torch.tensor(5)})  # the second item commits
    nm.wait_for_snapshot()  # the commit, left to the background by a lazy save
    assert started == [True]
    _pool().settle_audits()
    assert nm.flush_persistence()
    assert torch.equal(_saved_base(tmp_path, 5), model.base.weight)
    nm.shutdown()


def test_the_periodic_full_fill_writes_torchs_own_bytes_again() -> None:
    # Catches: a fill that never writes torch's own bytes (the zip headers, the pickle)
    # again once its buffer holds them: a byte changed there by any hand would be in every
    # later checkpoint, its checksum taken over it.
    import io

    from nebulaml.format.checksum import checksum_of
    from nebulaml.runtime.snapshot import fill
    from nebulaml.runtime.unchanged import FULL_EVERY

    state = {"w": torch.zeros(1_000)}
    cache, memory, layout, buffer, view = _buffer_for(state)
    fill(buffer, view, layout, memory=memory)
    view[0] ^= 0xFF  # the zip's first header byte, torch's own
    for _ in range(FULL_EVERY):
        with torch.no_grad():
            state["w"].add_(1.0)  # every storage changes: nothing is skipped
        layout = cache.plan("item", state)
        assert layout is not None
        digest = fill(buffer, view, layout, memory=memory)
    assert digest == checksum_of(bytes(view))
    loaded = torch.load(io.BytesIO(bytes(view)), weights_only=True)
    assert torch.equal(loaded["w"], state["w"])
