"""Lazy snapshots: save() returns at once, and the fence before optimizer.step() holds.

The snapshot worker is held by a gate (a job that waits for an Event) so that each test
controls when the copy may run, without sleeps. Bugs these catch: a step that mutates the
parameters before the copy (no fence, or a fence that does not wait), a lazy save that
blocks anyway, a background failure that is lost, or raised inside optimizer.step(), and
an exit that drops a queued snapshot.
"""

from __future__ import annotations

import copy
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch

import nebulaml as nm
from nebulaml import session as nm_session


def _gate() -> threading.Event:
    """Hold the snapshot worker until the returned event is set."""
    gate = threading.Event()
    worker = nm_session.current("test", fence=False).snapshots
    assert worker is not None
    worker.submit(gate.wait, copies=True)
    return gate


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(8, 16)).sum().backward()
    opt.step()
    return model, opt


def test_optimizer_step_waits_for_the_snapshot_it_would_change(root: Path) -> None:
    nm.init(str(root), persistent_time_interval=0, lazy_snapshot=True)
    model, opt = _model()
    before = copy.deepcopy(model.state_dict())
    before_opt = copy.deepcopy(opt.state_dict())
    gate = _gate()
    ckpt = nm.Checkpoint("global_step1", 2)
    ckpt.save("model", model)
    ckpt.save("optimizer", opt)
    # The next step's forward and backward run while the snapshot waits.
    model(torch.randn(8, 16)).sum().backward()
    threading.Timer(0.2, gate.set).start()
    opt.step()  # the fence: returns only after the copies, then changes the parameters
    assert not torch.equal(model.state_dict()["0.weight"], before["0.weight"])
    saved = nm.get_latest_checkpoint()
    assert saved is not None and saved.tag == "global_step1"
    for key, value in saved.load("model").items():
        assert torch.equal(value, before[key]), key
    for key, value in saved.load("optimizer")["state"][0].items():
        assert torch.equal(value, before_opt["state"][0][key]), key


def test_a_lazy_save_returns_before_the_copy_and_commits_after_it(root: Path) -> None:
    nm.init(str(root), persistent_time_interval=0, lazy_snapshot=True)
    memory = Path(nm.memory_tier_path(str(root)))  # (every call into nebula fences)
    gate = _gate()
    weights = torch.zeros(1000)
    nm.Checkpoint("global_step1").save("model", {"w": weights})  # would hang if it waited
    assert not (memory / "global_step1" / "manifest.json").exists()
    gate.set()
    nm.wait_for_snapshot()
    assert (memory / "global_step1" / "manifest.json").exists()
    weights.add_(1)  # after the fence: the snapshot is not affected
    assert torch.equal(nm.get_latest_checkpoint().load("model")["w"], torch.zeros(1000))


def test_a_background_failure_is_raised_by_the_next_call_not_by_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("NEBULA_MEMORY_BUFFER_SIZE", str(2 * 4096))
    nm.init(None, lazy_snapshot=True)
    _, opt = _model()
    nm.Checkpoint("global_step1").save("model", {"w": torch.zeros(100_000)})  # over budget
    opt.step()  # the training loop is not interrupted by a checkpoint's failure
    with pytest.raises(nm.MemoryBudgetError):
        nm.wait_for_snapshot()
    nm.wait_for_snapshot()  # raised once
    assert nm.get_latest_checkpoint() is None


def test_lazy_saves_queued_at_exit_are_committed_and_persisted(tmp_path: Path) -> None:
    root = tmp_path / "persistent"
    script = textwrap.dedent(
        f"""
        import torch, nebulaml as nm
        nm.init({str(root)!r}, persistent_time_interval=3600, lazy_snapshot=True)
        for step in range(1, 4):
            nm.Checkpoint(f"global_step{{step}}").save("model", {{"w": torch.full((10,), step)}})
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert (root / "global_step3" / "manifest.json").exists()
    nm.init(str(root))
    got = nm.get_checkpoint("global_step3").load("model")["w"]
    assert torch.equal(got, torch.full((10,), 3))
