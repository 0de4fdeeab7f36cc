"""Resuming a Trainer from a nebula checkpoint: `train(resume_from_checkpoint=...)`
resolved to one (True: the newest, the memory tier's after a crash; a `checkpoint-<N>`
path or a tag: that one; a real checkpoint folder: the Trainer's own), and the Trainer's
loading methods reading its items (verified, weights_only=True) instead of files. The
Trainer reads `trainer_state.json` from the resume path itself, so that one small file is
written to a temporary folder for the length of `train()`.

May import: the layers below the integrations, hf_common.py, hf_peft.py, trainer_tags.py
and transformers.

Not for: hooking the Trainer (transformers.py) or saving (trainer_saving.py).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

from nebulaml.checkpoint import Checkpoint
from nebulaml.errors import CheckpointNotFoundError
from nebulaml.format.jsonbounds import MAX_MANIFEST_BYTES, load_json
from nebulaml.integrations.hf_common import find, load_optional, restore_rng, rng_item
from nebulaml.integrations.hf_peft import load_weights
from nebulaml.integrations.trainer_tags import tag_for_path
from nebulaml.runtime import session as _session

log = logging.getLogger("nebulaml")

TRAINER_STATE = "trainer_state.json"  # transformers' TRAINER_STATE_NAME


_Load = Callable[..., None]


def _from_nebula(original: str) -> Callable[[_Load], Callable[..., Any]]:
    """The hook of the Trainer's loading method `original` (it takes the path to load
    from first): the method decorated, given nebula's checkpoint in the path's place, when
    the path is that of the resume from nebula in progress; else the Trainer's own method,
    with the path, as it was called."""

    def hook(load: _Load) -> Callable[..., Any]:
        @functools.wraps(load)
        def run(self: TrainerResuming, path: Any, *args: Any, **kwargs: Any) -> Any:
            checkpoint = self._ours(path)
            if checkpoint is None:
                return self.originals[original](path, *args, **kwargs)
            return load(self, checkpoint, *args, **kwargs)

        return run

    return hook


@dataclass(slots=True)
class _Resume:
    """A resume from nebula in progress: the checkpoint, and the path the Trainer is given."""

    checkpoint: Checkpoint
    path: str  # <temporary folder>/checkpoint-<N>, holding trainer_state.json only
    best_model_checkpoint: str | None


class TrainerResuming:
    """The resuming half of a hooked Trainer: each method replaces the Trainer's method of
    that name (`train`, `_load_from_checkpoint`, ...); `originals` are the Trainer's own,
    called when the resume path is not nebula's (the loading methods: `_from_nebula`)."""

    def __init__(self, trainer: Any, originals: dict[str, Any]) -> None:
        self.trainer = trainer  # typed Any: its optimizer and model are set once it trains
        self.originals = originals
        self.resume: _Resume | None = None

    def train(
        self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any
    ) -> Any:
        """The Trainer's `train`, resuming from what `resolve` finds: from nebula's
        checkpoint through a temporary `checkpoint-<N>` folder that holds its
        trainer_state.json alone (the loading methods below read the rest)."""
        original = self.originals["train"]
        checkpoint = self.resolve(resume_from_checkpoint)
        if checkpoint is None:
            # `True` with nothing saved yet (a job's first run): start fresh, as said.
            fresh = None if resume_from_checkpoint is True else resume_from_checkpoint
            return original(fresh, *args, **kwargs)
        if isinstance(checkpoint, str):  # a checkpoint folder on disk: the Trainer's own
            return original(checkpoint, *args, **kwargs)
        folder = tempfile.mkdtemp(prefix="nebula-resume-")
        try:
            state = load_json(checkpoint.load("trainer_state"), max_bytes=MAX_MANIFEST_BYTES)
            best = state.get("best_model_checkpoint")
            state["best_model_checkpoint"] = None  # restored by _init_training_state
            path = os.path.join(folder, f"{PREFIX_CHECKPOINT_DIR}-{state['global_step']}")
            os.mkdir(path)
            Path(path, TRAINER_STATE).write_text(
                json.dumps(state, indent=2, sort_keys=True) + "\n", encoding="utf-8"
            )
            self.resume = _Resume(checkpoint, path, best)
            log.info("resuming from nebula checkpoint %r", checkpoint.tag)
            return original(path, *args, **kwargs)
        finally:
            self.resume = None
            shutil.rmtree(folder, ignore_errors=True)

    def resolve(self, resume: str | bool | None) -> Checkpoint | str | None:
        """What `train(resume_from_checkpoint=...)` resumes from: nebula's checkpoint, a
        checkpoint folder on disk (the Trainer loads it itself), or None (no resume)."""
        trainer = self.trainer
        if resume is None or resume is False:
            return None
        if resume is True:
            latest = find(None)
            if latest is not None:
                return latest
            output_dir = trainer.args.output_dir
            local = get_last_checkpoint(output_dir) if os.path.isdir(output_dir) else None
            if local is None:
                # The same script starts a job and resumes it: its first run has nothing
                # to resume from, and trains from the start (the Trainer alone raises).
                where = _session.current("train").tiers.display
                log.info(
                    "no checkpoint in nebula (%s) or in the output directory (%s) to resume "
                    "from: training starts from the beginning", where, output_dir,
                )  # fmt: skip
            return local
        path = os.fspath(resume)
        if os.path.isfile(os.path.join(path, TRAINER_STATE)):
            return path
        tag = tag_for_path(path)
        found = find(tag)
        if found is None:
            raise CheckpointNotFoundError(_session.current("train").tiers.display, tag)
        return found

    def _ours(self, checkpoint: Any) -> Checkpoint | None:
        resume = self.resume
        if resume is not None and checkpoint is not None and os.fspath(checkpoint) == resume.path:
            return resume.checkpoint
        return None

    @_from_nebula("_load_from_checkpoint")
    def load_from_checkpoint(self, checkpoint: Checkpoint, model: Any = None) -> None:
        trainer = self.trainer
        target = trainer.model if model is None else model
        result = load_weights(checkpoint, target, load_optional)
        if result is not None:  # a whole model's (a peft model's adapters: as load_adapter)
            trainer._issue_warnings_after_load(result)

    @_from_nebula("_load_optimizer_and_scheduler")
    def load_optimizer_and_scheduler(self, checkpoint: Checkpoint) -> None:
        trainer = self.trainer
        args = trainer.args
        device = args.device
        on_device = args.world_size > 1 and device.type != "cpu"
        optimizer = load_optional(checkpoint, "optimizer", device if on_device else "cpu")
        scheduler = load_optional(checkpoint, "scheduler")
        if optimizer is not None and scheduler is not None:
            trainer.optimizer.load_state_dict(optimizer)
            trainer.lr_scheduler.load_state_dict(scheduler)

    @_from_nebula("_load_scaler")
    def load_scaler(self, checkpoint: Checkpoint) -> None:
        scaler = getattr(self.trainer.accelerator, "scaler", None)
        state = load_optional(checkpoint, "scaler") if scaler is not None else None
        if scaler is not None and state is not None:
            scaler.load_state_dict(state)

    @_from_nebula("_load_rng_state")
    def load_rng_state(self, checkpoint: Checkpoint) -> None:
        trainer = self.trainer
        args = trainer.args
        name = rng_item(args.process_index, args.world_size)
        state = load_optional(checkpoint, name)
        if state is None:
            log.info(
                "checkpoint %r has no item %r: the RNG states are not restored, so the "
                "resumed run will not be identical to an uninterrupted one",
                checkpoint.tag,
                name,
            )
            return
        restore_rng(state)

    def init_training_state(self, *args: Any, **kwargs: Any) -> Any:
        result = self.originals["_init_training_state"](*args, **kwargs)
        resume = self.resume
        trainer = self.trainer
        if resume is not None and resume.best_model_checkpoint:
            best = resume.best_model_checkpoint
            if find(tag_for_path(best)) is not None or os.path.isdir(best):
                trainer.state.best_model_checkpoint = best
            else:
                log.warning(
                    "the best checkpoint %s recorded in the resumed state is gone; ignoring it",
                    best,
                )
        return result

    def load_best_model(self) -> None:
        trainer = self.trainer
        best = trainer.state.best_model_checkpoint
        checkpoint = find(tag_for_path(best)) if best else None
        if checkpoint is None:
            return self.originals["_load_best_model"]()
        log.info(
            "loading the best model from nebula checkpoint %r (score: %s)",
            checkpoint.tag,
            trainer.state.best_metric,
        )
        result = load_weights(checkpoint, trainer.model, load_optional)
        if result is not None:
            trainer._issue_warnings_after_load(result)
        return None
