"""A hostile node: another user's memory-tier namespace, and symbolic links where nebula's
folders go (issue #16). Nothing is written or deleted through a link or into a folder that
is not this user's alone, and a sentinel tree outside is left exactly as it was.

The tests run as root in CI: "another user" is a folder chowned to an unused uid; where
the suite runs as a plain user, chown is refused and those cases use a 0777 folder instead
(which is refused for the same reason: others can write it).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

import pytest
import torch

import nebulaml as nm
from nebulaml.protocol.memory_tier import memory_root_for
from nebulaml.storage.store import Store

OTHER_UID = 54321


def tree_digest(path: Path) -> str:
    """Names, link targets, modes and bytes of everything under `path`."""
    h = hashlib.sha256()
    for p in sorted(path.rglob("*")):
        st = p.lstat()
        h.update(f"{p.relative_to(path)}:{st.st_mode:o}:{st.st_uid}".encode())
        if p.is_symlink():
            h.update(os.readlink(p).encode())
        elif p.is_file():
            h.update(p.read_bytes())
    return h.hexdigest()


@pytest.fixture
def sentinel(tmp_path: Path) -> Path:
    """A user's project: files nebula must never touch."""
    project = tmp_path / "project"
    (project / "src").mkdir(parents=True)
    (project / "src" / "train.py").write_text("print('hello')\n")
    (project / "README").write_text("my project\n")
    return project


def plant_forged_tier(base: Path, root: Path, sentinel: Path) -> Path:
    """What an attacker leaves in a namespace it made (NEBULA_MEMORY_TIER_PATH is `base`):
    the victim's tier folder, a tag linked to the victim's project, a forged checkpoint."""
    base.mkdir(mode=0o777, exist_ok=True)
    base.chmod(0o777)
    folder = Path(memory_root_for(Store(str(root))))
    folder.mkdir(mode=0o777)
    folder.chmod(0o777)
    (folder / "global_step9").symlink_to(sentinel)
    forged = folder / "global_step99"
    forged.mkdir()
    torch.save({"w": torch.full((4,), 666.0)}, forged / "model")
    (folder / ".nebula-root.json").write_text(json.dumps({"persistent": str(root)}))
    return folder


def give_away(path: Path) -> bool:
    """chown `path` (and what is under it) to another uid; False where not permitted."""
    try:
        for p in [path, *path.rglob("*")]:
            os.lchown(p, OTHER_UID, OTHER_UID)
    except PermissionError:
        return False
    return True


@pytest.mark.parametrize("owner", ["other user", "world-writable"])
def test_a_namespace_someone_else_made_is_refused(
    tmp_path: Path, root: Path, sentinel: Path, owner: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    base = tmp_path / "shm" / "nebula-victim"
    base.parent.mkdir()
    monkeypatch.setenv("NEBULA_MEMORY_TIER_PATH", str(base))
    plant_forged_tier(base, root, sentinel)
    if owner == "other user" and give_away(base):
        base.chmod(0o755)
    before_sentinel, before_base = tree_digest(sentinel), tree_digest(base)

    with pytest.raises(nm.UnsafeMemoryTierError) as refused:
        nm.init(str(root), persistent_time_interval=0)
    assert str(base) in str(refused.value) and "NEBULA_MEMORY_TIER_PATH" in str(refused.value)
    # Reading the root never adopts the forged checkpoint either.
    assert nm.list_checkpoints(str(root)) == []
    assert nm.get_checkpoint("global_step99", str(root)) is None
    assert tree_digest(sentinel) == before_sentinel
    assert tree_digest(base) == before_base


def test_a_world_writable_tier_folder_in_a_private_base_is_refused(
    tmp_path: Path, root: Path, sentinel: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    base = tmp_path / "base"
    base.mkdir(mode=0o700)
    monkeypatch.setenv("NEBULA_MEMORY_TIER_PATH", str(base))
    folder = plant_forged_tier(base, root, sentinel)
    base.chmod(0o700)  # the base is fine; the tier folder in it is not
    before = tree_digest(sentinel), tree_digest(folder)
    with pytest.raises(nm.UnsafeMemoryTierError, match="written by other users"):
        nm.init(str(root), persistent_time_interval=0)
    assert (tree_digest(sentinel), tree_digest(folder)) == before


@pytest.mark.parametrize("kind", ["file", "link"])
def test_a_file_or_link_in_place_of_the_base_is_a_clear_error(
    tmp_path: Path, root: Path, sentinel: Path, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    base = tmp_path / "nebula-victim"
    if kind == "file":
        base.write_text("squatted")
    else:
        base.symlink_to(sentinel)
    monkeypatch.setenv("NEBULA_MEMORY_TIER_PATH", str(base))
    before = tree_digest(sentinel)
    with pytest.raises(nm.UnsafeMemoryTierError, match=r"not a folder|symbolic link"):
        nm.init(str(root))
    assert tree_digest(sentinel) == before
    if kind == "file":
        assert base.read_text() == "squatted"


def test_a_symlinked_tag_folder_is_never_written_through(root: Path, sentinel: Path) -> None:
    nm.init(str(root), persistent_time_interval=3600)
    (root / "global_step9").symlink_to(sentinel)
    before = tree_digest(sentinel)
    # The save never asks the persistent tier (it may be down): it commits in the memory
    # tier, and the persist refuses the link.
    nm.Checkpoint("global_step9").save("model", {"w": torch.ones(3)})
    with pytest.raises(nm.PersistError, match="symbolic link"):
        nm.flush_persistence()
    assert tree_digest(sentinel) == before
    os.unlink(root / "global_step9")

    # Linked after the save, before the persist: the persist fails, the target is intact.
    nm.init(str(root), persistent_time_interval=3600)
    nm.Checkpoint("global_step10").save("model", {"w": torch.ones(3)})
    (root / "global_step10").symlink_to(sentinel)
    with pytest.raises(nm.PersistError, match="symbolic link"):
        nm.flush_persistence()
    assert tree_digest(sentinel) == before
    assert (root / "global_step10").is_symlink()
    # An overwrite, a retention pass or a prune never deletes through it either.
    os.unlink(root / "global_step10")
    nm.flush_persistence("global_step10")
    (root / "global_step1").symlink_to(sentinel)
    nm.Checkpoint("global_step11").save("model", {"w": torch.ones(3)})
    nm.flush_persistence()
    nm.shutdown()
    assert tree_digest(sentinel) == before


def test_a_symlinked_item_file_is_replaced_not_written_through(root: Path, sentinel: Path) -> None:
    # Planted first: the first persist is never held back by the interval, and may start
    # as soon as the save commits.
    (root / "global_step1").mkdir(parents=True)
    (root / "global_step1" / "model").symlink_to(sentinel / "README")
    before = tree_digest(sentinel)
    nm.init(str(root), persistent_time_interval=3600)
    nm.Checkpoint("global_step1").save("model", {"w": torch.ones(3)})
    nm.flush_persistence()
    assert tree_digest(sentinel) == before
    assert not (root / "global_step1" / "model").is_symlink()
    loaded = nm.get_checkpoint("global_step1", str(root)).load("model")
    assert torch.equal(loaded["w"], torch.ones(3))
    nm.shutdown()


def test_prune_skips_a_tag_swapped_for_a_link_and_prunes_the_rest(
    root: Path, sentinel: Path
) -> None:
    """A planned tag folder replaced by a symbolic link before its turn (another user, a
    script). Bug caught: prune stopped with rc 1 at that tag, the rest not pruned."""
    from nebulaml.ops.pruning import execute_prune, list_prune_candidates, plan_prune

    nm.init(str(root), persistent_time_interval=0, num_of_version_in_retention=10)
    for step in range(1, 6):
        nm.Checkpoint(f"global_step{step}").save("model", {"w": torch.ones(3) * step})
        assert nm.flush_persistence() is True
    nm.shutdown()
    plan = plan_prune(list_prune_candidates(str(root)), 1)
    assert [d.tag for d in plan.delete] == [f"global_step{s}" for s in (1, 2, 3, 4)]
    before = tree_digest(sentinel)
    os.rename(root / "global_step2", sentinel / "moved")  # the link points at a real one
    (root / "global_step2").symlink_to(sentinel / "moved")
    after_move = tree_digest(sentinel)
    result = execute_prune(str(root), plan)
    assert result.deleted == ("global_step1", "global_step3", "global_step4")
    (skipped,) = result.skipped
    assert skipped.tag == "global_step2" and "symbolic link" in skipped.reason, skipped
    assert (root / "global_step2").is_symlink() and tree_digest(sentinel) == after_move
    assert before != after_move  # the sentinel did change: by the test's move, not prune


@pytest.mark.parametrize("swapped", ["the newest", "a leftover"])
def test_prune_deletes_the_rest_when_a_tag_it_reads_is_swapped_for_a_link(
    root: Path, sentinel: Path, swapped: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue #43: after the plan, the folder of a tag that prune reads but does not delete
    (the newest, whose manifest proves each deletion safe) or of a leftover it removes is
    replaced by a symbolic link to another folder. Bugs caught: 0 of 39 deleted, rc 1 (the
    newest's read raised for every tag); the leftovers after the linked one not removed."""
    from nebulaml.ops.pruning import execute_prune, list_prune_candidates, plan_prune

    nm.init(str(root), persistent_time_interval=0, num_of_version_in_retention=100)
    for step in range(1, 41):
        nm.Checkpoint(f"global_step{step}").save("model", {"w": torch.ones(3) * step})
        assert nm.flush_persistence() is True
    nm.shutdown()
    for tag in ("global_step50", "global_step51"):  # what crashed saves on another node left
        (root / tag).mkdir()
        (root / tag / "model").write_bytes(b"partial")
        doc = {"host": "another-node", "pid": 1, "rank": 0, "started_at": "2026-01-01T00:00:00Z"}
        (root / tag / ".writer-0.json").write_text(json.dumps(doc))
    plan = plan_prune(list_prune_candidates(str(root), incomplete=True), 1, grace_s=0)
    assert len(plan.delete) == 39 and plan.newest == "global_step40"
    assert [d.tag for d in plan.incomplete] == ["global_step50", "global_step51"]
    victim = "global_step40" if swapped == "the newest" else "global_step50"
    os.rename(root / victim, sentinel / "moved")  # the link points at a real tag folder
    (root / victim).symlink_to(sentinel / "moved")
    after_move = tree_digest(sentinel)

    result = execute_prune(str(root), plan)

    assert (root / victim).is_symlink() and tree_digest(sentinel) == after_move
    skipped = {d.tag: d.reason for d in result.skipped}
    if swapped == "the newest":
        # The newest it can read decides now: global_step39, kept as the newest.
        leftovers = ("global_step50", "global_step51")
        assert result.deleted == (*(f"global_step{s}" for s in range(1, 39)), *leftovers)
        assert skipped == {"global_step39": "it is now the newest committed"}
        said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert any("global_step40" in m and "symbolic link" in m for m in said), said
    else:
        assert result.deleted == (*(f"global_step{s}" for s in range(1, 40)), "global_step51")
        assert list(skipped) == ["global_step50"]
        assert "symbolic link" in skipped["global_step50"], skipped
    assert not (root / "global_step51").exists() and not (root / "global_step1").exists()


def _live_lease_name(kind: str) -> str:
    """A lease's name that would count, were it a file: this host, this live process, now."""
    import socket
    from datetime import datetime, timezone

    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S%fZ")
    return f".lease-{kind}-{stamp}-{os.getpid()}-ab12cd34-{socket.gethostname()}.json"


@pytest.mark.timeout(60)
def test_a_fifo_lease_or_rank_marker_keeps_no_tag_and_fails_verify(root: Path) -> None:
    """Issue #43: a FIFO planted at a lease's name (one that would count, were it a file)
    or in place of a rank marker. Bugs caught: prune said "Deleted 0 of 2" and left both
    folders for ever (the FIFO kept each folder from being emptied, and no later prune
    saw a tag there); `nebula verify` passed the tag whose rank marker was a FIFO."""
    from typer.testing import CliRunner

    from nebula_cli.app import app

    nm.init(str(root), persistent_time_interval=0, num_of_version_in_retention=10)
    for step in (1, 2, 3):
        nm.Checkpoint(f"global_step{step}").save("model", {"w": torch.ones(3) * step})
        assert nm.flush_persistence() is True
    nm.shutdown()
    os.mkfifo(root / "global_step1" / _live_lease_name("read"))
    os.mkfifo(root / "global_step1" / _live_lease_name("hold"))
    (root / "global_step2" / ".rank-0.json").unlink()
    os.mkfifo(root / "global_step2" / ".rank-0.json")

    verified = CliRunner().invoke(app, ["verify", str(root), "--json"])
    assert verified.exit_code == 1, verified.output
    rows = json.loads(verified.stdout)["results"]
    bad = [(r["tag"], r["item"], r["status"]) for r in rows if r["status"] != "ok"]
    assert bad == [("global_step2", ".rank-0.json", "corrupt")], rows
    assert f"{root}/global_step2/.rank-0.json" in verified.stderr

    pruned = CliRunner().invoke(app, ["prune", str(root), "--keep", "1", "--yes", "--json"])
    assert pruned.exit_code == 0, pruned.output
    doc = json.loads(pruned.stdout)
    assert (doc["deleted"], doc["skipped"]) == (["global_step1", "global_step2"], [])
    assert sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")) == [
        "global_step3"
    ]


@pytest.mark.timeout(60)
def test_retention_deletes_a_tag_with_a_fifo_lease(root: Path) -> None:
    """Issue #43: a FIFO at a live-looking lease's name is junk, not a reader: retention
    deletes its tag, folder and all. Bug caught: the folder stayed for ever."""
    nm.init(str(root), persistent_time_interval=0, num_of_version_in_retention=1)
    nm.Checkpoint("global_step1").save("model", {"w": torch.ones(3)})
    assert nm.flush_persistence(timeout_s=20) is True
    os.mkfifo(root / "global_step1" / _live_lease_name("read"))
    nm.Checkpoint("global_step2").save("model", {"w": torch.ones(3) * 2})
    assert nm.flush_persistence(timeout_s=20) is True
    nm.shutdown(timeout_s=20)
    assert sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")) == [
        "global_step2"
    ]


def test_names_with_non_ascii_digits_are_ignored_never_an_exception(root: Path) -> None:
    """`str.isdigit()` accepts "²", `int()` refuses it. Bugs caught: a `.nebula-job-².json`
    in a root made every init raise a bare ValueError; a lease `.lease-read-…-²-…` in a tag
    folder made prune raise, a load raise and retention stop."""
    root.mkdir(parents=True, exist_ok=True)
    (root / ".nebula-job-\u00b2.json").write_text("{}")
    nm.init(str(root), persistent_time_interval=0, num_of_version_in_retention=2)
    nm.Checkpoint("global_step1").save("model", {"w": torch.ones(3)})
    assert nm.flush_persistence() is True
    lease = ".lease-read-20260101T000000000000Z-\u00b2-ab12cd34-elsewhere.json"
    (root / "global_step1" / lease).write_text("{}")
    for step in (2, 3, 4):
        nm.Checkpoint(f"global_step{step}").save("model", {"w": torch.ones(3) * step})
        assert nm.flush_persistence() is True
    # Retention went on: global_step1 is gone (the odd lease holds nothing).
    assert [c["tag"] for c in nm.list_checkpoints(str(root)) if "persistent" in c["tiers"]] == [
        "global_step4",
        "global_step3",
    ]
    nm.shutdown()
    (root / "global_step3" / lease).write_text("{}")
    ckpt = nm.get_checkpoint("global_step3", str(root))
    assert ckpt is not None
    with ckpt:
        assert torch.equal(ckpt.load("model")["w"], torch.ones(3) * 3)
    from nebulaml.ops.pruning import execute_prune, list_prune_candidates, plan_prune

    result = execute_prune(str(root), plan_prune(list_prune_candidates(str(root)), 1))
    assert result.deleted == ("global_step3",), result


@pytest.mark.timeout(60)
def test_a_fifo_in_place_of_the_history_never_blocks_the_persister(
    root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Bug caught: a FIFO at checkpointHistories.csv (no reader) hung the persister's
    append for ever: nothing was persisted after it, flush_persistence() never returned."""
    root.mkdir(parents=True, exist_ok=True)
    os.mkfifo(root / "checkpointHistories.csv")
    nm.init(str(root), persistent_time_interval=0)
    for step in (1, 2):
        nm.Checkpoint(f"global_step{step}").save("model", {"w": torch.ones(3) * step})
        assert nm.flush_persistence(timeout_s=20) is True
    assert (root / "global_step2" / "manifest.json").exists()
    said = [r.getMessage() for r in caplog.records if "checkpoint history" in r.getMessage()]
    assert said and "not a regular file" in said[0], said
    nm.shutdown(timeout_s=20)


@pytest.mark.parametrize("planted", ["pid 1 here", "future elsewhere"])
def test_a_hold_that_cannot_be_trusted_expires(root: Path, planted: str) -> None:
    """Bugs caught: a root hold naming this host and pid 1 (always alive) without a
    process start time, or one of another host renewed "9999-12-31", was honoured for
    ever: RootInUseError at every start."""
    import socket

    root.mkdir(parents=True, exist_ok=True)
    old = "2026-01-01T00:00:00.000000Z"
    holder = {"job": "someone-else", "started_at": old, "renewed_at": old}
    if planted == "pid 1 here":
        holder.update(host=socket.gethostname(), pid=1)
    else:
        holder.update(host="elsewhere", pid=4242, renewed_at="9999-12-31T00:00:00.000000Z")
    hold = root / ".nebula-job-00000001.json"
    hold.write_text(json.dumps(holder))
    hours_ago = os.stat(hold).st_mtime - 7200
    os.utime(hold, (hours_ago, hours_ago))  # a leftover, as the store dates it
    nm.init(str(root), persistent_time_interval=0)  # not RootInUseError
    nm.Checkpoint("global_step1").save("model", {"w": torch.ones(3)})
    assert nm.flush_persistence() is True


def test_a_lease_dated_in_the_future_does_not_keep_a_tag_for_ever(root: Path) -> None:
    """Bug caught: a read lease of another host dated 9999-12-31 kept its tag "being read"
    for ever: retention never deleted it, the disk filled."""
    nm.init(str(root), persistent_time_interval=0, num_of_version_in_retention=1)
    nm.Checkpoint("global_step1").save("model", {"w": torch.ones(3)})
    assert nm.flush_persistence() is True
    lease = ".lease-read-99991231T000000000000Z-4242-ab12cd34-elsewhere.json"
    (root / "global_step1" / lease).write_text("{}")
    nm.Checkpoint("global_step2").save("model", {"w": torch.ones(3) * 2})
    assert nm.flush_persistence() is True
    assert not (root / "global_step1").exists()  # retention went on
    nm.shutdown()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("when", ["before", "during"])
@pytest.mark.parametrize("planted", ["fifo", "link", "folder"])
def test_something_planted_where_a_manifest_goes_never_fails_the_persist(
    root: Path,
    tmp_path: Path,
    planted: str,
    when: str,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found by the junk campaign: a FIFO, a link or a folder planted at manifest.json in
    the folder of a tag being persisted (`during`: after its items are copied) made its
    create-only publish fail as "committed by another writer first": never retried,
    flush_persistence() raised, the job exited 1. Planted `before` the persist, the tag
    was taken for a committed one and its deletion failed on the folder. It is no commit:
    removed by name (the link's target untouched), and the persist commits."""
    import nebulaml.protocol.transfer as transfer

    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_text("keep me")
    before = tree_digest(outside)
    spot = root / "global_step2" / "manifest.json"

    def plant() -> None:
        spot.parent.mkdir(parents=True, exist_ok=True)
        if planted == "fifo":
            os.mkfifo(spot)
        elif planted == "link":
            os.symlink(outside, spot)
        else:
            spot.mkdir()

    copy_item = transfer.copy_item

    def copy_then_plant(src: Store, dst: Store, tag: str, *args: object) -> object:
        note = copy_item(src, dst, tag, *args)  # type: ignore[arg-type]
        if tag == "global_step2" and dst.is_local and Path(dst.root) == root:
            plant()
        return note

    nm.init(str(root), persistent_time_interval=0)
    nm.Checkpoint("global_step1").save("model", {"w": torch.ones(3)})
    assert nm.flush_persistence(timeout_s=20) is True
    if when == "before":
        plant()
    else:
        monkeypatch.setattr(transfer, "copy_item", copy_then_plant)
    nm.Checkpoint("global_step2").save("model", {"w": torch.ones(3) * 2})
    assert nm.flush_persistence(timeout_s=20) is True
    nm.shutdown(timeout_s=20)
    assert spot.is_file() and not spot.is_symlink()
    assert tree_digest(outside) == before
    said = [r.getMessage() for r in caplog.records if "was not a file" in r.getMessage()]
    assert said and str(spot) in said[0], said
    results = nm.ops.verify_checkpoints(str(root))
    assert {(r["tag"], r["status"]) for r in results} == {
        ("global_step1", "ok"),
        ("global_step2", "ok"),
    }, results
    newest = nm.get_latest_checkpoint(str(root))
    assert newest is not None and newest.tag == "global_step2"
    with newest:
        assert torch.equal(newest.load("model")["w"], torch.ones(3) * 2)
