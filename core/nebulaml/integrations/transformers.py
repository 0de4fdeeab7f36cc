"""The Hugging Face Trainer through nebula: `NebulaCallback`, and the export of a checkpoint
to a `from_pretrained` folder (`nebulaml.transformers` is the public module built on it).

How the Trainer is hooked: a `TrainerCallback` alone cannot do it. Saving happens in
`Trainer._save_checkpoint` (synchronous writes into `output_dir`), and
`train(resume_from_checkpoint=True)` looks for `checkpoint-*` folders in `output_dir`
before any callback runs. So the callback, on `on_init_end` (called from the Trainer's
`__init__`, whose frame holds the Trainer: callbacks are not handed it), replaces a few of
that one Trainer's methods on the instance (its class, and every other Trainer, are left
alone):

- `_save_checkpoint`: every save the Trainer makes (`save_strategy`, `save_steps`, the
  final save, `save_strategy="best"`) becomes the nebula checkpoint `global_step<N>`:
  items `model`, `config` (+ `generation_config`), `optimizer`, `scheduler`, `scaler`,
  `trainer_state` (the JSON `trainer_state.json` would hold) and `rng_state` (one per
  process under DDP: `rng_state_<i>`). Rank 0 saves the rest; every rank commits. A
  checkpoint that is the best so far (`metric_for_best_model`) is labelled `best`.
  The Trainer's rotation is the retention: each checkpoint is labelled `transformers`
  (nebula's count never drops one, the interval never skips one), and after each save
  the Trainer's own `rotate_checkpoints` decides, over nebula's checkpoints, what goes
  (`save_total_limit`, the best and the newest kept); every rank hands those to its
  persister to delete (`Persister.forget`).
- `train`: `resume_from_checkpoint=True` takes nebula's newest checkpoint (the memory tier
  after a crash, else the persistent tier); a path `.../checkpoint-<N>` (or a tag) takes
  that checkpoint. A real checkpoint folder on disk still resumes as the Trainer would.
  The Trainer reads `trainer_state.json` from the resume path itself, so that one small
  file is written to a temporary folder for the length of `train()`.
- `_load_from_checkpoint`, `_load_optimizer_and_scheduler`, `_load_scaler`,
  `_load_rng_state`, `_init_training_state`, `_load_best_model`: read those items
  (verified, weights_only=True) instead of files, when the resume path is nebula's.

`state.best_model_checkpoint` keeps the Trainer's form (`<output_dir>/checkpoint-<N>`):
nothing is written there; `tag_for_path` gives its tag. Not supported (refused when the
Trainer is built): DeepSpeed (use its own `"nebula"` config block), FSDP, XLA, SageMaker
MP; `push_to_hub` of checkpoints is not done (a warning says so).

May import: the public API, the layers below, integrations/accelerate.py (the shared item
layout, RNG and rank rule), transformers and safetensors.

Not for: Accelerate's own loop (integrations/accelerate.py); Lightning
(lightning_common.py); nebula's semantics (checkpoint.py, api.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import re
import shutil
import sys
import tempfile
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import FrameType, MethodType
from typing import Any

from transformers import Trainer, TrainerCallback
from transformers.trainer_callback import ExportableState
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, SaveStrategy, get_last_checkpoint

from nebulaml.api import get_checkpoint, init
from nebulaml.checkpoint import Checkpoint
from nebulaml.config import private_default
from nebulaml.errors import CheckpointNotFoundError, InvalidArgumentError
from nebulaml.format.jsonbounds import MAX_MANIFEST_BYTES, load_json
from nebulaml.format.names import step_of, validate_name
from nebulaml.integrations.hf_common import (
    BEST_LABEL,
    capture_rng,
    ensure_session,
    find,
    load_optional,
    model_config,
    restore_rng,
    rng_item,
    write_checkpoint,
)
from nebulaml.protocol.catalog import list_committed
from nebulaml.protocol.markers import own_parts
from nebulaml.runtime import session as _session
from nebulaml.storage.local_files import make_folders, new_file_mode

log = logging.getLogger("nebulaml")

TRAINER_STATE = "trainer_state.json"  # transformers' TRAINER_STATE_NAME
TAG_PREFIX = "global_step"
STEP_TAG = TAG_PREFIX + "{}"
TRAINER_LABEL = "transformers"  # the Trainer's rotation decides when it goes
_CHECKPOINT_RE = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")
HOOKED = (
    "_save_checkpoint",
    "train",
    "_load_from_checkpoint",
    "_load_optimizer_and_scheduler",
    "_load_scaler",
    "_load_rng_state",
    "_init_training_state",
    "_load_best_model",
)


def tag_for_step(step: int) -> str:
    """The nebula tag of the Trainer's checkpoint at `step`.

    Example:
        >>> tag_for_step(500)
        'global_step500'
    """
    return STEP_TAG.format(int(step))


def tag_for_path(path: str | os.PathLike[str]) -> str:
    """The nebula tag a Trainer checkpoint path names: `.../checkpoint-500` is
    `global_step500`; any other last component is a tag as it is.

    Example:
        >>> tag_for_path("out/checkpoint-500"), tag_for_path("out/global_step7/")
        ('global_step500', 'global_step7')
    """
    name = os.path.basename(os.fspath(path).rstrip("/\\"))
    match = _CHECKPOINT_RE.match(name)
    if match:
        return tag_for_step(int(match.group(1)))
    return validate_name("tag", name)


@dataclass(slots=True)
class _Resume:
    """A resume from nebula in progress: the checkpoint, and the path the Trainer is given."""

    checkpoint: Checkpoint
    path: str  # <temporary folder>/checkpoint-<N>, holding trainer_state.json only
    best_model_checkpoint: str | None


def rotated_out(steps: dict[str, int | None], limit: int, best_step: int | None) -> list[str]:
    """The tags (of `steps`: tag -> step) that the Trainer's `rotate_checkpoints` would
    delete with `save_total_limit=limit` and the best checkpoint at `best_step`: it runs on
    a scratch folder of empty `checkpoint-<N>` folders, so that the Trainer's own rule
    decides, whatever its version.

    Example:
        >>> rotated_out({f"global_step{n}": n for n in (4, 8, 12, 16)}, 2, 8)
        ['global_step4', 'global_step12']
    """
    from transformers.trainer_utils import rotate_checkpoints

    by_step = {step: tag for tag, step in steps.items() if step is not None}
    with tempfile.TemporaryDirectory(prefix="nebula-rotation-") as scratch:
        for step in by_step:
            os.mkdir(os.path.join(scratch, f"{PREFIX_CHECKPOINT_DIR}-{step}"))
        best = None
        if best_step in by_step:
            best = os.path.join(scratch, f"{PREFIX_CHECKPOINT_DIR}-{best_step}")
        rotate_checkpoints(scratch, limit, best, use_mtime=False)
        left = set(os.listdir(scratch))
    return [t for s, t in sorted(by_step.items()) if f"{PREFIX_CHECKPOINT_DIR}-{s}" not in left]


class NebulaCallback(TrainerCallback):
    """Checkpoint a Hugging Face `Trainer` with nebula:
    `Trainer(..., callbacks=[NebulaCallback(persistent_storage_path=...)])`.

    Arguments are `nm.init`'s (`persistent_storage_path`, `persistent_time_interval`,
    `num_of_version_in_retention`, and its options, e.g. `lazy_snapshot=True`). With no
    path and a session already started (`nm.init` called), that session is used.
    The Trainer's rotation decides which checkpoints go (`save_total_limit`, or
    `num_of_version_in_retention` when passed here; None keeps every one); nebula's count
    applies to the session's other checkpoints. Passed in `callbacks=[...]` it hooks the
    Trainer as it is built;
    added later (`trainer.add_callback`), call `callback.attach(trainer)` before `train()`
    for resuming to work.
    """

    def __init__(
        self,
        persistent_storage_path: str | os.PathLike[str] | None = None,
        persistent_time_interval: float | None = None,
        num_of_version_in_retention: int | None = None,
        **init_options: Any,
    ) -> None:
        self.persistent_storage_path = persistent_storage_path
        self.persistent_time_interval = persistent_time_interval
        self.num_of_version_in_retention = num_of_version_in_retention
        self.init_options = dict(init_options)
        self.trainer: Trainer | None = None
        self._resume: _Resume | None = None
        self._originals: dict[str, Any] = {}

    # the callback's events --------------------------------------------------------------
    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        trainer = _find_trainer(self)
        if trainer is None:
            warnings.warn(
                "NebulaCallback could not find its Trainer; call callback.attach(trainer) "
                "before train()",
                stacklevel=2,
            )
            return
        self.attach(trainer)

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.trainer is not None:
            return
        trainer = _find_trainer(self)
        if trainer is None:
            raise InvalidArgumentError(
                "NebulaCallback is not attached to its Trainer: call callback.attach(trainer)"
            )
        warnings.warn(
            "NebulaCallback was attached when training began (added with add_callback?): "
            "saving goes through nebula, but resuming needs callback.attach(trainer) "
            "before train()",
            stacklevel=2,
        )
        self.attach(trainer)

    # attaching --------------------------------------------------------------------------
    def attach(self, trainer: Trainer) -> None:
        """Start nebula (`nm.init` with this callback's arguments) and route this
        Trainer's checkpoints through it. Idempotent."""
        if self.trainer is trainer:
            return
        if self.trainer is not None:
            raise InvalidArgumentError("this NebulaCallback is attached to another Trainer")
        _refuse_unsupported(trainer)
        missing = [name for name in HOOKED if not callable(getattr(Trainer, name, None))]
        if missing:
            import transformers

            raise InvalidArgumentError(
                f"NebulaCallback hooks Trainer methods that transformers "
                f"{transformers.__version__} does not have ({', '.join(missing)}); it is "
                f"tested with transformers 5.23"
            )
        if trainer.args.push_to_hub:
            warnings.warn(
                "NebulaCallback: checkpoints go to nebula, not to the Hub (push_to_hub pushes "
                "trainer.save_model() as usual; export a checkpoint with "
                "nebulaml.transformers.export_pretrained)",
                stacklevel=3,
            )
        self._start(trainer.args)
        ensure_session("NebulaCallback", max(1, trainer.args.world_size))
        self.trainer = trainer
        for name in HOOKED:
            self._originals[name] = getattr(trainer, name)
            hook = getattr(type(self), "_hook_" + name.lstrip("_"))
            trainer.__dict__[name] = MethodType(hook, self)

    def _attached(self) -> Any:
        """The Trainer this callback hooks (typed Any: the Trainer declares its optimizer,
        scheduler and model Optional, and they are all set once training runs)."""
        if self.trainer is None:
            raise InvalidArgumentError("NebulaCallback is not attached to a Trainer")
        return self.trainer

    def _start(self, args: Any) -> None:
        retention = self.num_of_version_in_retention
        if retention is None and args.save_total_limit is not None:
            retention = max(1, int(args.save_total_limit))
        explicit = (
            self.persistent_storage_path is not None
            or self.persistent_time_interval is not None
            or self.num_of_version_in_retention is not None
            or self.init_options
        )
        if not explicit and _session.current_or_none() is not None:
            return  # the session the program started (nm.init) is the one to use
        init(
            self.persistent_storage_path,
            self.persistent_time_interval,
            retention,
            **self.init_options,
        )

    # saving -----------------------------------------------------------------------------
    # Each `_hook_<name>` replaces the Trainer method `[_]<name>` on the instance; `self` is
    # the callback, `self.trainer` the Trainer.
    def _hook_save_checkpoint(self, model: Any, trial: Any) -> None:
        trainer = self._attached()
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
            yield "model", trainer.model.state_dict()
            config = model_config(trainer.model)
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
        self._rotate()

    def _rotate(self) -> None:
        """The Trainer's rotation, over nebula's checkpoints: what the Trainer's own
        `rotate_checkpoints` would delete of `checkpoint-<N>` folders (the limit:
        `num_of_version_in_retention` when passed, else `save_total_limit`; None keeps
        every one, as the Trainer) goes from every tier. The checkpoints are those this
        process knows: committed in its memory tier, and durable as its persister knows
        (the training thread never lists the persistent tier). Every rank does it, for its
        own parts; rank 0's persister deletes the persistent copies."""
        trainer = self._attached()
        limit = self.num_of_version_in_retention or trainer.args.save_total_limit
        session = _session.live()
        if session is None or limit is None or limit <= 0:
            return
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

    # resuming ---------------------------------------------------------------------------
    def _hook_train(
        self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any
    ) -> Any:
        original = self._originals["train"]
        checkpoint = self._resolve(resume_from_checkpoint)
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
            self._resume = _Resume(checkpoint, path, best)
            log.info("resuming from nebula checkpoint %r", checkpoint.tag)
            return original(path, *args, **kwargs)
        finally:
            self._resume = None
            shutil.rmtree(folder, ignore_errors=True)

    def _resolve(self, resume: str | bool | None) -> Checkpoint | str | None:
        """What `train(resume_from_checkpoint=...)` resumes from: nebula's checkpoint, a
        checkpoint folder on disk (the Trainer loads it itself), or None (no resume)."""
        trainer = self._attached()
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
        resume = self._resume
        if resume is not None and checkpoint is not None and os.fspath(checkpoint) == resume.path:
            return resume.checkpoint
        return None

    def _hook_load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        checkpoint = self._ours(resume_from_checkpoint)
        if checkpoint is None:
            return self._originals["_load_from_checkpoint"](resume_from_checkpoint, model)
        trainer = self._attached()
        target = trainer.model if model is None else model
        result = target.load_state_dict(checkpoint.load("model", map_location="cpu"), False)
        trainer._issue_warnings_after_load(result)
        return None

    def _hook_load_optimizer_and_scheduler(self, checkpoint_path: str | None) -> None:
        checkpoint = self._ours(checkpoint_path)
        if checkpoint is None:
            return self._originals["_load_optimizer_and_scheduler"](checkpoint_path)
        trainer = self._attached()
        args = trainer.args
        device = args.device
        on_device = args.world_size > 1 and device.type != "cpu"
        optimizer = load_optional(checkpoint, "optimizer", device if on_device else "cpu")
        scheduler = load_optional(checkpoint, "scheduler")
        if optimizer is not None and scheduler is not None:
            trainer.optimizer.load_state_dict(optimizer)
            trainer.lr_scheduler.load_state_dict(scheduler)
        return None

    def _hook_load_scaler(self, checkpoint_path: str | None) -> None:
        checkpoint = self._ours(checkpoint_path)
        if checkpoint is None:
            return self._originals["_load_scaler"](checkpoint_path)
        scaler = getattr(self._attached().accelerator, "scaler", None)
        state = load_optional(checkpoint, "scaler") if scaler is not None else None
        if scaler is not None and state is not None:
            scaler.load_state_dict(state)
        return None

    def _hook_load_rng_state(self, checkpoint_path: str | None) -> None:
        checkpoint = self._ours(checkpoint_path)
        if checkpoint is None:
            return self._originals["_load_rng_state"](checkpoint_path)
        trainer = self._attached()
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
            return None
        restore_rng(state)
        return None

    def _hook_init_training_state(self, *args: Any, **kwargs: Any) -> Any:
        result = self._originals["_init_training_state"](*args, **kwargs)
        resume = self._resume
        trainer = self.trainer
        if resume is not None and trainer is not None and resume.best_model_checkpoint:
            best = resume.best_model_checkpoint
            if find(tag_for_path(best)) is not None or os.path.isdir(best):
                trainer.state.best_model_checkpoint = best
            else:
                log.warning(
                    "the best checkpoint %s recorded in the resumed state is gone; ignoring it",
                    best,
                )
        return result

    def _hook_load_best_model(self) -> None:
        trainer = self._attached()
        best = trainer.state.best_model_checkpoint
        checkpoint = find(tag_for_path(best)) if best else None
        if checkpoint is None:
            return self._originals["_load_best_model"]()
        log.info(
            "loading the best model from nebula checkpoint %r (score: %s)",
            checkpoint.tag,
            trainer.state.best_metric,
        )
        state_dict = checkpoint.load("model", map_location="cpu")
        trainer._issue_warnings_after_load(trainer.model.load_state_dict(state_dict, False))
        return None


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


def _find_trainer(callback: NebulaCallback) -> Trainer | None:
    """The Trainer whose callbacks hold `callback`, from the calling frames (the Trainer
    calls its callbacks through its CallbackHandler, and hands them no reference to it)."""
    frame: FrameType | None = sys._getframe(1)
    for _ in range(16):
        if frame is None:
            return None
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, Trainer) and any(
            cb is callback for cb in candidate.callback_handler.callbacks
        ):
            return candidate
        frame = frame.f_back
    return None


def _refuse_unsupported(trainer: Trainer) -> None:
    from transformers.utils import is_sagemaker_mp_enabled, is_torch_xla_available

    why = None
    if trainer.is_deepspeed_enabled:
        why = "DeepSpeed saves its own checkpoints: enable nebula in its config ('nebula' block)"
    elif trainer.is_fsdp_enabled or getattr(trainer, "is_fsdp_xla_enabled", False):
        why = "FSDP checkpoints are sharded; NebulaCallback saves whole states"
    elif is_sagemaker_mp_enabled() or is_torch_xla_available():
        why = "SageMaker model parallelism and XLA save through their own calls"
    if why is not None:
        raise InvalidArgumentError(f"NebulaCallback does not support this Trainer: {why}")


# export ---------------------------------------------------------------------------------
def export_pretrained(
    root: str | os.PathLike[str],
    tag: str | None,
    dest: str | os.PathLike[str],
    *,
    model_class: Any = None,
    private: bool | None = None,
) -> Path:
    """Write the checkpoint `tag` of `root` (the newest when None) as a Hugging Face model
    folder `dest`: `model.safetensors` and `config.json` (and `generation_config.json`),
    which `AutoModel.from_pretrained(dest)` or the model's class loads; returns `dest`.

    The files get the mode any program's new file gets (the umask: 0644 typically, so a
    serving process of another user reads them); with `private` (None: `NEBULA_PRIVATE`)
    they are 0600, and a `dest` created here is 0700 (the folders above it that were
    missing too).

    The model is built from the saved config (`model_class`, default the class named in
    `config.architectures`) and written with `save_pretrained`, so tied weights and
    sharding follow transformers' own rules. Tokenizers are not in nebula checkpoints: save
    yours into `dest` (`tokenizer.save_pretrained(dest)`).
    """
    import transformers
    from transformers import AutoConfig

    checkpoint = find(tag, root)
    if checkpoint is None:
        raise CheckpointNotFoundError(os.fspath(root), tag or "(the newest)")
    config_text = load_optional(checkpoint, "config")
    if config_text is None:
        raise InvalidArgumentError(
            f"checkpoint {checkpoint.tag!r} has no item 'config': its model was not a "
            f"transformers PreTrainedModel, so there is no config to export"
        )
    dest_path = Path(dest)
    private = private_default() if private is None else private
    make_folders(str(dest_path), private)  # private: 0700, the missing folders above it too
    with tempfile.TemporaryDirectory(prefix="nebula-export-") as scratch:
        Path(scratch, "config.json").write_text(config_text, encoding="utf-8")
        config = AutoConfig.from_pretrained(scratch, local_files_only=True)
    if model_class is None:
        names = getattr(config, "architectures", None) or []
        model_class = getattr(transformers, names[0], None) if names else None
        if model_class is None:
            model_class = transformers.AutoModel
    if hasattr(model_class, "from_config"):  # an Auto class
        model = model_class.from_config(config)
    else:
        model = model_class(config)
    state_dict = checkpoint.load("model", map_location="cpu")
    floating = [t.dtype for t in state_dict.values() if t.is_floating_point()]
    if floating:
        model.to(floating[0])  # as trained (bf16 stays bf16)
    result = model.load_state_dict(state_dict, strict=False)
    if result.unexpected_keys or result.missing_keys:
        raise InvalidArgumentError(
            f"checkpoint {checkpoint.tag!r} does not fit {type(model).__name__}: missing "
            f"keys {result.missing_keys[:5]}, unexpected keys {result.unexpected_keys[:5]}"
        )
    generation_text = load_optional(checkpoint, "generation_config")
    if generation_text and getattr(model, "generation_config", None) is not None:
        with contextlib.suppress(ValueError, TypeError):
            model.generation_config = type(model.generation_config).from_dict(
                load_json(generation_text, max_bytes=MAX_MANIFEST_BYTES)
            )
    before = _files(dest_path)
    model.save_pretrained(dest_path)
    mode = new_file_mode(str(dest_path), private)
    for name, identity in _files(dest_path).items():
        if before.get(name) != identity:  # written by save_pretrained (safetensors: 0600)
            os.chmod(dest_path / name, mode, follow_symlinks=False)
    return dest_path


def _files(folder: Path) -> dict[str, tuple[int, int]]:
    """The regular files directly in `folder`: {name: (inode, modification time in ns)}."""
    found = {}
    with os.scandir(folder) as entries:
        for entry in entries:
            if entry.is_file(follow_symlinks=False):
                st = entry.stat(follow_symlinks=False)
                found[entry.name] = (st.st_ino, st.st_mtime_ns)
    return found
