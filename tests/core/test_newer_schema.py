"""A root stays usable beside a manifest of a newer schema (one a later nebula wrote): the
tag is skipped with one warning naming it and the nebula that reads it, the newest readable
checkpoint is the latest, a job resumes and saves on, and nothing deletes the tag it cannot
read. A root with nothing readable is still an error, never an empty root to start over in.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from schema_kit import make_newer

import nebulaml as nm


def _save(root: Path, steps: tuple[int, ...]) -> None:
    nm.init(str(root), persistent_time_interval=0, num_of_version_in_retention=10)
    for step in steps:
        nm.Checkpoint(f"global_step{step}").save("model", {"w": torch.full((4,), float(step))})
        nm.flush_persistence()
    nm.shutdown()


def _skips(caplog: pytest.LogCaptureFixture, tag: str) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno == logging.WARNING and repr(tag) in r.getMessage()]  # fmt: skip


@pytest.mark.parametrize("newer", ["global_step100", "global_step300"])
def test_a_newer_schema_tag_is_skipped_once_and_the_newest_readable_is_the_latest(
    root: Path, newer: str, caplog: pytest.LogCaptureFixture
) -> None:
    # Catches: the whole root unusable (list and latest raising UnsupportedSchemaError),
    # the tag skipped silently, a warning on every listing, no word of what reads it.
    _save(root, (100, 200, 300))
    make_newer(root, newer)
    readable = [t for t in ("global_step300", "global_step200", "global_step100") if t != newer]
    with caplog.at_level(logging.WARNING, logger="nebulaml"):
        assert [c["tag"] for c in nm.list_checkpoints(str(root))] == readable
        latest = nm.get_latest_checkpoint(str(root))
        assert latest is not None and latest.tag == readable[0]
        assert latest.load("model")["w"][0].item() == float(readable[0].removeprefix("global_step"))
        assert nm.get_latest_checkpoint_path("model", str(root)).endswith(f"{readable[0]}/model")
    (warning,) = _skips(caplog, newer)
    assert "schema_version 99" in warning and "nebula 9.1.0" in warning
    assert "upgrade nebula-checkpoint" in warning
    # Asked for by name, it is the error that says why, not "not found".
    with pytest.raises(nm.UnsupportedSchemaError, match="schema_version 99"):
        nm.get_checkpoint(newer, str(root))


def test_a_job_resumes_saves_and_retires_beside_it_without_deleting_it(root: Path) -> None:
    # Catches: init or the persister's retention raising on the root, retention or prune
    # deleting (or counting) a checkpoint this version cannot read.
    _save(root, (100, 200))
    make_newer(root, "global_step100", writer=None)  # no producer: "a newer nebula"
    nm.init(str(root), persistent_time_interval=0, num_of_version_in_retention=1)
    latest = nm.get_latest_checkpoint()
    assert latest is not None and latest.tag == "global_step200"
    with latest:  # resumed: the hold on it released
        assert latest.load("model")["w"][0].item() == 200.0
    for step in (300, 400):
        nm.Checkpoint(f"global_step{step}").save("model", {"w": torch.ones(4)})
        assert nm.flush_persistence() is True
    nm.shutdown()
    folders = sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    assert folders == ["global_step100", "global_step400"]
    assert nm.list_incomplete(str(root)) == []  # committed by a newer nebula: not a leftover
    listing = nm.ops.list_prune_candidates(str(root), incomplete=True)
    plan = nm.ops.plan_prune(listing, keep=1)
    assert "global_step100" not in [d.tag for d in plan.delete]
    nm.ops.execute_prune(str(root), plan)
    assert (root / "global_step100" / "manifest.json").exists()


def test_a_root_with_nothing_readable_is_still_an_error(
    root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Catches: a root of a newer nebula read as an empty one (a job would start over at
    # step 0 beside checkpoints it cannot see).
    _save(root, (100,))
    make_newer(root, "global_step100")
    with pytest.raises(nm.UnsupportedSchemaError, match=r"nebula 9\.1\.0"):
        nm.get_latest_checkpoint(str(root))
    with pytest.raises(nm.UnsupportedSchemaError):
        nm.list_checkpoints(str(root))
