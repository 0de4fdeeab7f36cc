"""What the Hugging Face integrations share: a training checkpoint's items, RNG and ranks.

Holds: the item layout of a training checkpoint (`model`, `optimizer`, `scheduler`,
`scaler`, one `rng_state_<process>` per process), the RNG capture and restore in a form
that loads with weights_only=True (numpy's state as a tensor), and the rank rule under
several processes (rank 0 saves what every rank holds alike, each rank its own RNG, every
rank commits: `write_checkpoint`). The Trainer's hooks (integrations/transformers.py) and
Accelerate's `save_state` / `load_state` (integrations/accelerate.py) use them.

May import: the public API (`nebulaml.api`, `nebulaml.checkpoint`) and the layers below;
no framework (numpy and torch inside the functions that need them).

Not for: the Trainer (integrations/transformers.py), Accelerate (integrations/accelerate.py)
or nebula's own semantics (checkpoint.py).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from nebulaml.api import flush_persistence, get_checkpoint, get_latest_checkpoint, init
from nebulaml.checkpoint import MANUAL_COMMIT, Checkpoint
from nebulaml.errors import InvalidArgumentError, ItemNotFoundError
from nebulaml.runtime import session as _session

BEST_LABEL = "best"
Items = Callable[[], Iterator[tuple[str, Any]]]


# RNG ------------------------------------------------------------------------------------
def capture_rng() -> dict[str, Any]:
    """Every RNG state of this process (Python, numpy, torch's CPU and CUDA generators), as
    plain data and tensors: the item loads with weights_only=True.

    Example:
        >>> import torch
        >>> state = capture_rng()
        >>> a = torch.rand(2); restore_rng(state); torch.equal(a, torch.rand(2))
        True
    """
    import numpy as np
    import torch

    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {
            "kind": str(kind),
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "cpu": torch.random.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.random.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Set every RNG `capture_rng` recorded (CUDA's when this process sees as many devices)."""
    import numpy as np
    import torch

    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    numpy_state = state["numpy"]
    np.random.set_state(
        (
            numpy_state["kind"],
            numpy_state["keys"].numpy().astype(np.uint32),
            numpy_state["pos"],
            numpy_state["has_gauss"],
            numpy_state["cached_gaussian"],
        )
    )
    torch.random.set_rng_state(state["cpu"])
    cuda = state.get("cuda")
    if cuda is not None and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.random.set_rng_state_all(cuda)


def rng_item(process_index: int, world_size: int) -> str:
    """The item of one process's RNG states (the Trainer's file names, without `.pth`).

    Example:
        >>> rng_item(0, 1), rng_item(1, 2)
        ('rng_state', 'rng_state_1')
    """
    return "rng_state" if world_size <= 1 else f"rng_state_{process_index}"


# the rank rule --------------------------------------------------------------------------
def ensure_session(what: str, world_size: int) -> _session.Session:
    """The live nebula session (`init()` from the environment if there is none), checked
    to see the same number of processes as the framework: otherwise every process would
    save rank 0's items into a checkpoint of its own."""
    if _session.current_or_none() is None:
        init()  # NEBULA_PERSISTENT_STORAGE_PATH, else the memory tier alone
    session = _session.current(what)
    if session.world_size != world_size:
        raise InvalidArgumentError(
            f"{what}: nebula sees {session.world_size} process(es) and the framework "
            f"{world_size}; call nm.init() after torch.distributed is initialised, or launch "
            f"with torchrun (RANK, WORLD_SIZE)"
        )
    return session


def write_checkpoint(
    tag: str, shared: Items, own: Items, *, world_size: int, labels: Iterable[str] = ()
) -> None:
    """Save one training checkpoint as the tag `tag`: rank 0 saves `shared()` (what every
    rank holds alike: weights, optimizer, scheduler, the trainer's state), every rank saves
    `own()` (its RNG), and every rank commits, so the tag commits once every rank's part is
    there (docs/guide.md, "Several ranks"). Saving a tag again replaces it."""
    session = ensure_session("save", world_size)
    if tag in session.persister.protected():
        # Its previous version is still queued or being persisted: replacing the memory
        # copy would pull the files out from under the persister. Persist it first.
        flush_persistence(tag)
    checkpoint = Checkpoint(tag, MANUAL_COMMIT, overwrite=True, labels=labels)
    if session.rank == 0:
        for name, obj in shared():
            checkpoint.save(name, obj)
    for name, obj in own():
        checkpoint.save(name, obj)
    checkpoint.commit()


def find(tag: str | None, persist_path: Any = None) -> Checkpoint | None:
    """The committed checkpoint `tag` (the newest when None), or None."""
    if tag is None:
        return get_latest_checkpoint(persist_path)
    return get_checkpoint(tag, persist_path)


def load_optional(checkpoint: Checkpoint, name: str, map_location: Any = "cpu") -> Any:
    """The item `name`, or None when the checkpoint has no such item."""
    try:
        return checkpoint.load(name, map_location=map_location)
    except ItemNotFoundError:
        return None


def model_config(model: Any) -> tuple[str, str] | None:
    """`(config.json, generation_config.json or "")` of a transformers model, as the texts
    `save_pretrained` writes (with `architectures`), for the export; None for other models."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_json_string"):
        return None
    architectures = config.architectures
    config.architectures = [type(model).__name__]
    try:
        text = config.to_json_string(use_diff=True)
    finally:
        config.architectures = architectures
    generation = getattr(model, "generation_config", None)
    generation_text = ""
    if generation is not None and getattr(model, "can_generate", lambda: False)():
        generation_text = generation.to_json_string(use_diff=True)
    return text, generation_text
