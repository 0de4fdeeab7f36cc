"""What the peer-replica children (peer_child.py, peer_session_child.py, recovery_child.py)
save and check: each rank's shard of a step, its part of a checkpoint, and the sha256 of
that part's files in its memory tier (not run by pytest)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

import nebulaml as nm
from nebulaml.format.names import marker_name


def shard(rank: int, step: int, size: int = 8192) -> dict[str, torch.Tensor]:
    """Rank `rank`'s state at `step`: `size` floats that differ by rank and step."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return {"flat_param": torch.randn(size, generator=gen), "step": torch.tensor(step)}


def save(rank: int, step: int, size: int = 8192) -> str:
    """Every rank's part of global_step<step> (two items), committed; its tag."""
    tag = f"global_step{step}"
    ckpt = nm.Checkpoint(tag, -2)
    ckpt.save(f"shard_rank{rank}", shard(rank, step, size))
    ckpt.save(f"extra_rank{rank}", {"lr": 0.1 * step})
    ckpt.commit()
    return tag


def own_part(memory: Path, tag: str, rank: int) -> dict[str, str]:
    """The sha256 of each file of this rank's part of `tag` in its memory tier."""
    marker = json.loads((memory / tag / marker_name(rank)).read_text())
    names = [marker_name(rank), *(item["file"] for item in marker["items"])]
    return {n: hashlib.sha256((memory / tag / n).read_bytes()).hexdigest() for n in names}
