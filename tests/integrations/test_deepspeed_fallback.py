"""DeepSpeed's Nebula engine asked for a tag nebula does not hold (the memory tier that
held it was lost before its persist): the engine falls back to the newest checkpoint, for
each file it loads; nebula says so once per process, naming the tag it loads instead
(issue #48). DeepSpeed's own `NebulaCheckpointEngine.load` is called, in this process."""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
from frameworks import require

import torch_nebula

FILES = (
    "mp_rank_00_model_states.pt",
    "zero_pp_rank_0_mp_rank_00_optim_states.pt",
    "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt",
)


def test_a_missing_tag_is_said_once_naming_the_tag_loaded_instead(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Bugs caught: the warning printed once per file the engine loads (3 per rank), its
    cause given as the persist interval alone, and the tag loaded instead never named."""
    require("deepspeed")
    from deepspeed.runtime.checkpoint_engine.nebula_checkpoint_engine import (
        NebulaCheckpointEngine,
    )

    root = str(tmp_path / "root")
    config = SimpleNamespace(
        enable_nebula_load=True,
        load_path=None,
        persistent_storage_path=root,
        persistent_time_interval=100,
        num_of_version_in_retention=2,
    )
    engine = NebulaCheckpointEngine(config)
    checkpoint = torch_nebula.Checkpoint("global_step2", -2)
    for name in FILES:
        checkpoint.save(name, {"step": 2, "file": name})
    assert checkpoint.commit() is True
    torch_nebula.flush_persistence()

    save_dir = tmp_path / "save_dir" / "global_step4"  # its checkpoint is on no tier
    with caplog.at_level(logging.WARNING, logger="nebulaml"):
        for name in FILES:
            assert engine.load(str(save_dir / name)) == {"step": 2, "file": name}
    said = [r.getMessage() for r in caplog.records if "global_step4" in r.getMessage()]
    assert len(said) == 1, said
    assert "loads 'global_step2', the newest, instead" in said[0], said[0]
    assert "memory tier" in said[0] and "lost" in said[0], said[0]
