"""`nebula prune`: plan, show, confirm, execute on real roots written by the library."""

from __future__ import annotations

import json
import os
import pty
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import warm
from typer.testing import CliRunner

import nebulaml as nm
from nebula_cli.app import app

EXE = Path(sys.executable).parent / "nebula"


def populate(root: Path, steps: int = 4, labelled: tuple[int, ...] = ()) -> None:
    """global_step1..steps committed on the persistent root, then the session closed."""
    nm.init(str(root), persistent_time_interval=0, num_of_version_in_retention=100)
    for step in range(1, steps + 1):
        labels = ["best"] if step in labelled else []
        nm.Checkpoint(f"global_step{step}", labels=labels).save("model", {"w": torch.ones(64)})
        nm.flush_persistence()
    nm.shutdown()


def persisted(root: Path) -> list[str]:
    """Tags committed on the root itself, oldest first."""
    return [
        c["tag"]
        for c in reversed(nm.list_checkpoints(str(root), hold=False))
        if "persistent" in c["tiers"]
    ]


def tree(folder: Path) -> dict[str, tuple[int, int]]:
    """Every file under `folder` with its size and mtime: any change shows."""
    return {
        str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def leftover(root: Path, tag: str, pid: int, host: str | None = None) -> Path:
    """A crashed persist's folder: a partial item and a writer marker."""
    folder = root / tag
    folder.mkdir()
    (folder / "model").write_bytes(b"partial")
    doc = {"host": host or socket.gethostname(), "pid": pid, "rank": 0, "started_at": "x"}
    (folder / ".writer-0.json").write_text(json.dumps(doc))
    return folder


def dead_pid() -> int:
    out = warm.run([sys.executable, "-c", "import os; print(os.getpid())"],
                         capture_output=True, text=True, check=True, timeout=60)  # fmt: skip
    return int(out.stdout)


def prune(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(app, ["prune", *args])
    return result.exit_code, result.stdout, result.stderr


def test_newest_survives_keep_1_with_include_labelled(root: Path) -> None:
    # catches: the newest deleted when it is labelled and labelled ones are included
    populate(root, labelled=(2, 4))
    code, out, err = prune(str(root), "--keep", "1", "--include-labelled", "--yes", "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["deleted"] == ["global_step1", "global_step2", "global_step3"]
    newest = {"tag": "global_step4", "reason": "the newest committed checkpoint", "committed": True}
    assert newest in doc["protected"] and newest not in doc["kept"]
    assert persisted(root) == ["global_step4"]
    assert nm.get_checkpoint("global_step4", str(root)).load("model")["w"].sum() == 64


def test_labelled_kept_unless_included(root: Path) -> None:
    # catches: labelled checkpoints deleted by count, or counted towards --keep
    populate(root, labelled=(2,))
    code, out, _ = prune(str(root), "--keep", "2", "--yes", "--json")
    assert code == 0 and json.loads(out)["deleted"] == ["global_step1"]
    assert persisted(root) == ["global_step2", "global_step3", "global_step4"]
    code, out, _ = prune(str(root), "--keep", "2", "--yes", "--json", "--include-labelled")
    assert code == 0 and json.loads(out)["deleted"] == ["global_step2"]
    assert persisted(root) == ["global_step3", "global_step4"]


def test_live_writers_leftover_never_removed(root: Path) -> None:
    # catches: --grace 0 removing a tag that a live process on this host is writing
    populate(root, steps=1)
    live = leftover(root, "global_step8", os.getpid())
    dead = leftover(root, "global_step9", dead_pid())
    code, out, err = prune(str(root), "--keep", "1", "--yes", "--json")
    assert code == 0, err
    assert dead.exists() and json.loads(out)["incomplete"] == []  # only with --incomplete
    args = ("--keep", "1", "--incomplete", "--grace", "0", "--yes", "--json")
    code, out, err = prune(str(root), *args)
    assert code == 0, err
    doc = json.loads(out)
    assert doc["deleted"] == ["global_step9"] and not dead.exists()
    assert live.exists() and (live / "model").read_bytes() == b"partial"
    reason = f"being written by pid {os.getpid()} on {socket.gethostname()}"
    assert {"tag": "global_step8", "reason": reason, "committed": False} in doc["protected"]


def test_incomplete_waits_for_the_grace_period(root: Path) -> None:
    # catches: a dead writer's leftover removed while it was written a moment ago
    populate(root, steps=1)
    folder = leftover(root, "global_step9", 1, host="another-node")  # liveness unknown
    code, out, _ = prune(str(root), "--keep", "1", "--incomplete", "--yes", "--json")
    assert code == 0 and json.loads(out)["deleted"] == [] and folder.exists()
    assert "grace period 3600 s" in json.loads(out)["protected"][-1]["reason"]


def test_dry_run_deletes_nothing(root: Path, memory_tier: Path) -> None:
    populate(root, steps=4)
    leftover(root, "global_step9", dead_pid())
    before = tree(root), tree(memory_tier)
    args = ("--keep", "1", "--incomplete", "--grace", "0", "--dry-run", "--json")
    code, out, err = prune(str(root), *args)
    assert code == 0, err
    doc = json.loads(out)
    assert doc["dry_run"] is True and doc["deleted"] == []
    assert [d["tag"] for d in doc["delete"]] == ["global_step1", "global_step2", "global_step3"]
    assert [d["tag"] for d in doc["incomplete"]] == ["global_step9"]
    assert (tree(root), tree(memory_tier)) == before
    code, out, err = prune(str(root), "--keep", "1", "--dry-run")  # the table, no --yes needed
    assert code == 0 and "global_step1" in out and "delete" in out
    assert err.strip() == "Dry run: nothing deleted."
    assert (tree(root), tree(memory_tier)) == before


@pytest.mark.parametrize("as_json", [False, True], ids=["table", "json"])
def test_refuses_without_yes_off_a_terminal(root: Path, as_json: bool) -> None:
    # catches: deleting without confirmation when stdin is not a terminal (CliRunner's isn't)
    populate(root, steps=3)
    before = tree(root)
    code, out, err = prune(str(root), "--keep", "1", *(["--json"] if as_json else []))
    assert code == 1
    assert err.splitlines() == [
        f"nebula: error: {root}: 2 checkpoint(s) to delete; refusing to delete without --yes "
        f"when not on a terminal (add --yes, or --dry-run to see the plan only)"
    ]
    assert tree(root) == before
    if as_json:  # no plan for a prune that did not happen: the error object
        assert json.loads(out)["error"]["message"] == err.splitlines()[0].removeprefix(
            "nebula: error: "
        )
    else:
        assert "global_step1" in out  # the plan was shown before asking


def test_nothing_to_delete_needs_no_yes(root: Path) -> None:
    populate(root, steps=2)
    code, out, err = prune(str(root), "--keep", "2")
    assert code == 0 and err.strip() == "Nothing to delete."
    assert "global_step2" in out and "protected" in out
    assert persisted(root) == ["global_step1", "global_step2"]


def test_folders_without_markers_never_touched(root: Path) -> None:
    # catches: treating any folder under ROOT (or a tag-like one) as a prunable leftover
    populate(root, steps=2)
    sentinel = root / "notes"
    sentinel.mkdir()
    (sentinel / "README").write_text("keep me")
    tag_like = root / "global_step0"
    tag_like.mkdir()
    (tag_like / "model").write_text("a user's own file")
    args = ("--keep", "1", "--incomplete", "--grace", "0", "--include-labelled", "--yes")
    code, _, err = prune(str(root), *args, "--json")
    assert code == 0, err
    assert (sentinel / "README").read_text() == "keep me"
    assert (tag_like / "model").read_text() == "a user's own file"
    assert persisted(root) == ["global_step2"]


def test_acts_on_root_not_on_its_memory_tier(root: Path, memory_tier: Path) -> None:
    # catches: taking the memory tier's newer checkpoint as the newest and deleting ROOT's
    nm.init(str(root), persistent_time_interval=3600, num_of_version_in_retention=100)
    for step in (1, 2):
        nm.Checkpoint(f"global_step{step}").save("model", {"w": torch.ones(4)})
        nm.flush_persistence()
    nm.Checkpoint("global_step3").save("model", {"w": torch.ones(4)})  # memory tier only
    nm.list_checkpoints()  # the job's listing: after its commit's eviction (its own thread)
    memory_before = tree(memory_tier)
    code, out, err = prune(str(root), "--keep", "1", "--yes", "--json")
    assert code == 0, err
    assert json.loads(out)["deleted"] == ["global_step1"]
    assert persisted(root) == ["global_step2"]
    assert tree(memory_tier) == memory_before


@pytest.mark.parametrize(
    "args",
    [("--keep", "0"), ("--keep", "-1"), (), ("--keep", "1", "--grace", "-5"), ("--keep", "x")],
    ids=["keep-0", "keep-negative", "keep-missing", "grace-negative", "keep-not-a-number"],
)
def test_usage_errors(root: Path, args: tuple[str, ...]) -> None:
    populate(root, steps=2)
    before = tree(root)
    code, out, err = prune(str(root), *args, "--yes")
    assert code == 2 and out == ""
    assert "--keep" in err or "--grace" in err
    assert tree(root) == before


def test_missing_root_is_not_found(tmp_path: Path) -> None:
    code, out, err = prune(str(tmp_path / "nope"), "--keep", "1")
    assert code == 3 and out == ""
    assert err.strip() == f"nebula: error: {tmp_path / 'nope'}: no such checkpoint root"


def _env(memory_tier: Path) -> dict[str, str]:
    return dict(os.environ, NEBULA_MEMORY_TIER_PATH=str(memory_tier), COLUMNS="150")


def test_as_a_real_command(root: Path, memory_tier: Path) -> None:
    populate(root, steps=3)
    out = warm.run([EXE, "prune", str(root), "--keep", "2", "--yes"], capture_output=True,
                         text=True, env=_env(memory_tier), timeout=60)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stderr == ""
    assert "older than the 2 newest" in out.stdout and "Deleted 1 of 1: global_step1" in out.stdout
    assert persisted(root) == ["global_step2", "global_step3"]


@pytest.mark.parametrize(("answer", "code"), [("y", 0), ("n", 4)])
def test_asks_on_a_terminal(root: Path, memory_tier: Path, answer: str, code: int) -> None:
    # catches: no prompt on a terminal, or a prompt whose answer is ignored
    populate(root, steps=2)
    master, slave = pty.openpty()
    try:
        proc = warm.Popen([EXE, "prune", str(root), "--keep", "1", "--json"], stdin=slave,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=_env(memory_tier))  # fmt: skip
        os.close(slave)
        os.write(master, f"{answer}\n".encode())  # the terminal holds the line until asked
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        os.close(master)
    assert proc.returncode == code, stderr
    assert f"Delete 1 checkpoint(s) from {root}? [y/N]" in stderr
    if answer == "y":
        assert json.loads(stdout)["deleted"] == ["global_step1"]
        assert persisted(root) == ["global_step2"]
    else:  # declined: its own exit status, and --json's error object of kind "declined"
        error = {"kind": "declined", "exit_code": 4, "message": "Nothing deleted.",
                 "exception": None}  # fmt: skip
        assert json.loads(stdout)["error"] == error
        assert "Nothing deleted." in stderr and "error" not in stderr
        assert persisted(root) == ["global_step1", "global_step2"]


def _read_until(fd: int, text: str, timeout_s: float = 60) -> str:
    """What the pipe `fd` says until `text` appears in it (or it ends, or time runs out)."""
    got, deadline = b"", time.monotonic() + timeout_s
    while text.encode() not in got and time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        chunk = os.read(fd, 4096) if ready else b""
        if not chunk:
            break
        got += chunk
    return got.decode()


@pytest.mark.parametrize(("key", "code", "last"), [
    (signal.SIGINT, 130, "nebula: interrupted"),  # Ctrl-C
    (None, 4, "Nothing deleted."),  # Ctrl-D: the end of the input, a "no"
])  # fmt: skip
def test_ctrl_c_at_the_prompt_is_an_interruption(
    root: Path, memory_tier: Path, key: signal.Signals | None, code: int, last: str
) -> None:
    # Catches: Ctrl-C at `[y/N]` turned into "nebula: error: aborted" and exit 1, not the
    # 130 every other Ctrl-C gives (the README's exit codes); the line left on the
    # prompt's line.
    populate(root, steps=2)
    master, slave = pty.openpty()
    try:
        proc = warm.Popen([EXE, "prune", str(root), "--keep", "1"], stdin=slave,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                env=_env(memory_tier))  # fmt: skip
        os.close(slave)
        assert proc.stderr is not None
        asked = _read_until(proc.stderr.fileno(), "[y/N]")
        assert "[y/N]" in asked, asked
        if key is None:
            os.write(master, b"\x04")  # the terminal's end of input, as Ctrl-D sends it
        else:
            proc.send_signal(key)  # what the terminal sends the foreground job on Ctrl-C
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        os.close(master)
    assert proc.returncode == code, stderr
    assert (asked + stderr.decode()).splitlines()[-1] == last
    assert "error" not in stderr.decode() and b"Deleted" not in stdout
    assert persisted(root) == ["global_step1", "global_step2"]
