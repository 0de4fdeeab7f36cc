"""`peer_replicas` without a process group: the option and its environment variable, the
one warning of a job that has nothing to replicate to, and the replicas a memory tier
holds of other nodes' parts, in its budget, at its release, in `nebula memory`, `ls` and
`gc` (a replica written here as a receiver leaves one).

With real gloo ranks: tests/dist/test_peer_session.py.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import nebulaml as nm
from nebula_cli.app import app
from nebulaml.config import resolve_config
from nebulaml.format.checksum import CHECKSUM_ALGO
from nebulaml.format.names import REPLICA_DONE, REPLICAS_DIR, marker_name
from nebulaml.runtime import peers, session


def hold_replica(memory: Path, rank: int, tag: str, size: int) -> Path:
    """A whole replica of rank `rank`'s part of `tag` (an item of `size` bytes) in the
    memory tier folder `memory`, as a receiver commits one (protocol/replicas.py)."""
    folder = memory / REPLICAS_DIR / f"rank-{rank}" / tag
    folder.mkdir(parents=True)
    for path in (memory / REPLICAS_DIR, folder.parent, folder):
        path.chmod(0o700)
    files = {marker_name(rank): b'{"rank": %d}' % rank, "model": os.urandom(size)}
    claims = []
    for name, data in files.items():
        (folder / name).write_bytes(data)
        (folder / name).chmod(0o600)
        claims.append([name, len(data), CHECKSUM_ALGO, hashlib.sha256(data).hexdigest()[:16]])
    record = {"schema_version": 1, "tag": tag, "rank": rank, "node": rank,
              "created_at": "2026-01-01T00:00:00Z", "received_at": "2026-01-01T00:00:01Z",
              "files": claims}  # fmt: skip
    (folder / REPLICA_DONE).write_text(json.dumps(record))
    (folder / REPLICA_DONE).chmod(0o600)
    return folder


def memory_of_session() -> Path:
    live = session.live()
    assert live is not None
    return Path(live.tiers.memory.root)


# the option -------------------------------------------------------------------------------
def test_peer_replicas_is_0_or_1_from_the_argument_or_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """catches: the environment variable ignored, the argument not winning over it, a
    default other than 0, a string from the environment taken as a count"""
    assert resolve_config("/r", None, None, {}).peer_replicas == 0
    assert resolve_config("/r", None, None, {"peer_replicas": 1}).peer_replicas == 1
    monkeypatch.setenv("NEBULA_PEER_REPLICAS", "1")
    assert resolve_config("/r", None, None, {}).peer_replicas == 1
    assert resolve_config("/r", None, None, {"peer_replicas": 0}).peer_replicas == 0
    monkeypatch.setenv("NEBULA_PEER_REPLICAS", " 0 ")
    assert resolve_config("/r", None, None, {}).peer_replicas == 0


@pytest.mark.parametrize("value", [2, -1, "x", True, 1.5, None])
def test_other_values_are_refused_clearly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, value: object
) -> None:
    """catches: a count of replicas nebula does not make taken silently (2), a bool or a
    typo taken for 1; the environment's bad value refused naming the variable"""
    if value is None:  # the environment's
        monkeypatch.setenv("NEBULA_PEER_REPLICAS", "2")
        with pytest.raises(nm.InvalidArgumentError, match="NEBULA_PEER_REPLICAS must be 0"):
            nm.init(str(tmp_path / "root"))
    else:
        with pytest.raises(nm.InvalidArgumentError, match=r"peer_replicas must be 0 .* or 1"):
            nm.init(str(tmp_path / "root"), peer_replicas=value)
    assert session.live() is None


def test_without_a_process_group_one_warning_and_nothing_else(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """catches: a warning per init (or none), replication started or reported without a
    process group, a save that fails for it"""
    monkeypatch.setattr(peers, "_warned", set())
    caplog.set_level(logging.WARNING, logger="nebulaml")
    root = tmp_path / "root"
    nm.init(str(root), peer_replicas=1)
    nm.init(str(root), peer_replicas=1)
    nm.Checkpoint("global_step1").save("w", torch.ones(2))
    live = session.live()
    assert live is not None and live.peers is None and live.replication is None
    status = nm.persistence_status()
    assert (status.replicated, status.replication, status.replication_error) == (None,) * 3
    said = [r.getMessage() for r in caplog.records if "peer_replicas" in r.getMessage()]
    assert said == [
        "peer_replicas: torch.distributed is not initialised, so there is no node to "
        "replicate the memory tier to: replication is off"
    ]


# replicas in a memory tier -----------------------------------------------------------------
def test_replicas_count_in_the_memory_budget(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 4 MiB budget holding a 3 MiB replica has no room for a 2 MiB item: it goes to the
    persistent tier. catches: replicas left out of the budget (the item would be written
    to the memory tier over it)"""
    monkeypatch.setenv("NEBULA_MEMORY_BUFFER_SIZE", str(8 << 20))  # half for checkpoints
    root = tmp_path / "root"
    nm.init(str(root), persistent_time_interval=3600)
    nm.Checkpoint("global_step1").save("w", torch.zeros(1 << 19))  # 2 MiB: fits
    nm.flush_persistence()
    hold_replica(memory_of_session(), 1, "global_step1", 3 << 20)
    nm.Checkpoint("global_step2").save("w", torch.ones(1 << 19))
    (listed,) = [c for c in nm.list_checkpoints() if c["tag"] == "global_step2"]
    assert listed["tiers"] == ["persistent"]


@pytest.mark.parametrize("newer_persisted", [False, True])
def test_the_release_keeps_replicas_the_root_lacks(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, newer_persisted: bool
) -> None:
    """A clean exit with everything of its own persisted: the memory tier holds a replica
    of rank 1's part of global_step5. Kept while the root holds neither global_step5 nor a
    later step (the node's own checkpoints go); released with the tier once it does.
    catches: a release that deletes a lost node's only copy, or one that never releases
    replicas the root made needless"""
    caplog.set_level(logging.INFO, logger="nebulaml")
    root = tmp_path / "root"
    nm.init(str(root), persistent_time_interval=0)
    memory = memory_of_session()
    step = 6 if newer_persisted else 4
    nm.Checkpoint(f"global_step{step}").save("w", torch.ones(4))
    nm.flush_persistence()
    replica = hold_replica(memory, 1, "global_step5", 1000)
    nm.shutdown()
    if newer_persisted:
        assert not memory.exists()
        return
    assert (replica / REPLICA_DONE).is_file() and (replica / "model").stat().st_size == 1000
    assert not (memory / f"global_step{step}").exists()  # persisted: released as ever
    assert "it holds the replicas of rank 1's part of 'global_step5'" in caplog.text
    # What an operator sees of it, and what gc does.
    shown = CliRunner().invoke(app, ["memory", "--json"])
    assert shown.exit_code == 0, shown.output
    (tier,) = json.loads(shown.stdout)["tiers"]
    assert tier["tags"] == [] and tier["size_bytes"] >= 1000
    (held,) = tier["replicas"]
    assert (held["rank"], held["tag"], held["step"], held["persisted"]) == (
        1, "global_step5", 5, False
    )  # fmt: skip
    table = CliRunner().invoke(app, ["memory"], env={"COLUMNS": "200"})
    assert "global_step5 (rank 1) not persisted" in table.stdout, table.stdout
    listed = CliRunner().invoke(app, ["ls", str(root), "--json"])
    assert [(r["tag"], r["tier"], r["rank"]) for r in json.loads(listed.stdout)["replicas"]] == [
        ("global_step5", "replica", 1)
    ]
    (plan,) = nm.ops.plan_gc(nm.ops.list_memory_tiers())
    assert not plan.release and "rank 1's part of global_step5" in plan.reason, plan.reason
    (plan,) = nm.ops.plan_gc(nm.ops.list_memory_tiers(), discard_unpersisted=True)
    assert plan.release
