"""The default, `lazy_snapshot="auto"`: which saves defer their copy, and which copy at once.

A deferred copy is seen from outside by the memory tier: an item's file appears there
only once its copy runs, and the copy of a checkpoint's first item is held until the
checkpoint is committed or the loop reaches the fence (the next optimizer.step()). So an
item file right after `save()` returns means the copy was taken at save(); none means
it was deferred. Bugs these catch: a default that defers where nothing would see a write
(no optimizer step, a storage the kernel does not watch, a loop that wrote outside the
step), a default that never defers, a deferred copy that misses the fence, a write that
fails the loop instead of being said, an over-budget state refused later than save(), a
new save of a tag that begins in the folder its pending save writes, and a bad
`NEBULA_LAZY_SNAPSHOT`.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

import nebulaml as nm
from nebulaml.runtime import session as nm_session
from nebulaml.runtime.write_watch import unavailable

# Where the kernel watches no writes, the default defers nothing (test_the_variable_...).
watched = pytest.mark.skipif(
    unavailable() is not None, reason=f"the kernel watches no writes here: {unavailable()}"
)

BIG = 1 << 16  # floats: 256 KiB, over what a lazy save copies at once (fence.COPY_NOW_BYTES)


def _trained() -> tuple[dict[str, torch.Tensor], torch.optim.Optimizer]:
    """A state of one large parameter, after an optimizer step (the fence ran)."""
    w = torch.nn.Parameter(torch.zeros(BIG))
    opt = torch.optim.SGD([w], lr=1.0)
    _step(w, opt)
    return {"w": w}, opt


def _step(w: torch.Tensor, opt: torch.optim.Optimizer) -> None:
    w.grad = torch.ones_like(w)
    opt.step()


def _item(root: Path, tag: str, name: str) -> Path:
    # Not nm.memory_tier_path(): a call into nebula waits for the pending copies.
    live = nm_session.live()
    assert live is not None
    return Path(live.tiers.memory.local_path() or "") / tag / name


@watched
def test_after_an_optimizer_step_the_copy_waits_for_the_next_step(root: Path) -> None:
    nm.init(str(root), persistent_time_interval=3600)
    state, opt = _trained()
    ckpt = nm.Checkpoint("global_step1", 2)
    ckpt.save("model", state)
    assert not _item(root, "global_step1", "model").exists()  # deferred
    saved = state["w"].clone()
    _step(state["w"], opt)  # the fence: the copy is taken before the step changes w
    assert _item(root, "global_step1", "model").exists()
    ckpt.save("extra", {"step": 1})
    nm.wait_for_snapshot()
    latest = nm.get_latest_checkpoint()
    assert latest is not None and latest.tag == "global_step1"
    assert torch.equal(latest.load("model")["w"], saved)


def test_without_an_optimizer_step_the_copy_is_taken_at_save(root: Path) -> None:
    # A loop that changes its tensors some other way (plain SGD by hand): nothing would
    # make it wait for a deferred copy.
    nm.init(str(root), persistent_time_interval=3600)
    w = torch.zeros(BIG)
    ckpt = nm.Checkpoint("global_step1", 2)
    ckpt.save("model", {"w": w})
    assert _item(root, "global_step1", "model").exists()
    w.add_(1)  # no error, no lost checkpoint: the copy holds the zeros
    ckpt.save("extra", {"step": 1})
    latest = nm.get_latest_checkpoint()
    assert latest is not None and torch.equal(latest.load("model")["w"], torch.zeros(BIG))


@watched
def test_two_checkpoints_after_one_step_both_wait_for_the_next(root: Path) -> None:
    # Lightning saves `last` and its top-k checkpoint after the same step.
    nm.init(str(root), persistent_time_interval=3600)
    state, opt = _trained()
    # Labelled, as a framework's are: the memory tier keeps both (an unlabelled older
    # one goes once a newer one commits).
    last = nm.Checkpoint("last", 2, labels=["kept"])
    top = nm.Checkpoint("global_step1", 2, labels=["kept"])
    last.save("model", state)
    top.save("model", state)
    assert not _item(root, "last", "model").exists()
    assert not _item(root, "global_step1", "model").exists()
    saved = state["w"].clone()
    _step(state["w"], opt)
    last.save("extra", {"step": 1})
    top.save("extra", {"step": 1})
    nm.wait_for_snapshot()
    for tag in ("last", "global_step1"):
        handle = nm.get_checkpoint(tag)
        assert handle is not None and torch.equal(handle.load("model")["w"], saved)


@watched
def test_a_storage_the_kernel_does_not_watch_is_copied_at_save(root: Path) -> None:
    nm.init(str(root), persistent_time_interval=3600)
    state, _opt = _trained()
    shared = torch.zeros(BIG).share_memory_()  # another process may write it: unmarked
    ckpt = nm.Checkpoint("global_step1", 2)
    ckpt.save("model", {**state, "shared": shared})
    assert _item(root, "global_step1", "model").exists()
    shared.add_(1)
    ckpt.save("extra", {"step": 1})
    latest = nm.get_latest_checkpoint()
    assert latest is not None and torch.equal(latest.load("model")["shared"], torch.zeros(BIG))


@watched
def test_a_write_outside_the_step_costs_that_checkpoint_alone_and_is_said(
    root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    nm.init(str(root), persistent_time_interval=3600)
    state, opt = _trained()
    nm.Checkpoint("global_step1").save("model", state)
    nm.wait_for_snapshot()
    _step(state["w"], opt)
    ckpt = nm.Checkpoint("global_step2", 2)
    ckpt.save("model", state)
    assert not _item(root, "global_step2", "model").exists()  # deferred
    state["w"].data[BIG // 2] = 7.0  # outside the step, and no version counter moves
    ckpt.save("extra", {"step": 2})
    nm.wait_for_snapshot()  # not raised: the synchronous default never refused this loop
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert any("'global_step2' was not committed" in m and "['w']" in m for m in said), said
    latest = nm.get_latest_checkpoint()
    assert latest is not None and latest.tag == "global_step1"
    # From now on the session copies at save(), also after an optimizer step.
    _step(state["w"], opt)
    ckpt = nm.Checkpoint("global_step3", 2)
    ckpt.save("model", state)
    assert _item(root, "global_step3", "model").exists()
    state["w"].data[0] = 9.0
    ckpt.save("extra", {"step": 3})
    latest = nm.get_latest_checkpoint()
    assert latest is not None and latest.tag == "global_step3"
    assert float(latest.load("model")["w"][0].detach()) != 9.0


@watched
def test_a_state_over_the_budget_is_refused_by_save_after_a_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Half of NEBULA_MEMORY_BUFFER_SIZE is the checkpoints' share: 3 BIG tensors' bytes.
    monkeypatch.setenv("NEBULA_MEMORY_BUFFER_SIZE", str(2 * 3 * BIG * 4))
    nm.init(None)  # the memory tier alone: nowhere else for it to go
    state, _opt = _trained()
    with pytest.raises(nm.MemoryBudgetError, match="NEBULA_MEMORY_BUFFER_SIZE"):
        nm.Checkpoint("global_step1").save("model", {**state, "more": torch.zeros(4 * BIG)})
    assert nm.get_latest_checkpoint() is None


def test_lazy_saves_of_one_tag_overwritten_again_and_again_end_as_the_last(root: Path) -> None:
    # Lightning's last.ckpt: each save of "last" began in the folder the one before was
    # still writing in the background, and its commit found another's ("committed by
    # another writer first"), or a persist found an item changed under it.
    nm.init(str(root), persistent_time_interval=0, lazy_snapshot=True)
    for i in range(20):
        nm.Checkpoint("last", overwrite=True).save("model", {"w": torch.full((BIG,), float(i))})
    nm.flush_persistence()
    (listed,) = nm.list_checkpoints()
    assert listed["tag"] == "last" and "persistent" in listed["tiers"]
    assert float(torch.load(root / "last" / "model", weights_only=True)["w"][0]) == 19.0


@pytest.mark.parametrize(
    ("word", "mode"), [("auto", "auto"), ("", "auto"), ("on", True), ("0", False)]
)
def test_the_variable_says_auto_or_a_boolean(
    monkeypatch: pytest.MonkeyPatch, root: Path, word: str, mode: object
) -> None:
    monkeypatch.setenv("NEBULA_LAZY_SNAPSHOT", word)
    nm.init(str(root))
    live = nm_session.live()
    assert live is not None and live.config.lazy_snapshot == mode
    lazy_here = mode is True or (mode == "auto" and unavailable() is None)
    assert (live.snapshots is not None) == lazy_here


def test_a_bad_variable_or_option_names_auto(monkeypatch: pytest.MonkeyPatch, root: Path) -> None:
    monkeypatch.setenv("NEBULA_LAZY_SNAPSHOT", "sometimes")
    with pytest.raises(nm.InvalidArgumentError, match="NEBULA_LAZY_SNAPSHOT must be auto"):
        nm.init(str(root))
    monkeypatch.delenv("NEBULA_LAZY_SNAPSHOT")
    with pytest.raises(nm.InvalidArgumentError, match="True, False or 'auto'"):
        nm.init(str(root), lazy_snapshot="yes")
