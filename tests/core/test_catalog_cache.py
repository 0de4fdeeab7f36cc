"""The catalog a process keeps between calls (protocol/commit_index.py `catalog`) never
lists a checkpoint another process is deleting: a delete removes the manifest first, and
the tag's folder and its index entry last."""

from __future__ import annotations

from pathlib import Path

import torch

import nebulaml as nm


def test_a_tag_whose_manifest_another_process_removed_is_not_listed(tmp_path: Path) -> None:
    """catches: the kept catalog, keyed on the root's folder names and index entries,
    listing global_step2 as committed after another process's delete had removed its
    manifest (the concurrency campaign: "global_step58 was not found, yet it is
    committed")"""
    root = tmp_path / "root"
    nm.init(str(root), persistent_time_interval=0, num_of_version_in_retention=5)
    try:
        for step in (1, 2, 3):
            nm.Checkpoint(f"global_step{step}").save("model", {"w": torch.ones(2) * step})
            assert nm.flush_persistence() is True
        listed = [c["tag"] for c in nm.list_checkpoints(str(root))]
        assert "global_step2" in listed
        (root / "global_step2" / "manifest.json").unlink()  # another process's delete, begun
        memory = Path(nm.memory_tier_path(str(root))) / "global_step2" / "manifest.json"
        memory.unlink(missing_ok=True)
        listed = [c["tag"] for c in nm.list_checkpoints(str(root))]
        assert "global_step2" not in listed, listed
        assert {"global_step1", "global_step3"} <= set(listed)
    finally:
        nm.shutdown()
