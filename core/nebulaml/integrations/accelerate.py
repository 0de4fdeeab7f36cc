"""Accelerate's `save_state` / `load_state` through nebula (`nebulaml.accelerate` is the
public module built on it).

`save_state` writes what `accelerator.save_state()` would, as items of one tag, with the
layout, RNG and rank rule the Hugging Face integrations share (hf_common.py);
`load_state` restores them. Sharded states (FSDP, DeepSpeed, Megatron-LM) are refused.

May import: the public API (`nebulaml.api`, `nebulaml.checkpoint`), hf_common.py and the
layers below. Accelerate itself is imported inside the functions that need it.

Not for: what the Hugging Face integrations share (hf_common.py); the Trainer
(integrations/transformers.py); nebula's own semantics (checkpoint.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from nebulaml.errors import CheckpointNotFoundError, InvalidArgumentError
from nebulaml.integrations import hf_common as hf

META_ITEM = "accelerate_state"  # Accelerate's step and save iteration


def _suffix(i: int) -> str:
    return "" if i == 0 else f"_{i}"


def _unwrap(model: Any) -> Any:
    """The module inside DDP / DataParallel and torch.compile wrappers (as
    `accelerator.unwrap_model`, which imports DeepSpeed when it is installed)."""
    import torch

    parallel = (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)
    while True:
        if isinstance(model, parallel):
            model = model.module
        elif isinstance(getattr(model, "_orig_mod", None), torch.nn.Module):
            model = model._orig_mod
        else:
            return model


def _check_accelerator(accelerator: Any, what: str) -> None:
    from accelerate.utils import DistributedType

    refused = (DistributedType.FSDP, DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM)
    if accelerator.distributed_type in refused:
        raise InvalidArgumentError(
            f"nebulaml.accelerate.{what} saves whole (unsharded) states; "
            f"{accelerator.distributed_type} shards them: use its own checkpointing "
            f'(DeepSpeed: the "nebula" block of its config)'
        )


def save_state(accelerator: Any, tag: str, *, labels: Iterable[str] = ()) -> None:
    """`accelerator.save_state()` into the nebula checkpoint `tag`: what it would write,
    as items: `model`, `optimizer`, `scheduler` (`_1`, `_2`... for the second and later
    prepared ones), `scaler`, `custom_checkpoint_<i>` (objects registered with
    `register_for_checkpointing`), the stateful data loaders' states, Accelerate's step and
    save iteration, and one `rng_state_<process>` per process."""
    _check_accelerator(accelerator, "save_state")
    world_size = accelerator.num_processes

    def shared() -> Iterator[tuple[str, Any]]:
        for i, model in enumerate(accelerator._models):
            unwrapped = _unwrap(model)
            yield f"model{_suffix(i)}", unwrapped.state_dict()
            config = hf.model_config(unwrapped) if i == 0 else None
            if config is not None:
                yield "config", config[0]
                if config[1]:
                    yield "generation_config", config[1]
        for i, optimizer in enumerate(accelerator._optimizers):
            yield f"optimizer{_suffix(i)}", optimizer.state_dict()
        for i, scheduler in enumerate(accelerator._schedulers):
            yield f"scheduler{_suffix(i)}", scheduler.state_dict()
        for i, loader in enumerate(accelerator._dataloaders):
            if getattr(loader, "use_stateful_dataloader", False):
                yield f"dl_state_dict{_suffix(i)}", loader.state_dict()
        if accelerator.scaler is not None:
            yield "scaler", accelerator.scaler.state_dict()
        for i, obj in enumerate(accelerator._custom_objects):
            yield f"custom_checkpoint_{i}", obj.state_dict()
        iteration = accelerator.project_configuration.iteration + 1
        yield META_ITEM, {"step": accelerator.step, "iteration": iteration}

    def own() -> Iterator[tuple[str, Any]]:
        yield f"rng_state_{accelerator.process_index}", hf.capture_rng()

    hf.write_checkpoint(tag, shared, own, world_size=world_size, labels=labels)
    accelerator.project_configuration.iteration += 1


def load_state(accelerator: Any, tag: str | None = None, persist_path: Any = None) -> str | None:
    """`accelerator.load_state()` from the nebula checkpoint `tag` (default: the newest, on
    any tier: the memory tier after a crash); returns the tag loaded, or None when there is
    no checkpoint and `tag` was None. Restores what `save_state` saved, this process's RNG
    included, and `accelerator.step` and `save_iteration`."""
    _check_accelerator(accelerator, "load_state")
    hf.ensure_session("load_state", accelerator.num_processes)
    checkpoint = hf.find(tag, persist_path)
    if checkpoint is None:
        if tag is None:
            return None
        raise CheckpointNotFoundError(str(persist_path or "the session's root"), tag)
    for i, model in enumerate(accelerator._models):
        unwrapped = _unwrap(model)
        unwrapped.load_state_dict(checkpoint.load(f"model{_suffix(i)}", map_location="cpu"))
    for i, optimizer in enumerate(accelerator._optimizers):
        optimizer.load_state_dict(checkpoint.load(f"optimizer{_suffix(i)}", map_location="cpu"))
    for i, scheduler in enumerate(accelerator._schedulers):
        scheduler.load_state_dict(checkpoint.load(f"scheduler{_suffix(i)}"))
    for i, loader in enumerate(accelerator._dataloaders):
        if getattr(loader, "use_stateful_dataloader", False):
            state = hf.load_optional(checkpoint, f"dl_state_dict{_suffix(i)}")
            if state is not None:
                loader.load_state_dict(state)
    if accelerator.scaler is not None:
        accelerator.scaler.load_state_dict(checkpoint.load("scaler"))
    for i, obj in enumerate(accelerator._custom_objects):
        obj.load_state_dict(checkpoint.load(f"custom_checkpoint_{i}"))
    meta = hf.load_optional(checkpoint, META_ITEM) or {}
    if "step" in meta:
        accelerator.step = meta["step"]
    if "iteration" in meta:
        accelerator.project_configuration.iteration = meta["iteration"]
    rng = hf.load_optional(checkpoint, f"rng_state_{accelerator.process_index}")
    if rng is not None:
        hf.restore_rng(rng)
    return checkpoint.tag
