"""`nebula memory` and `nebula gc`: this user's memory tiers on this node, on real tiers.

Every tier is made by the library: a job in a child process killed with SIGKILL after it
committed (its tier is left behind, unpersisted), a session of this process that is still
open (a live writer), sessions closed with keep_memory_tier=True (a persisted tier left
on purpose), and roots deleted with rm -rf (stale tiers). The children share this test's
memory-tier base through NEBULA_MEMORY_TIER_PATH (set by the autouse fixture).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
import warm
from cli_helpers import on_a_terminal
from typer.testing import CliRunner

import nebulaml as nm
from nebula_cli.app import app

EXE = Path(sys.executable).parent / "nebula"
KILLED_JOB = """
import sys, time, torch, nebulaml as nm
nm.init(sys.argv[1], persistent_time_interval=3600)
first = int(sys.argv[2])
nm.Checkpoint(f"global_step{first}").save("model", {"w": torch.ones(1000)})
nm.flush_persistence()
nm.Checkpoint(f"global_step{first + 1}").save("model", {"w": torch.ones(1000)})  # not due
print("committed", flush=True)
time.sleep(600)  # until SIGKILL: nothing runs at exit
"""
TIER_KEYS = {"path", "root", "state", "note", "tags", "newest", "persisted", "size_bytes",
             "writer_alive", "replicas", "leftovers"}  # fmt: skip
REFUSAL = (
    "to release; refusing to release without --yes when not on a terminal "
    "(add --yes, or --dry-run to see the plan only)"
)


def nebula(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(app, list(args))
    return result.exit_code, result.stdout, result.stderr


def tiers() -> dict[str, dict]:
    """`nebula memory --json`'s tiers by root (or by path, for one without a root)."""
    code, out, err = nebula("memory", "--json")
    assert code == 0, err
    return {t["root"] or t["path"]: t for t in json.loads(out)["tiers"]}


def tree(folder: Path) -> dict[str, tuple[int, int]]:
    """Every file and folder under `folder` with its size and mtime: any change shows."""
    return {
        str(p.relative_to(folder)): (p.lstat().st_size, p.lstat().st_mtime_ns)
        for p in sorted(folder.rglob("*"))
    }


def kept_tier(root: Path, step: int = 1) -> None:
    """A finished job's tier, left on purpose: global_step{step} persisted."""
    nm.init(str(root), persistent_time_interval=0, keep_memory_tier=True)
    nm.Checkpoint(f"global_step{step}").save("model", {"w": torch.ones(64)})
    nm.flush_persistence()
    nm.shutdown()


@pytest.fixture
def killed_job(memory_tier: Path) -> Iterator[Callable[..., subprocess.Popen[str]]]:
    """Start a job on a root that commits global_step1 (persisted) and global_step2 (in
    memory only; or from global_step`first`) and then waits; the test kills it. Every
    child is reaped."""
    started: list[subprocess.Popen[str]] = []

    def start(root: Path, first: int = 1) -> subprocess.Popen[str]:
        env = dict(os.environ, NEBULA_MEMORY_TIER_PATH=str(memory_tier))
        cmd = [sys.executable, "-c", KILLED_JOB, str(root), str(first)]
        proc = warm.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True)
        started.append(proc)
        assert proc.stdout is not None and proc.stdout.readline() == "committed\n"
        return proc

    yield start
    for proc in started:
        proc.kill()
        proc.wait(timeout=60)


def kill(proc: subprocess.Popen[str]) -> None:
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=60) == -signal.SIGKILL


def row(out: str, *cells: str) -> str:
    """The one table row (a line, off a terminal: plain text) that starts with the first
    cell and holds every other, whole."""
    rows = [line for line in out.splitlines() if line.startswith(cells[0] + " ")]
    lines = [line for line in rows if all(c in line for c in cells)]
    assert len(lines) == 1, out
    return lines[0]


def test_a_killed_job_leaves_its_tier_unpersisted(root: Path, killed_job: Callable) -> None:
    # catches: a dead job shown as alive (or a live one as dead), the wrong newest tag, an
    # unpersisted checkpoint shown as persisted, a tier shown without its root
    job = killed_job(root)
    live = tiers()[str(root)]
    assert live["writer_alive"] is True  # another process holds it: its flock is seen
    kill(job)
    tier = tiers()[str(root)]
    assert set(tier) == TIER_KEYS
    assert tier["state"] == "ok" and tier["root"] == str(root)
    assert tier["newest"] == "global_step2" and "global_step2" in tier["tags"]
    assert tier["persisted"] is False and tier["writer_alive"] is False
    assert tier["path"] == nm.memory_tier_path(str(root)) and Path(tier["path"]).is_dir()
    assert tier["size_bytes"] > 4000  # the 1000 floats of global_step2 at least
    code, out, err = nebula("memory")
    assert code == 0 and err == ""
    line = row(out, str(root))
    assert re.search(r" ok +global_step2 +no +[\d.]+ \w+ +- +/", line), line
    assert tier["path"] in line  # whole, on the same line (off a terminal: full width)


def test_a_persisted_tier_of_a_finished_job(root: Path) -> None:
    # catches: a persisted checkpoint shown as unpersisted, or a closed session as alive
    kept_tier(root, step=3)
    tier = tiers()[str(root)]
    assert (tier["state"], tier["newest"], tier["persisted"], tier["writer_alive"]) == (
        "ok", "global_step3", True, False,
    )  # fmt: skip
    line = row(nebula("memory")[1], str(root))
    assert re.search(r" ok +global_step3 +yes +", line), line


def test_a_live_session_is_shown_alive_and_kept(root: Path) -> None:
    # catches: gc releasing a tier under a live writer, even when told to discard
    nm.init(str(root), persistent_time_interval=3600)
    nm.Checkpoint("global_step1").save("model", {"w": torch.ones(64)})
    tier = tiers()[str(root)]
    assert tier["writer_alive"] is True and tier["persisted"] is False
    assert "alive" in row(nebula("memory")[1], str(root))
    for args in (("--yes",), ("--yes", "--discard-unpersisted")):
        code, out, err = nebula("gc", *args, "--json")
        assert code == 0, err
        doc = json.loads(out)
        (action,) = doc["plan"]
        assert (action["release"], action["reason"]) == (False, "a live job holds it")
        assert doc["results"] == []
    assert Path(tier["path"], "global_step1").is_dir()
    assert nm.get_latest_checkpoint().load("model")["w"].sum() == 64


def test_a_deleted_root_makes_its_tier_stale_and_gc_releases_it(
    tmp_path: Path, memory_tier: Path
) -> None:
    # catches: a tier of a root that is gone shown as ok, or kept by gc, or a stale tier's
    # release taking another tier with it
    gone, other = tmp_path / "gone", tmp_path / "other"
    kept_tier(gone)
    nm.init(str(other), persistent_time_interval=3600)  # a live neighbour, unpersisted
    nm.Checkpoint("global_step7").save("model", {"w": torch.ones(64)})
    shutil.rmtree(gone)
    stale = tiers()[str(gone)]
    assert stale["state"] == "stale" and stale["note"] == f"its root {gone} is gone"
    code, out, _ = nebula("memory")
    assert code == 0 and re.search(r" stale +global_step1 +", row(out, str(gone)))
    assert f"stale {stale['path']}: its root {gone} is gone" in out.splitlines()
    code, out, err = nebula("gc", "--yes")
    assert code == 0, err
    assert "Released 1 of 1 memory tier(s)" in out
    assert f"  {gone}: global_step1 (" in out.splitlines()[-1]
    assert not os.path.lexists(stale["path"])
    assert list(tiers()) == [str(other)]
    assert nm.get_latest_checkpoint().tag == "global_step7"


def test_an_unpersisted_tier_of_a_dead_job_needs_flush_or_discard(
    root: Path, killed_job: Callable
) -> None:
    # catches: gc discarding a dead job's only copy of its newest checkpoint unasked, a
    # reason that does not say how to keep it, or --discard-unpersisted not releasing it
    kill(killed_job(root))
    path = Path(nm.memory_tier_path(str(root)))
    before = tree(path)
    code, out, err = nebula("gc", "--yes")
    assert (code, err) == (0, "Nothing to release.\n")
    reason = (
        f"global_step2 is not persisted: run `nebula flush {root}` first, or --discard-unpersisted"
    )
    assert reason in row(out, str(root), "keep")
    assert tree(path) == before
    code, out, err = nebula("gc", "--yes", "--discard-unpersisted", "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["plan"][0]["release"] is True
    assert doc["plan"][0]["reason"].endswith("discarded (--discard-unpersisted)")
    (result,) = doc["results"]
    assert result["released"] is True and result["path"] == str(path)
    assert "global_step2" in result["tags"] and result["size_bytes"] > 4000
    assert not path.exists() and tiers() == {}
    assert [c["tag"] for c in nm.list_checkpoints(str(root))] == ["global_step1"]


def test_after_flush_gc_releases_it_without_discarding(root: Path, killed_job: Callable) -> None:
    # catches: a tier still judged unpersisted after nebula flush persisted it
    kill(killed_job(root))
    assert nebula("flush", str(root))[0] == 0
    assert tiers()[str(root)]["persisted"] is True
    code, out, err = nebula("gc", "--yes", "--json")
    assert code == 0, err
    assert [r["released"] for r in json.loads(out)["results"]] == [True]
    assert tiers() == {}
    assert nm.get_checkpoint("global_step2", str(root)).load("model")["w"].sum() == 1000


def test_a_copy_into_the_memory_tier_names_its_root_and_gc_releases_it(root: Path) -> None:
    # main: the tier `nebula copy ROOT TAG memory` made was "orphaned", root unknown ("a job
    # that died at its start"), and gc kept it unless --discard-unpersisted, though the
    # checkpoint was on the root all along.
    nm.init(str(root), persistent_time_interval=0)
    nm.Checkpoint("global_step1").save("model", {"w": torch.ones(64)})
    nm.flush_persistence()
    nm.shutdown()  # a clean exit: its memory tier released
    assert tiers() == {}
    code, _out, err = nebula("copy", str(root), "global_step1", "memory")
    assert code == 0, err
    tier = tiers()[str(root)]
    assert (tier["state"], tier["note"], tier["root"]) == ("ok", None, str(root))
    assert (tier["newest"], tier["persisted"], tier["writer_alive"]) == (
        "global_step1",
        True,
        False,
    )
    assert Path(tier["path"]).stat().st_mode & 0o777 == 0o700
    code, out, err = nebula("gc", "--yes", "--json")
    assert code == 0, err
    assert [r["released"] for r in json.loads(out)["results"]] == [True]
    assert tiers() == {}
    assert nm.get_checkpoint("global_step1", str(root)).load("model")["w"].sum() == 64


def test_dry_run_releases_nothing(tmp_path: Path, memory_tier: Path) -> None:
    # catches: --dry-run releasing (or touching) anything
    kept_tier(tmp_path / "a")
    kept_tier(tmp_path / "b")
    shutil.rmtree(tmp_path / "b")
    before = tree(memory_tier)
    code, out, err = nebula("gc", "--dry-run", "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["dry_run"] is True and doc["results"] == []
    assert [a["release"] for a in doc["plan"]] == [True, True]
    assert {a["state"] for a in doc["plan"]} == {"ok", "stale"}
    code, out, err = nebula("gc", "--dry-run")  # the plan, without --yes
    assert code == 0 and err == "Dry run: nothing released.\n"
    assert "(dry run)" in out and "release" in row(out, str(tmp_path / "a"))
    assert tree(memory_tier) == before


@pytest.mark.parametrize("as_json", [False, True], ids=["table", "json"])
def test_refuses_without_yes_off_a_terminal(
    tmp_path: Path, memory_tier: Path, as_json: bool
) -> None:
    # catches: releasing without confirmation when stdin is not a terminal (CliRunner's isn't)
    kept_tier(tmp_path / "a")
    before = tree(memory_tier)
    code, out, err = nebula("gc", *(["--json"] if as_json else []))
    assert code == 1  # as nebula prune
    (line,) = err.splitlines()
    assert line.startswith(f"nebula: error: {memory_tier}: 1 memory tier(s) (")
    assert line.endswith(REFUSAL)
    assert tree(memory_tier) == before
    if as_json:  # no plan for a gc that did not happen: the error object
        assert json.loads(out)["error"]["kind"] == "error" and REFUSAL in out
    else:
        assert "global_step1" in row(out, str(tmp_path / "a"))  # the plan, shown first


def test_json_documents(tmp_path: Path, memory_tier: Path) -> None:
    # catches: documents that do not parse, or lack the base or a tier's fields
    kept_tier(tmp_path / "a")
    code, out, err = nebula("memory", "--json")
    assert code == 0 and err == ""
    doc = json.loads(out)
    assert set(doc) == {"base", "tiers"} and doc["base"] == str(memory_tier)
    (tier,) = doc["tiers"]
    assert set(tier) == TIER_KEYS and tier["tags"] == ["global_step1"]
    assert tier["size_bytes"] == sum(f.stat().st_size for f in Path(tier["path"]).rglob("*")
                                     if f.is_file())  # fmt: skip
    code, out, err = nebula("gc", "--yes", "--json")
    assert code == 0 and err == ""
    doc = json.loads(out)
    assert set(doc) == {"base", "dry_run", "discard_unpersisted", "plan", "results"}
    assert (doc["base"], doc["dry_run"], doc["discard_unpersisted"]) == (str(memory_tier),
                                                                         False, False)  # fmt: skip
    (action,) = doc["plan"]
    assert set(action) == TIER_KEYS | {"release", "reason"}
    assert doc["results"] == [{"path": tier["path"], "released": True, "tags": ["global_step1"],
                               "size_bytes": tier["size_bytes"], "reason": None}]  # fmt: skip


def test_a_clean_exit_leaves_nothing_to_list(root: Path, memory_tier: Path) -> None:
    # catches: a session that does not give its tier back after persisting everything
    nm.init(str(root))
    nm.Checkpoint("global_step1").save("model", {"w": torch.ones(64)})
    nm.shutdown()
    assert [c["tiers"] for c in nm.list_checkpoints(str(root))] == [["persistent"]]
    code, out, err = nebula("memory")
    assert (code, out, err) == (0, "", f"No memory tiers under {memory_tier}\n")
    assert json.loads(nebula("memory", "--json")[1]) == {"base": str(memory_tier), "tiers": []}
    code, out, err = nebula("gc")
    assert (code, out, err) == (0, "", f"No memory tiers under {memory_tier}\n")


def test_a_link_where_a_tier_goes_is_unsafe_and_never_followed(
    tmp_path: Path, memory_tier: Path
) -> None:
    # catches: a symbolic link in the base left unlisted, or gc deleting through it
    kept_tier(tmp_path / "a")
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / "precious").write_text("not nebula's")
    (memory_tier / "run-0123456789ab").symlink_to(target)
    tier = tiers()[str(memory_tier / "run-0123456789ab")]
    assert tier["state"] == "unsafe" and "symbolic link" in tier["note"]
    code, out, err = nebula("gc", "--yes", "--discard-unpersisted", "--json")
    assert code == 0, err
    assert [(a["state"], a["release"]) for a in json.loads(out)["plan"]] == [
        ("ok", True), ("unsafe", False),
    ]  # fmt: skip
    assert (target / "precious").read_text() == "not nebula's"
    assert (memory_tier / "run-0123456789ab").is_symlink()


@pytest.mark.slow
def test_a_tier_that_changed_after_the_plan_is_kept(root: Path, killed_job: Callable) -> None:
    # catches: releasing on a plan made before a job wrote to the tier (the plan may be
    # minutes old after the prompt): here a newer, unpersisted checkpoint would be lost
    kept_tier(root)
    plan = nm.plan_gc(nm.list_memory_tiers())
    assert [a.release for a in plan] == [True]
    kill(killed_job(root, 2))  # global_step2 persisted, global_step3 in memory only
    (result,) = nm.execute_gc(plan)
    assert result.released is False and result.reason == (
        "its checkpoints changed since the plan; not released"
    )
    assert Path(nm.memory_tier_path(str(root)), "global_step3").is_dir()
    plan = nm.plan_gc(nm.list_memory_tiers(), discard_unpersisted=True)
    assert [a.release for a in plan] == [True]
    nm.init(str(root), persistent_time_interval=3600)  # a job that took hold of it since
    (result,) = nm.execute_gc(plan)
    assert (result.released, result.reason) == (
        False, "a live job took hold of it since the plan; not released",
    )  # fmt: skip
    assert nm.get_checkpoint("global_step3").load("model")["w"].sum() == 1000


def test_readable_at_80_columns(tmp_path: Path, memory_tier: Path) -> None:
    # catches: a root, tag or path cut with "…" or folded over lines to fit a narrow
    # terminal (too wide for any table, each tier is a record: its root on a line, the
    # other cells below it, each whole), or table lines wider than the terminal
    root = tmp_path / "a-checkpoint-root-with-a-rather-long-name-for-the-terminal"
    kept_tier(root, step=123456)
    path = nm.memory_tier_path(str(root))
    for args in (["memory"], ["gc", "--dry-run"]):
        run = on_a_terminal(args, memory_tier)
        assert run.code == 0, run.stdout
        out = run.stdout
        lines = out.splitlines()
        assert "…" not in out and str(root) in lines, out  # the root alone on its line
        assert any("global_step123456" in line for line in lines), out
        if args == ["memory"]:
            assert any(line.strip() == f"path: {path}" for line in lines), out  # whole
        short = [line for line in lines if str(root) not in line and str(memory_tier) not in line]
        assert max(len(line) for line in short) <= 80, out
