"""Lazy snapshots: save() returns at once, and the fence before optimizer.step() holds.

The snapshot worker is held by a gate (a job that waits for an Event) so that each test
controls when the copy may run, without sleeps. Bugs these catch: a step that mutates the
parameters before the copy (no fence, or a fence that does not wait), a lazy save that
blocks anyway, a background failure that is lost, or raised inside optimizer.step(), and
an exit that drops a queued snapshot.
"""

from __future__ import annotations

import copy
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch
import warm

import nebulaml as nm
from nebulaml.runtime import session as nm_session


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


@pytest.mark.slow
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
    done = warm.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert (root / "global_step3" / "manifest.json").exists()
    nm.init(str(root))
    got = nm.get_checkpoint("global_step3").load("model")["w"]
    assert torch.equal(got, torch.full((10,), 3))


def test_a_forward_pass_that_updates_batchnorm_statistics_does_not_reach_the_snapshot(
    root: Path,
) -> None:
    # BatchNorm's forward writes its running statistics in place without bumping their
    # version counters, so no check after the copy could see it: the small tensors are
    # copied by save() itself. Bug caught: statistics of the step after the save in it.
    nm.init(str(root), persistent_time_interval=0, lazy_snapshot=True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(32, 8)).sum().backward()
    opt.step()
    before = copy.deepcopy(model.state_dict())
    gate = _gate()
    nm.Checkpoint("global_step1").save("model", model)
    model(torch.randn(32, 8) * 5 + 3).sum().backward()  # moves the running statistics
    assert not torch.equal(model[1].running_mean, before["1.running_mean"])
    gate.set()
    opt.step()
    saved = nm.get_latest_checkpoint().load("model")
    assert list(saved) == list(before)
    for key, value in saved.items():
        assert torch.equal(value, before[key]), key
    fresh = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16))
    fresh.load_state_dict(saved)  # the state dict's _metadata came through too
    assert saved._metadata == before._metadata


def test_a_large_tensor_changed_in_place_before_its_copy_fails_the_save(root: Path) -> None:
    # Bug caught: a snapshot holding bytes of after the save, committed as if it were
    # the state at the save.
    nm.init(str(root), persistent_time_interval=0, lazy_snapshot=True)
    weights = torch.zeros(100_000)  # 400 kB: copied by the background, not by save()
    nm.Checkpoint("global_step1").save("model", {"w": weights})
    nm.wait_for_snapshot()
    gate = _gate()
    nm.Checkpoint("global_step2").save("model", {"layers": [{"w": weights}]})
    weights.add_(1)  # not by optimizer.step(): nothing waits for the copy
    gate.set()
    with pytest.raises(nm.SnapshotChangedError, match=r"'model'.*\['layers'\]\[0\]\['w'\]"):
        nm.wait_for_snapshot()
    latest = nm.get_latest_checkpoint()
    assert latest is not None and latest.tag == "global_step1"
    assert torch.equal(latest.load("model")["w"], torch.zeros(100_000))
    assert not (Path(nm.memory_tier_path(str(root))) / "global_step2").exists()
    nm.Checkpoint("global_step3").save("model", {"w": weights})  # the next save is fine
    nm.wait_for_snapshot()
    assert torch.equal(nm.get_latest_checkpoint().load("model")["w"], torch.ones(100_000))


def test_save_copies_small_tensors_keeping_aliasing_and_types(root: Path) -> None:
    # A clone per tensor would split storages that the file shares (and that torch.load
    # shares again); a rebuilt container must keep its type and identity.
    nm.init(str(root), persistent_time_interval=0, lazy_snapshot=True)
    base = torch.arange(12.0)
    shared = {"k": 1}
    obj = {"a": base, "b": base[2:6], "c": base, "d": [shared, shared], "e": (base.view(3, 4),)}
    gate = _gate()
    nm.Checkpoint("global_step1").save("model", obj)
    base.zero_()
    gate.set()
    got = nm.get_latest_checkpoint().load("model")
    assert torch.equal(got["a"], torch.arange(12.0))
    assert torch.equal(got["b"], torch.arange(2.0, 6.0))
    assert got["a"].untyped_storage().data_ptr() == got["b"].untyped_storage().data_ptr()
    assert got["a"].untyped_storage().data_ptr() == got["e"][0].untyped_storage().data_ptr()
    assert type(got["e"]) is tuple and got["d"][0] is got["d"][1]
    assert obj["d"][0] is shared and torch.equal(obj["a"], torch.zeros(12))  # untouched


def test_take_copies_small_storages_and_watches_the_rest() -> None:
    from nebulaml.runtime.fence import COPY_NOW_BYTES, take

    small = torch.nn.Parameter(torch.ones(COPY_NOW_BYTES // 4))  # exactly at the limit
    large = torch.ones(COPY_NOW_BYTES // 4 + 1)
    view_of_large = large[:4]  # small tensor, large storage: watched, not copied
    view_of_small = small.detach()[2:]
    loop: list = [small]
    loop.append(loop)
    obj = {"p": small, "v": view_of_small, "large": large, "view": view_of_large, "loop": loop}
    taken = take(obj)
    assert list(taken.copies) == [small.untyped_storage()._cdata]  # one copy per storage
    assert taken.changed() == []
    with torch.no_grad():
        small.add_(1)
    view_of_large.add_(1)  # a view shares its base's version counter
    assert taken.changed() == ["['large']", "['view']"]
    # torch.save's path: the object rebuilt onto the copies, its own containers untouched
    got = taken.substitute(obj)
    assert type(got["p"]) is torch.nn.Parameter and got["p"].requires_grad
    assert torch.equal(got["p"], torch.ones(COPY_NOW_BYTES // 4))
    assert got["v"].untyped_storage().data_ptr() == got["p"].untyped_storage().data_ptr()
    assert got["large"] is large and got["view"] is view_of_large
    assert got["loop"][1] is got["loop"] and got["loop"][0] is got["p"]
    assert obj["p"] is small and obj["loop"][0] is small


def test_take_watches_tensor_subclasses_without_reading_their_storage() -> None:
    # A subclass (a DTensor, say) may have no storage of its own: it is watched only.
    from nebulaml.runtime.fence import spelt, take

    class Wrapped(torch.Tensor):
        pass

    wrapped = torch.zeros(4).as_subclass(Wrapped)
    taken = take({"t": wrapped})
    assert taken.copies == {} and [spelt(place) for place, _ in taken.large()] == ["['t']"]


def test_a_lazy_save_written_by_torch_save_reads_the_small_copies_too(root: Path) -> None:
    # An object the layout cannot map (a defaultdict) is written by torch.save in the
    # background: its small tensors must come from the copies as well.
    import collections

    nm.init(str(root), persistent_time_interval=0, lazy_snapshot=True)
    stats = torch.zeros(16)
    sparse = torch.eye(3).to_sparse()  # no storage to copy: kept as it is
    obj = {
        "bn": {"running_mean": stats},
        "extra": collections.defaultdict(int, a=1),
        "sparse": sparse,
    }
    gate = _gate()
    nm.Checkpoint("global_step1").save("model", obj)
    stats.add_(5)
    gate.set()
    got = nm.get_latest_checkpoint().load("model", weights_only=False)
    assert torch.equal(got["bn"]["running_mean"], torch.zeros(16))
    assert got["extra"] == {"a": 1}
    assert torch.equal(got["sparse"].to_dense(), torch.eye(3))


def test_a_held_copy_starts_at_the_commit_or_the_fence_and_not_before() -> None:
    # A lazy save's copy waits for its checkpoint's commit (the saves of the next items
    # run alone), but never past a fence or a close: one that waited for ever would hang
    # the optimizer step.
    from nebulaml.runtime.fence import SnapshotWorker

    worker = SnapshotWorker()
    ran: list[str] = []
    started = threading.Event()
    worker.submit(lambda: (ran.append("a"), started.set()), copies=True, hold=True)
    assert not started.wait(0.2)
    worker.submit(lambda: ran.append("commit"), copies=False)  # releases what is before it
    worker.wait()
    assert ran == ["a", "commit"]
    worker.submit(lambda: ran.append("b"), copies=True, hold=True)
    worker.wait(copies_only=True)  # the fence
    assert ran[-1] == "b"
    worker.submit(lambda: ran.append("c"), copies=True, hold=True)
    worker.close()
    assert ran[-1] == "c"


def _watching() -> bool:
    from nebulaml.runtime.write_watch import unavailable

    return unavailable() is None


needs_watch = pytest.mark.skipif(not _watching(), reason="the kernel records no written pages")


@needs_watch
@pytest.mark.parametrize("writer", ["data", "numpy_thread", "edge"])
def test_a_write_no_version_counter_sees_before_the_copy_fails_the_save(
    root: Path, writer: str
) -> None:
    """Bug caught (main): a write through `.data`, or through a NumPy view from another
    thread, bumps no version counter; the lazy copy took the new bytes and committed a
    state that no save had. "edge": the tensor's first element, in a page it shares with
    other memory (not protected: its bytes are taken at the save and compared after)."""
    nm.init(str(root), persistent_time_interval=0, lazy_snapshot=True)
    weights = torch.zeros(1 << 20)  # 4 MB: copied by the background
    nm.Checkpoint("global_step1").save("model", {"w": weights})
    nm.wait_for_snapshot()
    gate = _gate()
    nm.Checkpoint("global_step2").save("model", {"w": weights})
    version = weights._version
    if writer == "data":
        weights.data[500_000] = 7.0
    elif writer == "edge":
        weights.data[0] = 7.0
    else:
        thread = threading.Thread(target=lambda: weights.numpy().__setitem__(500_000, 7.0))
        thread.start()
        thread.join()
    assert weights._version == version  # unseen by the version counter
    gate.set()
    with pytest.raises(nm.SnapshotChangedError, match=r"'model'.*\['w'\]"):
        nm.wait_for_snapshot()
    latest = nm.get_latest_checkpoint()
    assert latest is not None and latest.tag == "global_step1"
    assert torch.equal(latest.load("model")["w"], torch.zeros(1 << 20))
    # The watch is lifted and the next save sees no stale mark.
    nm.Checkpoint("global_step3").save("model", {"w": weights})
    nm.wait_for_snapshot()
    assert float(nm.get_latest_checkpoint().load("model")["w"].sum()) == 7.0


@needs_watch
def test_a_second_save_of_the_same_tensors_never_hides_a_write_from_the_first(
    root: Path,
) -> None:
    """Two lazy saves pending over one tensor: the second protects its pages again, which
    forgets what was written. Bug it would catch: the first save's copy, taken after the
    write, committed as the state of the first save."""
    nm.init(str(root), persistent_time_interval=0, lazy_snapshot=True)
    weights = torch.zeros(1 << 20)
    gate = _gate()
    nm.Checkpoint("global_step1").save("model", {"w": weights})
    weights.data[500_000] = 7.0
    nm.Checkpoint("global_step2").save("model", {"w": weights})
    gate.set()
    with pytest.raises(nm.SnapshotChangedError, match="global_step1"):
        nm.wait_for_snapshot()
    nm.wait_for_snapshot()  # raised once: global_step2, saved after the write, is whole
    latest = nm.get_latest_checkpoint()
    assert latest is not None and latest.tag == "global_step2"
    assert float(latest.load("model")["w"].sum()) == 7.0


@needs_watch
def test_a_lazy_save_lifts_its_watch_and_the_steps_after_it_write_freely(root: Path) -> None:
    """Bug it would catch: pages left protected after the copy (every later write
    faults), or a watch that marks the training's own steps against the next save."""
    from nebulaml.runtime.fence import SnapshotWorker

    nm.init(str(root), persistent_time_interval=0, lazy_snapshot=True)
    big = torch.nn.Linear(512, 512)  # 1 MB of weights, each save's large storages
    opt = torch.optim.AdamW(big.parameters(), lr=0.1)
    for step in range(1, 4):
        nm.Checkpoint(f"global_step{step}").save("model", big.state_dict())
        big(torch.randn(4, 512)).sum().backward()
        opt.step()  # waits for the copy (the fence), then writes every weight
        nm.wait_for_snapshot()
    worker = nm_session.current("test", fence=False).snapshots
    assert isinstance(worker, SnapshotWorker)
    watch = worker.watch
    assert watch._pending == []
    assert watch._watch is not None and watch._watch.ranges  # registered for the session
    assert watch._watch.written() == watch._watch.ranges  # lifted: nothing protected
    assert nm.get_latest_checkpoint().tag == "global_step3"


@needs_watch
def test_a_tensor_freed_and_made_again_at_its_address_is_watched_afresh() -> None:
    """The watch's ranges stay registered for the session; memory freed (unmapped) and
    mapped again at the same address is no longer registered. Bug it would catch: the
    save's protect failing on the stale range, and every later save of that tensor left
    to the version counters alone."""
    from nebulaml.runtime.lazy_watch import LazyWatch

    watch = LazyWatch()
    try:
        addresses = []
        for _ in range(3):
            weights = torch.zeros(1 << 24)  # 64 MB: its own mapping, unmapped when freed
            addresses.append(weights.data_ptr())
            saved = watch.begin([("['w']", weights)])
            assert saved is not None
            weights.data[5_000_000] = 7.0
            assert saved.check() == ["['w']"]
            saved.end()
            del weights
        assert len(set(addresses)) < len(addresses)  # an address was given out again
    finally:
        watch.close()
