"""Exit codes a script can trust: a command that did not do what it was asked exits
non-zero (prune and gc whose every delete or release was refused, flush of a memory tier
it will not persist), and with --json every failure still prints one JSON document, an
error object, on stdout. A declined prompt (4) is answered on a real terminal in
test_prune.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from cli_helpers import in_a_pipe

import nebulaml as nm
from nebulaml.protocol.leases import read_lease
from nebulaml.storage.store import Store


def _saved(root: Path, steps: tuple[int, ...], **options: object) -> None:
    nm.init(str(root), persistent_time_interval=0, num_of_version_in_retention=10, **options)
    for step in steps:
        nm.Checkpoint(f"global_step{step}").save("model", {"w": torch.full((64,), float(step))})
        nm.flush_persistence()
    nm.shutdown()


@pytest.mark.parametrize("as_json", [False, True], ids=["table", "json"])
def test_prune_that_deleted_nothing_exits_1(root: Path, as_json: bool) -> None:
    # main: "Deleted 0 of 2: " and exit 0 when every delete was refused (the checkpoints
    # were being read): a cron cleanup failed silently.
    _saved(root, (1, 2, 3))
    store = Store(str(root))
    with read_lease(store, "global_step1"), read_lease(store, "global_step2"):
        run = in_a_pipe("prune", str(root), "--keep", "1", "--yes", *(["--json"] * as_json))
    assert run.code == 1, run.stderr
    assert run.stderr.splitlines()[-1] == (
        "nebula: error: 2 of 2 checkpoint(s) not deleted (each kept as said above)"
    )
    assert as_json or run.stdout.splitlines()[-1] == "Deleted 0 of 2."
    assert sorted(p.name for p in root.glob("global_step*")) == [
        "global_step1", "global_step2", "global_step3",
    ]  # fmt: skip
    if as_json:
        doc = json.loads(run.stdout)  # the one document: what was done and what was not
        assert doc["deleted"] == [] and [s["tag"] for s in doc["skipped"]] == [
            "global_step1", "global_step2",
        ]  # fmt: skip
    # A partial prune is not done either; what it could delete, it did.
    with read_lease(store, "global_step1"):
        run = in_a_pipe("prune", str(root), "--keep", "1", "--yes")
    assert run.code == 1 and "Deleted 1 of 2: global_step2" in run.stdout
    assert "1 of 2 checkpoint(s) not deleted" in run.stderr


def test_gc_that_released_nothing_exits_1(root: Path) -> None:
    _saved(root, (1,), keep_memory_tier=True)
    memory = Store(nm.memory_tier_path(str(root)), durable=False, private=True)
    with read_lease(memory, "global_step1"):
        run = in_a_pipe("gc", "--yes")
    assert run.code == 1, run.stderr
    assert run.stderr.splitlines()[-1] == (
        "nebula: error: 1 of 1 memory tier(s) not released (each kept as said above)"
    )
    with read_lease(memory, "global_step1"):
        as_json = in_a_pipe("gc", "--yes", "--json")
    assert as_json.code == 1 and json.loads(as_json.stdout)["results"][0]["released"] is False
    assert in_a_pipe("gc", "--yes").code == 0  # read no more: released


def test_flush_of_a_memory_tier_it_will_not_persist_exits_1(root: Path) -> None:
    # main: "Nothing to flush" and exit 0 while the node's memory tier held a checkpoint
    # of the root's earlier life (the root deleted and made again): nothing persisted.
    _saved(root, (1,), keep_memory_tier=True)
    shutil.rmtree(root)
    root.mkdir()  # the root made again (an empty folder): its memory tier is stale
    run = in_a_pipe("flush", str(root))
    assert run.code == 1 and run.stdout == ""
    error = run.stderr.splitlines()[-1]
    assert error.startswith(f"nebula: error: {nm.memory_tier_path(str(root))}: ")
    assert "not flushed" in error and "nebula gc" in error
    assert not (root / "global_step1").exists()


@pytest.mark.parametrize(
    ("args", "code", "kind", "message"),
    [
        (["ls", "{root}/nope"], 3, "not_found", "{root}/nope: no such checkpoint root"),
        (["inspect", "{root}", "global_step40"], 3, "not_found", "did you mean 'global_step4'"),
        (["inspect", "{root}", "../x"], 2, "usage", "tag"),
        (["prune", "{root}", "--keep", "0"], 2, "usage", "must be at least 1"),
        (["prune", "{root}", "--keep", "1"], 1, "error", "refusing to delete without --yes"),
        (["copy", "{root}", "global_step4", "{root}/nope/../../x"], 1, "error", ""),
    ],
    ids=["missing-root", "missing-tag", "bad-tag", "usage", "refused", "copy-failed"],
)
def test_json_errors_are_one_json_object_on_stdout(
    root: Path, args: list[str], code: int, kind: str, message: str
) -> None:
    # main: --json errors left stdout empty (a script parsing it got nothing to parse).
    _saved(root, (3, 4))
    argv = [a.format(root=root) for a in args]
    if kind == "error" and argv[0] == "copy":
        (root.parent / "x").write_text("a file where the destination root would be")
        argv[-1] = str(root.parent / "x")
    run = in_a_pipe(*argv, "--json")
    assert run.code == code, run.stderr
    error = json.loads(run.stdout)["error"]
    assert error["exit_code"] == code and error["kind"] == kind
    assert message.format(root=root) in error["message"]
    assert run.stderr.splitlines()[-1] == f"nebula: error: {error['message']}" or kind == "usage"
