"""A root with one checkpoint a newer nebula wrote (manifest schema 99) beside good ones:
`ls`, `latest` and `prune` work on the rest (exit 0, one warning naming the tag and the
nebula that reads it), and `verify` calls it unsupported, not corrupt."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from cli_helpers import in_a_pipe
from schema_kit import make_newer

import nebulaml as nm


def _root(root: Path) -> None:
    nm.init(str(root), persistent_time_interval=0, num_of_version_in_retention=10)
    for step in (100, 200):
        nm.Checkpoint(f"global_step{step}").save("model", {"w": torch.full((4,), float(step))})
        nm.flush_persistence()
    nm.shutdown()
    make_newer(root, "global_step100")


def test_ls_latest_and_prune_work_beside_it(root: Path) -> None:
    # Catches: exit 1 for the whole root (UnsupportedSchemaError), a warning per listing.
    _root(root)
    ls = in_a_pipe("ls", str(root))
    assert ls.code == 0, ls.stderr
    assert [line.split()[0] for line in ls.stdout.splitlines()[2:]] == ["global_step200"]
    warnings = [line for line in ls.stderr.splitlines() if line.startswith("nebula: warning:")]
    assert len(warnings) == 1 and "'global_step100'" in warnings[0], ls.stderr
    assert "schema_version 99" in warnings[0] and "nebula 9.1.0" in warnings[0]
    latest = in_a_pipe("latest", str(root), "--item", "model")
    assert (latest.code, latest.stdout) == (0, f"{root}/global_step200/model\n"), latest.stderr
    as_json = json.loads(in_a_pipe("ls", str(root), "--json").stdout)
    assert [c["tag"] for c in as_json["checkpoints"]] == ["global_step200"]
    prune = in_a_pipe("prune", str(root), "--keep", "1", "--dry-run")
    assert prune.code == 0, prune.stderr
    row = next(line for line in prune.stdout.splitlines() if line.startswith("global_step100"))
    assert row.split()[1] == "protected" and "schema_version 99" in row


def test_verify_calls_it_unsupported_not_corrupt(root: Path) -> None:
    _root(root)
    run = in_a_pipe("verify", str(root), "--json")
    assert run.code == 1  # not checked: a script learns that not everything is verified
    doc = json.loads(run.stdout)
    statuses = {(r["tag"], r["item"]): r["status"] for r in doc["results"]}
    assert statuses == {("global_step200", "model"): "ok", ("global_step100", None): "unsupported"}
    detail = next(r["detail"] for r in doc["results"] if r["status"] == "unsupported")
    assert "schema_version 99" in detail and "nebula 9.1.0, which wrote it, reads it" in detail
    table = in_a_pipe("verify", str(root))
    assert "unsupported" in table.stdout and "corrupt" not in table.stdout + table.stderr
