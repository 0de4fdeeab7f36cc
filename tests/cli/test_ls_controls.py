"""The listing controls of gh and kubectl: `nebula ls --sort/--limit/--since/--label/-q`,
`nebula latest --label`, and NEBULA_PERSISTENT_STORAGE_PATH as every command's ROOT when
it is left out. On a root of real checkpoints: four tags of different sizes, one labelled
`best`, another `best` and `eval`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from cli_helpers import in_a_pipe

import nebulaml as nm

# tag: (floats in the model, labels)
CHECKPOINTS = {
    "global_step100": (4000, ["best"]),
    "global_step200": (100, []),
    "global_step300": (9000, ["best", "eval"]),
    "global_step400": (10, []),
}


@pytest.fixture
def listed(root: Path) -> list[dict]:
    nm.init(str(root), persistent_time_interval=0, num_of_version_in_retention=10)
    for tag, (floats, labels) in CHECKPOINTS.items():
        nm.Checkpoint(tag, labels=labels).save("model", {"w": torch.ones(floats)})
        nm.flush_persistence()
    nm.shutdown()
    return nm.list_checkpoints(str(root))


def _tags(*args: str, **env: str) -> list[str]:
    run = in_a_pipe("ls", *args, "--json", **env)
    assert run.code == 0, run.stderr
    return [c["tag"] for c in json.loads(run.stdout)["checkpoints"]]


def test_sort_and_limit(root: Path, listed: list[dict]) -> None:
    # main: no --sort or --limit (a root of 10,000 checkpoints listed whole, newest first)
    r = str(root)
    assert _tags(r) == ["global_step400", "global_step300", "global_step200", "global_step100"]
    assert _tags(r, "--sort", "oldest") == _tags(r)[::-1]
    assert _tags(r, "--sort", "size") == [
        "global_step300", "global_step100", "global_step200", "global_step400",
    ]  # fmt: skip
    assert _tags(r, "--sort", "tag", "--limit", "2") == ["global_step100", "global_step200"]
    assert _tags(r, "--limit", "1") == ["global_step400"]
    committed = sorted(listed, key=lambda c: c["committed_at"], reverse=True)
    assert _tags(r, "--sort", "committed") == [c["tag"] for c in committed]
    bad = in_a_pipe("ls", r, "--sort", "biggest")
    assert bad.code == 2 and "--sort" in bad.stderr and "newest" in bad.stderr
    zero = in_a_pipe("ls", r, "--limit", "0")
    assert zero.code == 2 and "must be at least 1, not 0" in zero.stderr


def test_since_and_label(root: Path, listed: list[dict]) -> None:
    r = str(root)
    at_200 = next(c["committed_at"] for c in listed if c["tag"] == "global_step200")
    assert _tags(r, "--since", at_200) == ["global_step400", "global_step300", "global_step200"]
    assert _tags(r, "--since", "1h") == _tags(r)  # all committed within the hour
    assert _tags(r, "--since", "2999-01-01T00:00:00Z") == []
    assert _tags(r, "--label", "best") == ["global_step300", "global_step100"]
    assert _tags(r, "--label", "best", "--label", "eval") == ["global_step300"]  # each one
    assert _tags(r, "--label", "nope") == []
    assert in_a_pipe("ls", r, "--since", "yesterday").code == 2


def test_quiet_prints_tags_only(root: Path, listed: list[dict]) -> None:
    # For `for tag in $(nebula ls ROOT -q)`: one tag a line, nothing else on stdout.
    run = in_a_pipe("ls", str(root), "-q", "--label", "best", "--sort", "oldest")
    assert run.code == 0 and run.stderr == ""
    assert run.stdout == "global_step100\nglobal_step300\n"
    empty = in_a_pipe("ls", str(root), "-q", "--label", "nope")
    assert (empty.code, empty.stdout, empty.stderr) == (0, "", "")
    both = in_a_pipe("ls", str(root), "-q", "--json")
    assert both.code == 2 and "-q" in both.stderr


def test_latest_label(root: Path, listed: list[dict]) -> None:
    # main: `nebula latest` knew only the newest; the best model is what one deploys.
    r = str(root)
    assert in_a_pipe("latest", r, "--label", "best").stdout == "global_step300\n"
    run = in_a_pipe("latest", r, "--label", "best", "--item", "model")
    assert run.code == 0 and run.stdout == f"{root}/global_step300/model\n"
    assert torch.load(run.stdout.strip(), weights_only=True)["w"].numel() == 9000
    doc = json.loads(in_a_pipe("latest", r, "--label", "eval", "--json").stdout)
    assert doc["tag"] == "global_step300" and doc["labels"] == ["best", "eval"]
    missing = in_a_pipe("latest", r, "--label", "nope")
    assert missing.code == 3 and missing.stdout == ""
    assert "no checkpoint labelled 'nope'" in missing.stderr


def test_the_environment_names_the_root_every_command_leaves_out(
    root: Path, listed: list[dict], tmp_path: Path
) -> None:
    # main: every command needed ROOT though nm.init reads NEBULA_PERSISTENT_STORAGE_PATH.
    env = {"NEBULA_PERSISTENT_STORAGE_PATH": str(root)}
    assert _tags(**env) == _tags(str(root))
    assert in_a_pipe("latest", **env).stdout == "global_step400\n"
    inspect = in_a_pipe("inspect", "global_step200", "--json", **env)
    assert inspect.code == 0 and json.loads(inspect.stdout)["tag"] == "global_step200"
    diff = in_a_pipe("diff", "global_step100", "global_step300", **env)
    assert diff.code == 1 and "global_step100 -> global_step300" in diff.stdout
    assert in_a_pipe("verify", "-q", **env).code == 0
    prune = in_a_pipe("prune", "--keep", "1", "--dry-run", "--json", **env)
    assert [d["tag"] for d in json.loads(prune.stdout)["delete"]] == ["global_step200"]
    out = tmp_path / "exported"
    assert in_a_pipe("export", "global_step400", str(out), **env).code == 0
    assert (out / "model.pt").is_file()
    copied = in_a_pipe("copy", "--latest", str(tmp_path / "backup"), **env)
    assert copied.code == 0, copied.stderr
    assert in_a_pipe("copy", "global_step100", str(tmp_path / "backup"), **env).code == 0
    assert _tags(str(tmp_path / "backup")) == ["global_step400", "global_step100"]
    # ROOT given: it wins over the environment.
    assert _tags(str(tmp_path / "backup"), **env) == ["global_step400", "global_step100"]
    # Neither: the usage error names both.
    run = in_a_pipe("ls")
    assert run.code == 2 and "NEBULA_PERSISTENT_STORAGE_PATH" in run.stderr
