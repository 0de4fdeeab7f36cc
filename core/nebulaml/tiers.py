"""The tiers of one job: a node-local memory tier and, optionally, a persistent tier.

The memory tier lives in RAM (`/dev/shm`, or a temporary folder where there is none),
namespaced per user and per persistent root, so that two jobs with different roots never
see each other's checkpoints and a restarted job on the same node finds its own.

Not for: moving checkpoints between tiers (persister.py) or reading them (catalog.py).
"""

from __future__ import annotations

import getpass
import hashlib
import json
import os
import re
import tempfile
from dataclasses import dataclass
from typing import Any

from .storage import Store

MEMORY_TIER_ENV = "NEBULA_MEMORY_TIER_PATH"
ROOT_INFO_FILE = ".nebula-root.json"


def memory_base() -> str:
    """The folder that holds this user's memory tiers on this node.

    `NEBULA_MEMORY_TIER_PATH` overrides it (tests, or nodes with a RAM disk elsewhere).
    """
    override = os.environ.get(MEMORY_TIER_ENV)
    if override:
        return os.path.abspath(override)
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = str(os.getuid())
    shm = "/dev/shm"
    parent = shm if os.path.isdir(shm) and os.access(shm, os.W_OK) else tempfile.gettempdir()
    return os.path.join(parent, f"nebula-{user}")


def memory_root_for(persistent: Store | None) -> str:
    """The memory-tier folder that belongs to a persistent root (or to a memory-only job,
    keyed by the working directory).

    Example:
        >>> import os, tempfile
        >>> os.path.basename(memory_root_for(Store(tempfile.gettempdir() + "/run1")))[:5]
        'run1-'
    """
    if persistent is None:
        key, slug = f"memory-only:{os.getcwd()}", "memory-only"
    else:
        key = persistent.url
        slug = re.sub(r"[^A-Za-z0-9_.-]", "_", persistent.url.rstrip("/").rsplit("/", 1)[-1])
        slug = slug.lstrip(".")[:40] or "root"
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    return os.path.join(memory_base(), f"{slug}-{digest}")


@dataclass(frozen=True, slots=True, eq=False)
class TierSet:
    """The stores of one job, fastest first."""

    memory: Store
    persistent: Store | None

    @property
    def stores(self) -> list[tuple[str, Store]]:
        tiers = [("memory", self.memory)]
        if self.persistent is not None:
            tiers.append(("persistent", self.persistent))
        return tiers

    @property
    def history_store(self) -> Store:
        """Where checkpointHistories.csv goes: the persistent root if there is one."""
        return self.persistent if self.persistent is not None else self.memory

    @property
    def display(self) -> str:
        return self.persistent.url if self.persistent is not None else self.memory.url


def open_tiers(
    persistent_path: str | os.PathLike[str] | None,
    storage_options: dict[str, Any] | None = None,
) -> TierSet:
    """The tiers for a persistent root (None: the memory tier alone)."""
    persistent = None if persistent_path is None else Store(persistent_path, storage_options)
    memory = Store(memory_root_for(persistent), durable=False)
    return TierSet(memory=memory, persistent=persistent)


def record_root(tiers: TierSet) -> None:
    """Write which persistent root a memory tier belongs to (read by `nebula flush`)."""
    tiers.memory.make_dir()
    doc = {"persistent": tiers.persistent.url if tiers.persistent else None}
    tiers.memory.publish((ROOT_INFO_FILE,), json.dumps(doc).encode(), create_only=False)
