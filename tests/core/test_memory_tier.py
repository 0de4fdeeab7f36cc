"""The memory tier belongs to one root and one job's lifetime (issue #16).

A root deleted and created again never sees its predecessor's memory tier; a root reached
through a symbolic link is the same root; two tiers that hold one tag with different bytes
fail `verify`; a job that ends with everything persisted gives its RAM back, and one that
crashes leaves it for the next `init` of that root, which persists it and then gives it
back. The crashes are real child processes (children/nebula_child.py).
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import warm
from children import crashkit
from children.crashkit import committed_tags
from typer.testing import CliRunner

import nebulaml as nm
from nebula_cli.app import app
from nebulaml.format.names import ROOT_ID_FILE
from nebulaml.protocol.leases import read_lease
from nebulaml.protocol.memory_tier import memory_root_for
from nebulaml.protocol.tiers import open_tiers
from nebulaml.storage.store import Store

TIMEOUT_S = 120


def crash_leaving_step3(start_child: Callable[..., crashkit.Child], root: Path) -> Path:
    """A job that persisted global_step1, committed 2 and 3 in RAM, and was SIGKILLed:
    returns its memory tier folder (which holds global_step3, unpersisted)."""
    child = start_child("crash_after_commits", str(root))
    assert child.wait(TIMEOUT_S) == -signal.SIGKILL, child.stderr
    folder = Path(memory_root_for(Store(str(root))))
    assert committed_tags(Store(str(folder))) == ["global_step3"]
    return folder


@pytest.mark.slow
def test_a_deleted_root_starts_fresh_and_never_sees_the_old_data(
    start_child: Callable[..., crashkit.Child], root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    crash_leaving_step3(start_child, root)
    shutil.rmtree(root)

    # Nothing reads the deleted root's RAM copy, and nothing recreates the root from it.
    assert nm.list_checkpoints(str(root)) == []
    assert nm.get_latest_checkpoint(str(root)) is None
    with pytest.raises(nm.RootNotFoundError):
        nm.persist_memory_tier(str(root))
    flushed = CliRunner().invoke(app, ["flush", str(root)])
    assert flushed.exit_code == 3, flushed.output
    assert not root.exists()

    # The same script again: it starts from nothing, and its own global_step3 is its own.
    with caplog.at_level(logging.WARNING, logger="nebulaml"):
        nm.init(str(root), persistent_time_interval=0)
    released = [r.getMessage() for r in caplog.records if "released" in r.getMessage()]
    assert len(released) == 1 and "global_step3" in released[0] and str(root) in released[0]
    assert nm.get_latest_checkpoint() is None
    mine = {"w": torch.full((8,), 7.0)}
    nm.Checkpoint("global_step3").save("model", mine)
    nm.flush_persistence()
    loaded = nm.get_latest_checkpoint().load("model")
    assert torch.equal(loaded["w"], mine["w"])
    nm.shutdown()
    assert committed_tags(Store(str(root))) == ["global_step3"]
    loaded = nm.get_checkpoint("global_step3", str(root)).load("model")
    assert torch.equal(loaded["w"], mine["w"])
    history = crashkit.history_rows(root)
    assert {r["tag"] for r in history} == {"global_step3"}  # no row of the deleted run


def test_a_root_created_again_has_another_identity(root: Path) -> None:
    nm.init(str(root), keep_memory_tier=True, persistent_time_interval=0)
    nm.Checkpoint("global_step1").save("model", {"w": torch.ones(2)})
    nm.shutdown()
    first = (root / ROOT_ID_FILE).read_bytes()
    assert open_tiers(str(root)).memory_usable
    shutil.rmtree(root)
    root.mkdir()  # the root exists again, empty, without nebula's identity
    tiers = open_tiers(str(root))
    assert not tiers.memory_usable and "gone" in (tiers.memory_note or "")
    nm.init(str(root))
    assert (root / ROOT_ID_FILE).read_bytes() != first
    assert nm.list_checkpoints() == []
    nm.shutdown()


@pytest.mark.slow
def test_a_root_reached_through_a_link_is_the_same_root(
    start_child: Callable[..., crashkit.Child], tmp_path: Path
) -> None:
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    crash_leaving_step3(start_child, tmp_path / "link" / "c")
    assert memory_root_for(Store(str(real / "c"))) == memory_root_for(
        Store(str(tmp_path / "link" / "c"))
    )
    flushed = CliRunner().invoke(app, ["flush", str(real / "c")])
    assert flushed.exit_code == 0, flushed.output
    assert "global_step3" in flushed.output
    assert committed_tags(Store(str(real / "c"))) == ["global_step1", "global_step3"]


RESAVED_THEN_KILLED = """
import os, signal, sys, torch, nebulaml as nm
nm.init(sys.argv[1], persistent_time_interval=3600)
nm.Checkpoint("global_step5").save("model", {"w": torch.zeros(4)})
nm.flush_persistence()  # persisted; the next persist is an hour away
nm.Checkpoint("global_step5", overwrite=True).save("model", {"w": torch.ones(4)})
nm.wait_for_snapshot()  # its lazy copy taken (the default): a crash keeps it
os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.slow
def test_verify_fails_when_two_tiers_hold_other_bytes_under_one_tag(
    root: Path, memory_tier: Path
) -> None:
    env = dict(os.environ, NEBULA_MEMORY_TIER_PATH=str(memory_tier))
    command = [sys.executable, "-c", RESAVED_THEN_KILLED, str(root)]
    job = warm.run(command, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert job.returncode == -signal.SIGKILL, job.stderr
    results = nm.verify_checkpoints(str(root), "global_step5")
    assert [r["status"] for r in results] == ["ok", "ok", "differs"]
    (differs,) = [r for r in results if r["status"] == "differs"]
    assert "(memory)" in differs["file"] and "(persistent)" in differs["file"]
    cli = CliRunner().invoke(app, ["verify", str(root), "global_step5"])
    assert cli.exit_code == 1
    assert "differs" in cli.output
    # The next init of the root persists the newer copy: the tiers agree again.
    nm.init(str(root))
    nm.flush_persistence()
    results = nm.verify_checkpoints(str(root), "global_step5")
    assert {r["status"] for r in results} == {"ok"}
    assert torch.equal(nm.get_checkpoint("global_step5").load("model")["w"], torch.ones(4))
    nm.shutdown()


# lifetime ---------------------------------------------------------------------------------
def test_a_clean_exit_gives_the_memory_tier_back(root: Path, memory_tier: Path) -> None:
    nm.init(str(root))  # the default interval: shutdown persists what is pending
    nm.Checkpoint("global_step1").save("model", {"w": torch.ones(1000)})
    nm.Checkpoint("global_step2").save("model", {"w": torch.ones(1000)})
    folder = Path(nm.memory_tier_path())
    assert folder.is_dir()
    nm.shutdown()
    assert not folder.exists()
    assert [t for t in nm.list_memory_tiers() if t.root == str(root)] == []
    assert committed_tags(Store(str(root)))[-1] == "global_step2"


# Another process reads the tier's copy of global_step1 and waits for a line on stdin.
READS_AND_WAITS = {
    "a read": """
import sys
from nebulaml.protocol.leases import read_lease
from nebulaml.storage.store import Store
with read_lease(Store(sys.argv[1]), "global_step1") as readable:
    print(readable, flush=True)
    sys.stdin.readline()
""",
    "a handle": """
import sys, nebulaml as nm
handle = nm.get_checkpoint("global_step1", sys.argv[2])
print(handle is not None, flush=True)
sys.stdin.readline()
print(handle.load("model")["w"].sum().item(), flush=True)
""",
}


@pytest.mark.slow
@pytest.mark.parametrize("reader", sorted(READS_AND_WAITS))
def test_a_clean_exit_keeps_what_another_process_is_reading(root: Path, reader: str) -> None:
    # The concurrency campaign caught it: a job's exit removed its whole memory tier while
    # another process held a read lease on a tag there (the tag's only copy by then).
    nm.init(str(root), persistent_time_interval=0)
    nm.Checkpoint("global_step1").save("model", {"w": torch.full((4,), 2.0)})
    nm.flush_persistence()
    folder = Path(nm.memory_tier_path())
    child = warm.Popen(
        [sys.executable, "-c", READS_AND_WAITS[reader], str(folder), str(root)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert child.stdout is not None and child.stdin is not None
        assert child.stdout.readline().strip() == "True"
        nm.shutdown()
        # The tag it reads stays, whole, in RAM; the tier is not in use any more.
        assert committed_tags(Store(str(folder))) == ["global_step1"]
        assert [t.tags for t in nm.list_memory_tiers() if t.path == str(folder)] == [
            ("global_step1",)
        ]
        child.stdin.write("go\n")
        child.stdin.flush()
        out, _ = child.communicate(timeout=TIMEOUT_S)
    finally:
        child.kill()
        child.wait()
    assert child.returncode == 0
    if reader == "a handle":
        assert out.strip() == "8.0"
    # Once read, `nebula gc` gives it back (the job ended, its newest is persisted).
    gc = CliRunner().invoke(app, ["gc", "--yes"])
    assert gc.exit_code == 0, gc.output
    assert not folder.exists()


def test_a_clean_exit_is_not_kept_by_this_process_own_handles(root: Path) -> None:
    nm.init(str(root), persistent_time_interval=0)
    nm.Checkpoint("global_step1").save("model", {"w": torch.full((4,), 3.0)})
    nm.flush_persistence()
    folder = Path(nm.memory_tier_path())
    handle = nm.get_latest_checkpoint()
    assert nm.list_checkpoints()[0]["tiers"] == ["memory", "persistent"]  # a listing's hold
    nm.shutdown()
    assert not folder.exists()
    assert torch.equal(handle.load("model")["w"], torch.full((4,), 3.0))  # the root's copy


def test_gc_keeps_a_tag_being_read(root: Path) -> None:
    nm.init(str(root), persistent_time_interval=0, keep_memory_tier=True)
    nm.Checkpoint("global_step1").save("model", {"w": torch.ones(3)})
    nm.shutdown()
    folder = Path(nm.memory_tier_path(str(root)))
    with read_lease(Store(str(folder)), "global_step1") as readable:
        assert readable
        gc = CliRunner().invoke(app, ["gc", "--yes"])
        assert gc.exit_code == 1, gc.output  # its release refused: not all done
        assert "being read by another process: global_step1" in gc.output
        assert committed_tags(Store(str(folder))) == ["global_step1"]
    gc = CliRunner().invoke(app, ["gc", "--yes"])
    assert gc.exit_code == 0, gc.output
    assert not folder.exists()


@pytest.mark.parametrize("how", ["argument", "environment"])
def test_keep_memory_tier_keeps_it(root: Path, how: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if how == "environment":
        monkeypatch.setenv("NEBULA_KEEP_MEMORY_TIER", "1")
        nm.init(str(root), persistent_time_interval=0)
    else:
        nm.init(str(root), persistent_time_interval=0, keep_memory_tier=True)
    nm.Checkpoint("global_step1").save("model", {"w": torch.ones(3)})
    nm.shutdown()
    # The next job on this node loads it from RAM.
    assert nm.list_checkpoints(str(root))[0]["tiers"] == ["memory", "persistent"]


@pytest.mark.slow
def test_after_a_crash_the_tier_stays_until_the_next_init_persisted_it(
    start_child: Callable[..., crashkit.Child], root: Path
) -> None:
    folder = crash_leaving_step3(start_child, root)
    restarted = start_child("init_and_exit", str(root))  # persists global_step3, exits
    assert restarted.wait(TIMEOUT_S) == 0, restarted.stderr
    assert committed_tags(Store(str(root))) == ["global_step1", "global_step3"]
    assert not folder.exists()


def test_a_job_without_a_persistent_root_keeps_its_tier(memory_tier: Path) -> None:
    nm.init()
    nm.Checkpoint("global_step1").save("model", {"w": torch.ones(3)})
    folder = Path(nm.memory_tier_path())
    nm.shutdown()
    assert committed_tags(Store(str(folder))) == ["global_step1"]  # its only copy
    shutil.rmtree(folder)


def test_a_failed_persist_keeps_the_tier(root: Path) -> None:
    nm.init(str(root), persistent_time_interval=3600)
    # In the way before the save: the first persist starts at once, and on a quick thread
    # had made the folder before a file planted after the save (a CI-like run).
    (root / "global_step1").write_text("in the way")  # the persist cannot make its folder
    nm.Checkpoint("global_step1").save("model", {"w": torch.ones(3)})
    folder = Path(nm.memory_tier_path())
    with pytest.raises(nm.NebulaError):
        nm.shutdown()
    assert committed_tags(Store(str(folder))) == ["global_step1"]
    shutil.rmtree(folder)


def _hold_of_a_live_job_elsewhere(root: Path) -> None:
    """The root held by another job, on another host, renewed just now."""
    from datetime import datetime, timezone

    from nebulaml.protocol.holds import Holder, lease_name

    now = datetime.now(timezone.utc).isoformat()
    root.mkdir(parents=True, exist_ok=True)
    holder = Holder("job-elsewhere", "node-elsewhere", 4242, None, now, now)
    (root / lease_name(1)).write_bytes(holder.to_bytes())


def test_a_refused_init_leaves_no_memory_tier_behind(root: Path, memory_tier: Path) -> None:
    # Catches: an init refused because another live job holds the root (RootInUseError)
    # leaving its new memory-tier folder (hold, record and claim files) in the base folder.
    _hold_of_a_live_job_elsewhere(root)
    with pytest.raises(nm.RootInUseError, match="pid 4242 on node-elsewhere"):
        nm.init(str(root))
    assert list(memory_tier.iterdir()) == []
    with pytest.raises(nm.InvalidArgumentError):  # a bad argument: refused before any
        nm.init(str(root), persistent_time_interval="soon")
    assert list(memory_tier.iterdir()) == []


def test_a_refused_init_keeps_the_checkpoints_a_tier_holds(root: Path) -> None:
    # Catches: the refusal giving back a tier that holds what an earlier job left there.
    nm.init(str(root), persistent_time_interval=3600, keep_memory_tier=True)
    nm.Checkpoint("global_step1").save("model", {"w": torch.ones(3)})
    folder = Path(nm.memory_tier_path())
    nm.shutdown()
    _hold_of_a_live_job_elsewhere(root)
    with pytest.raises(nm.RootInUseError):
        nm.init(str(root))
    assert committed_tags(Store(str(folder))) == ["global_step1"]
    shutil.rmtree(folder)


# files are private -------------------------------------------------------------------------
def test_every_memory_tier_file_is_private(root: Path, memory_tier: Path) -> None:
    nm.init(str(root), keep_memory_tier=True)
    ckpt = nm.Checkpoint("global_step1", 2)
    ckpt.save("model", {"w": torch.ones(3)})  # the reused-buffer path
    ckpt.save("extra", {"tags": {"a", "b"}, "note": object.__name__})  # torch.save's path
    folder = Path(nm.memory_tier_path())
    nm.shutdown()
    seen = 0
    for path in [memory_tier, *memory_tier.rglob("*")]:
        mode = path.lstat().st_mode & 0o777
        if path.is_dir():
            assert mode == 0o700, (path, oct(mode))
        else:
            assert mode == 0o600, (path, oct(mode))
            seen += 1
    assert (folder / "global_step1" / "manifest.json").exists() and seen >= 5
