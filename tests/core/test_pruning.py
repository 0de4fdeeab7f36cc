"""Pruning: `plan_prune` table-driven (no I/O), then `execute_prune` on real roots.

The plan tests need no filesystem: the listing is built by hand and its root does not
exist. The execute tests write real checkpoints with the library and then change the root
between the plan and the execution, as a running job or another operator would, to show
that every deletion is re-checked at the last moment.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import socket
import sys
from pathlib import Path

import pytest
import torch
import warm

import nebulaml as nm
from nebulaml.ops.pruning import Leftover, PruneDecision, PruneListing, plan_prune
from nebulaml.protocol.catalog import list_committed
from nebulaml.protocol.delete import delete_checkpoint
from nebulaml.protocol.retention import Version, plan_retention
from nebulaml.storage.store import Store

NO_ROOT = "/nonexistent/nebula-prune-plan"  # plan_prune must never touch it


def v(step: int | str, labels: tuple[str, ...] = (), committed_at: str = "2026-01-01T00:00:00Z"):
    """A committed version: `global_step<step>` for an int, else the tag itself."""
    tag = f"global_step{step}" if isinstance(step, int) else step
    return Version(tag, committed_at, labels)


def tags(decisions) -> list[str]:
    return [d.tag for d in decisions]


# plan_prune: committed versions ---------------------------------------------------------------
def names(spec: str) -> list[str]:
    """'1 2 best-a' -> ['global_step1', 'global_step2', 'best-a']."""
    return [f"global_step{t}" if t.isdigit() else t for t in spec.split()]


B = ("best",)
DAY1, DAY2 = "2026-01-01T00:00:00Z", "2026-01-02T00:00:00Z"

# fmt: off
PLAN_CASES = [
    # versions                        keep  incl.  delete  kept  protected  id (the bug it catches)
    ([v(1), v(2), v(3), v(4)],          2, False, "1 2",  "3",  "4",
     "keeps-the-n-newest"),                       # the newest not counted towards keep
    ([v(1), v(2), v(3)],                1, False, "1 2",  "",   "3",
     "keep-1-leaves-only-the-newest"),
    ([v(1), v(2, B), v(3, B)],          1, True,  "1 2",  "",   "3",
     "newest-kept-even-labelled-and-included"),   # the newest treated like any labelled one
    ([v(1), v(2, B), v(3), v(4)],       2, False, "1",    "3",  "4 2",
     "labelled-protected-and-not-counted"),       # a labelled version deleted, or counted
    ([v(1), v(2, B), v(3), v(4)],       2, True,  "1 2",  "3",  "4",
     "include-labelled-makes-them-ordinary"),
    ([v(9), v(10), v(100)],             2, False, "9",    "10", "100",
     "orders-by-step-not-by-text"),               # "global_step9" > "global_step100" as text
    ([v("a", (), DAY2), v("b", (), DAY1), v(1)], 2, False, "b", "a", "1",
     "no-step-sorts-first-then-by-commit-time"),
    ([],                                3, False, "",     "",   "",
     "empty-root"),
    ([v(1), v(2)],                      5, False, "",     "1",  "2",
     "keep-more-than-exist"),
]
# fmt: on


@pytest.mark.parametrize(
    ("versions", "keep", "include_labelled", "delete", "kept", "protected"),
    [pytest.param(*case[:-1], id=case[-1]) for case in PLAN_CASES],
)
def test_plan_prune_committed(
    versions: list[Version],
    keep: int,
    include_labelled: bool,
    delete: str,
    kept: str,
    protected: str,
) -> None:
    versions = random.Random(0).sample(versions, len(versions))  # the order must not matter
    listing = PruneListing(NO_ROOT, tuple(versions))
    plan = plan_prune(listing, keep, include_labelled=include_labelled)
    assert tags(plan.delete) == names(delete)  # oldest first
    assert tags(plan.keep) == names(kept)
    assert tags(plan.protected) == names(protected)
    assert plan.incomplete == ()
    assert plan.root == NO_ROOT and plan.keep_last == keep


def test_plan_reasons_name_why() -> None:
    plan = plan_prune(PruneListing(NO_ROOT, (v(1), v(2, ("best",)), v(3))), 1)
    reasons = {d.tag: d.reason for d in (*plan.delete, *plan.protected)}
    assert reasons == {
        "global_step1": "older than the 1 newest",
        "global_step2": "labelled best",
        "global_step3": "the newest committed checkpoint",
    }


def test_plan_prune_agrees_with_retention() -> None:
    """The CLI's prune and the job's retention delete the same tags for the same count
    (a drift between the two rules would surprise every operator)."""
    rng = random.Random(1234)
    for _ in range(300):
        steps = rng.sample(range(50), rng.randint(0, 12))
        versions = [v(s, ("best",) if rng.random() < 0.2 else ()) for s in steps]
        keep = rng.randint(1, 5)
        plan = plan_prune(PruneListing(NO_ROOT, tuple(versions)), keep)
        assert tags(plan.delete) == plan_retention(versions, keep), (versions, keep)


@pytest.mark.parametrize("keep", [0, -1, True, 1.5])
def test_plan_prune_refuses_a_bad_keep(keep: object) -> None:
    with pytest.raises(nm.InvalidArgumentError, match="keep must be"):
        plan_prune(PruneListing(NO_ROOT, (v(1),)), keep)  # type: ignore[arg-type]


def test_plan_prune_refuses_a_negative_grace() -> None:
    with pytest.raises(nm.InvalidArgumentError, match="grace_s"):
        plan_prune(PruneListing(NO_ROOT, ()), 1, grace_s=-1)


# plan_prune: leftovers ----------------------------------------------------------------------------
LEFTOVER_CASES = [
    # (leftover, grace_s, removed) ; bug it catches
    pytest.param(Leftover("global_step9", 10_000.0, "pid 1 on here"), 0, False,
                 id="live-writer-never-removed"),  # grace alone decides, ignoring a live writer
    pytest.param(Leftover("global_step9", 5.0), 60, False, id="within-grace-kept"),
    pytest.param(Leftover("global_step9", 60.0), 60, True, id="at-grace-removed"),
    pytest.param(Leftover("global_step9", 0.0), 0, True, id="grace-0-removes-dead-at-once"),
    pytest.param(Leftover("global_step9", None), 0, False, id="unknown-age-kept"),
]  # fmt: skip


@pytest.mark.parametrize(("leftover", "grace_s", "removed"), LEFTOVER_CASES)
def test_plan_prune_leftovers(leftover: Leftover, grace_s: float, removed: bool) -> None:
    listing = PruneListing(NO_ROOT, (v(1),), (leftover,))
    plan = plan_prune(listing, 1, grace_s=grace_s)
    assert tags(plan.incomplete) == (["global_step9"] if removed else [])
    spared = [d for d in plan.protected if not d.committed]
    assert tags(spared) == ([] if removed else ["global_step9"])
    assert all(not d.committed for d in plan.incomplete)
    assert tags(plan.delete) == [] and "global_step1" in tags(plan.protected)


# execute_prune on real roots ----------------------------------------------------------------------
def populate(root: Path, steps: tuple[int, ...] = (1, 2, 3, 4), labelled: tuple[int, ...] = ()):
    nm.init(str(root), persistent_time_interval=0, num_of_version_in_retention=100)
    for step in steps:
        labels = ["best"] if step in labelled else []
        nm.Checkpoint(f"global_step{step}", labels=labels).save("model", {"w": torch.ones(8)})
        nm.flush_persistence()
    nm.shutdown()


def persistent_tags(root: Path) -> list[str]:
    return [c.tag for c in list_committed(Store(str(root)))]


def leftover(root: Path, tag: str, host: str, pid: int) -> Path:
    """A folder as a crashed persist leaves it: a partial item and a writer marker."""
    folder = root / tag
    folder.mkdir(parents=True)
    (folder / "model").write_bytes(b"partial")
    doc = {"host": host, "pid": pid, "rank": 0, "started_at": "2026-01-01T00:00:00Z"}
    (folder / ".writer-0.json").write_text(json.dumps(doc))
    return folder


def dead_pid() -> int:
    out = warm.run([sys.executable, "-c", "import os; print(os.getpid())"],
                         capture_output=True, text=True, check=True, timeout=60)  # fmt: skip
    return int(out.stdout)


def test_execute_deletes_the_plan_and_leaves_foreign_folders(root: Path) -> None:
    populate(root)
    sentinel = root / "global_step0"  # a tag-like name, but no markers: not ours
    sentinel.mkdir()
    (sentinel / "model").write_text("user data")
    dead = leftover(root, "global_step7", socket.gethostname(), dead_pid())
    plan = nm.plan_prune(nm.list_prune_candidates(str(root), incomplete=True), 2, grace_s=0)
    assert tags(plan.delete) == ["global_step1", "global_step2"]
    assert tags(plan.incomplete) == ["global_step7"]
    result = nm.execute_prune(str(root), plan)
    assert result.deleted == ("global_step1", "global_step2", "global_step7")
    assert result.skipped == ()
    assert persistent_tags(root) == ["global_step3", "global_step4"]
    assert not (root / "global_step1").exists() and not dead.exists()
    assert (sentinel / "model").read_text() == "user data"


def test_execute_rechecks_the_newest(root: Path) -> None:
    """The newer checkpoints vanish between plan and execute (another operator pruned):
    the oldest planned tag is now the newest and must survive."""
    populate(root, steps=(1, 2, 3))
    plan = nm.plan_prune(nm.list_prune_candidates(str(root)), 1)
    assert tags(plan.delete) == ["global_step1", "global_step2"]
    store = Store(str(root))
    delete_checkpoint(store, "global_step3")
    delete_checkpoint(store, "global_step2")
    result = nm.execute_prune(str(root), plan)
    assert result.deleted == ()
    assert [(s.tag, s.reason) for s in result.skipped] == [
        ("global_step1", "it is now the newest committed"),
        ("global_step2", "no longer committed"),
    ]
    assert persistent_tags(root) == ["global_step1"]


def test_execute_rechecks_labels(root: Path) -> None:
    populate(root, steps=(1, 2))
    plan = nm.plan_prune(nm.list_prune_candidates(str(root)), 1)
    assert tags(plan.delete) == ["global_step1"]
    nm.init(str(root), persistent_time_interval=0)
    nm.Checkpoint("global_step1", overwrite=True, labels=["best"]).save("model", {"w": 1})
    nm.flush_persistence()
    nm.shutdown()
    result = nm.execute_prune(str(root), plan)
    assert result.deleted == () and tags(result.skipped) == ["global_step1"]
    assert persistent_tags(root) == ["global_step1", "global_step2"]


def test_execute_rechecks_a_leftover_whose_writer_came_alive(root: Path) -> None:
    populate(root, steps=(1,))
    folder = leftover(root, "global_step5", socket.gethostname(), dead_pid())
    plan = nm.plan_prune(nm.list_prune_candidates(str(root), incomplete=True), 1, grace_s=0)
    assert tags(plan.incomplete) == ["global_step5"]
    # A restarted job on this node takes the tag over before the prune runs.
    doc = {"host": socket.gethostname(), "pid": os.getpid(), "rank": 1, "started_at": "x"}
    (folder / ".writer-1.json").write_text(json.dumps(doc))
    result = nm.execute_prune(str(root), plan)
    assert result.deleted == ()
    assert (
        result.skipped[0].reason == f"being written by pid {os.getpid()} on {socket.gethostname()}"
    )
    assert (folder / "model").exists()


def test_leftover_age_is_the_last_activity_not_the_start(root: Path) -> None:
    """A writer on another node (unknown liveness) that started long ago but wrote a
    moment ago is still at work; one idle for longer than the grace period is not."""
    populate(root, steps=(1,))
    busy = leftover(root, "global_step5", "another-node", 1)  # started 2026-01-01, file new
    idle = leftover(root, "global_step6", "another-node", 1)
    os.utime(idle / "model", (1_700_000_000, 1_700_000_000))
    os.utime(idle / ".writer-0.json", (1_700_000_000, 1_700_000_000))
    listing = nm.list_prune_candidates(str(root), incomplete=True)
    by_tag = {lo.tag: lo for lo in listing.leftovers}
    assert by_tag["global_step5"].idle_s is not None and by_tag["global_step5"].idle_s < 600
    assert by_tag["global_step6"].live_writer is None
    plan = nm.plan_prune(listing, 1, grace_s=3600)
    assert tags(plan.incomplete) == ["global_step6"]
    nm.execute_prune(str(root), plan)
    assert busy.exists() and not idle.exists()


def test_list_prune_candidates_of_a_missing_root(tmp_path: Path) -> None:
    with pytest.raises(nm.RootNotFoundError, match="no such checkpoint root"):
        nm.list_prune_candidates(str(tmp_path / "nope"))


def test_execute_refuses_a_plan_with_an_unsafe_tag(root: Path) -> None:
    populate(root, steps=(1,))
    plan = nm.plan_prune(nm.list_prune_candidates(str(root)), 1)
    forged = dataclasses.replace(plan, delete=(PruneDecision("../etc", "forged"),))
    with pytest.raises(nm.InvalidNameError):
        nm.execute_prune(str(root), forged)
    assert persistent_tags(root) == ["global_step1"]
