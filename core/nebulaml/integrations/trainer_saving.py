"""A Trainer's saves as nebula checkpoints: its `_save_checkpoint`, replaced, writes the
checkpoint `global_step<N>` (the items `trainer_state.json` and the checkpoint folder
would hold; rank 0 the shared ones, each rank its RNG, every rank commits), labelled
`transformers` (and `best`), then runs the Trainer's rotation over nebula's checkpoints.

May import: the layers below the integrations, hf_common.py, hf_peft.py, trainer_tags.py
and transformers.

Not for: hooking the Trainer (transformers.py), resuming (trainer_resuming.py) or the
rotation's rule itself (trainer_tags.py `rotated_out`: the Trainer's own).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterator
from typing import Any

from transformers.trainer_callback import ExportableState
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, SaveStrategy

from nebulaml.api import get_checkpoint
from nebulaml.format.names import step_of
from nebulaml.integrations.hf_common import (
    BEST_LABEL,
    capture_rng,
    model_config,
    rng_item,
    write_checkpoint,
)
from nebulaml.integrations.hf_peft import base_model, weight_items
from nebulaml.integrations.trainer_tags import TAG_PREFIX, rotated_out, tag_for_path, tag_for_step
from nebulaml.protocol.catalog import list_committed
from nebulaml.protocol.markers import own_parts
from nebulaml.runtime import session as _session

TRAINER_LABEL = "transformers"  # the Trainer's rotation decides when it goes


class TrainerSaving:
    """The saving half of a hooked Trainer: `save_checkpoint` replaces its
    `_save_checkpoint`; `retention` is the callback's `num_of_version_in_retention`."""

    def __init__(self, trainer: Any, retention: int | None) -> None:
        self.trainer = trainer  # typed Any: its optimizer and model are set once it trains
        self.retention = retention

    def save_checkpoint(self, model: Any, trial: Any) -> None:
        """The Trainer's `_save_checkpoint`: the checkpoint `global_step<N>`, then the
        rotation."""
        trainer = self.trainer
        args, state = trainer.args, trainer.state
        if trainer.hp_search_backend is None and trial is None:
            trainer.store_flos()
        run_dir = trainer._get_output_dir(trial=trial)
        step = state.global_step
        best_step = state.best_global_step
        kinds = (SaveStrategy.STEPS, SaveStrategy.EPOCH, SaveStrategy.BEST)
        # As the Trainer: the best checkpoint is recorded once it exists.
        if (
            args.save_strategy in kinds
            and best_step
            and (best_step == step or get_checkpoint(tag_for_step(best_step)) is not None)
        ):
            state.best_model_checkpoint = os.path.join(
                run_dir, f"{PREFIX_CHECKPOINT_DIR}-{best_step}"
            )
        labels: tuple[str, ...] = (TRAINER_LABEL,)
        if best_step == step and args.metric_for_best_model:
            labels += (BEST_LABEL,)
        full = not args.save_only_model

        def shared() -> Iterator[tuple[str, Any]]:
            # A peft model: its adapters, as the Trainer saves it (not the frozen base).
            yield from weight_items(trainer.model)
            config = model_config(base_model(trainer.model))
            if config is not None:
                yield "config", config[0]
                if config[1]:
                    yield "generation_config", config[1]
            if full:
                yield "optimizer", trainer.optimizer.state_dict()
                yield "scheduler", trainer.lr_scheduler.state_dict()
                scaler = getattr(trainer.accelerator, "scaler", None)
                if scaler is not None:
                    yield "scaler", scaler.state_dict()
            yield "trainer_state", _trainer_state_json(trainer)

        def own() -> Iterator[tuple[str, Any]]:
            if full:
                yield rng_item(args.process_index, args.world_size), capture_rng()

        write_checkpoint(
            tag_for_step(step), shared, own, world_size=max(1, args.world_size), labels=labels
        )
        self.rotate()

    def rotate(self) -> None:
        """The Trainer's rotation, over nebula's checkpoints: what the Trainer's own
        `rotate_checkpoints` would delete of `checkpoint-<N>` folders (the limit:
        `num_of_version_in_retention` when passed, else `save_total_limit`; None keeps
        every one, as the Trainer) goes from every tier. The checkpoints are those this
        process knows: committed in its memory tier, and durable as its persister knows
        (the training thread never lists the persistent tier). Every rank does it, for its
        own parts; rank 0's persister deletes the persistent copies. After a lazy save
        (the default), it runs once that checkpoint is committed or has failed, on the
        snapshot thread: what the rotation counts is what the memory tier holds."""
        limit = self.retention or self.trainer.args.save_total_limit
        session = _session.live()
        if session is None or limit is None or limit <= 0:
            return
        if session.snapshots is not None:
            session.snapshots.submit(lambda: self._rotate(session, limit), copies=False)
        else:
            self._rotate(session, limit)

    def _rotate(self, session: Any, limit: int) -> None:
        trainer = self.trainer
        known = set(session.persister.durable_tags())
        if session.world_size > 1:
            known |= {tag for tag, _created in own_parts(session.tiers.memory, session.rank)}
        else:
            known |= {info.tag for info in list_committed(session.tiers.memory)}
        steps = {tag: step_of(tag) for tag in known if tag.startswith(TAG_PREFIX)}
        best = trainer.state.best_model_checkpoint
        best_step = step_of(tag_for_path(best)) if best else None
        for tag in rotated_out(steps, limit, best_step):
            session.persister.forget(tag)


def _trainer_state_json(trainer: Any) -> str:
    """What the Trainer writes to trainer_state.json, the states of its stateful callbacks
    brought up to date first (as `_save_checkpoint` does)."""
    state = trainer.state
    for callback in [*trainer.callback_handler.callbacks, trainer.control]:
        if not isinstance(callback, ExportableState):
            continue
        name = callback.__class__.__name__
        if isinstance(state.stateful_callbacks.get(name), list):
            state.stateful_callbacks[name].append(callback.state())
        else:
            state.stateful_callbacks[name] = callback.state()
    return json.dumps(dataclasses.asdict(state), indent=2, sort_keys=True) + "\n"
