"""A save that only rank 0 of 2 makes, without `ranks=[0]` (the common `if rank == 0:
save`): it waits `rank_timeout_s` for rank 1's part, which never comes. Said early, and
nothing of it left in the memory tier for `nebula gc` and `nebula flush` to disagree on
(issue #48)."""

from __future__ import annotations

import json
import logging
import subprocess
import time
from pathlib import Path

import pytest
import torch

import nebulaml as nm
from nebulaml.protocol.commit import begin_tag, commit_rank, write_item

TAG = "global_step2"


@pytest.fixture
def rank_0_of_2(monkeypatch: pytest.MonkeyPatch) -> None:
    for var, value in (("RANK", "0"), ("WORLD_SIZE", "2"), ("LOCAL_WORLD_SIZE", "2")):
        monkeypatch.setenv(var, value)


@pytest.mark.usefixtures("rank_0_of_2")
def test_a_save_rank_1_never_joins_says_ranks_early_and_leaves_no_part(
    tmp_path: Path, memory_tier: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Bugs caught: save() silent for the whole rank_timeout_s (300 s by default) before
    its error; the uncommitted part left in the memory tier after the error."""
    root = tmp_path / "root"
    nm.init(str(root), rank_timeout_s=2.0)
    with caplog.at_level(logging.WARNING, logger="nebulaml"), pytest.raises(nm.RankTimeoutError):
        nm.Checkpoint(TAG).save("model", {"w": torch.ones(4)})
    failed_at = time.time()
    said = [r for r in caplog.records if "waited" in r.getMessage()]
    assert len(said) == 1, [r.getMessage() for r in caplog.records]
    message = said[0].getMessage()
    assert "rank(s) 1 to save their part" in message, message
    assert f"nm.Checkpoint('{TAG}', ranks=[0])" in message, message
    assert failed_at - said[0].created > 0.5  # said half-way (1 s), not as it failed (2 s)
    assert nm.list_incomplete() == []
    assert not (Path(nm.memory_tier_path()) / TAG).exists()


@pytest.mark.usefixtures("rank_0_of_2")
def test_gc_releases_a_part_that_will_never_commit_and_flush_agrees(
    tmp_path: Path, memory_tier: Path
) -> None:
    """A job that ended with rank 0's part of a checkpoint in its memory tier, rank 1's
    never saved (its writer gone). Bug caught: `gc` kept it, telling to run `nebula flush`
    first, while `flush` found nothing to flush."""
    root = tmp_path / "root"
    nm.init(str(root))
    memory = nm.memory_tier_path()
    from nebulaml.storage.store import Store

    store = Store(memory, durable=False, private=True)
    begin_tag(store, TAG, rank=0, overwrite=False, world_size=2)
    item = write_item(store, TAG, "model", {"w": torch.ones(4)}, rank=0)
    assert commit_rank(store, TAG, rank=0, world_size=2, items=[item], created_at="t") is None
    nm.shutdown()
    assert Path(memory, TAG).is_dir()  # kept at exit: not persisted
    marker = Path(memory, TAG, ".writer-0.json")
    record = json.loads(marker.read_text())
    record["pid"] = _ended_pid()  # its writer has ended
    marker.write_text(json.dumps(record))

    assert nm.ops.persist_memory_tier(str(root)) == []  # flush: nothing to flush
    (tier,) = [t for t in nm.ops.list_memory_tiers() if t.path == memory]
    assert tier.tags == () and tier.leftovers == (TAG,) and tier.newest is None
    (action,) = nm.ops.plan_gc([tier])
    assert action.release, action.reason
    assert "flush" not in action.reason and TAG in action.reason, action.reason
    nm.ops.execute_gc([action])
    assert not Path(memory).exists()


def _ended_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid
