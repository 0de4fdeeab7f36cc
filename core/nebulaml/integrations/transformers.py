"""The Hugging Face Trainer through nebula: `NebulaCallback`, and how it hooks its Trainer
(`nebulaml.transformers` is the public module built on it).

How the Trainer is hooked: a `TrainerCallback` alone cannot do it. Saving happens in
`Trainer._save_checkpoint` (synchronous writes into `output_dir`), and
`train(resume_from_checkpoint=True)` looks for `checkpoint-*` folders in `output_dir`
before any callback runs. So the callback, on `on_init_end` (called from the Trainer's
`__init__`, whose frame holds the Trainer: callbacks are not handed it), replaces a few of
that one Trainer's methods on the instance (its class, and every other Trainer, are left
alone):

- `_save_checkpoint` (trainer_saving.py): every save the Trainer makes (`save_strategy`,
  `save_steps`, the final save, `save_strategy="best"`) becomes the nebula checkpoint
  `global_step<N>`: items `model`, `config` (+ `generation_config`), `optimizer`,
  `scheduler`, `scaler`, `trainer_state` (the JSON `trainer_state.json` would hold) and
  `rng_state` (one per process under DDP: `rng_state_<i>`). Rank 0 saves the rest; every
  rank commits. A checkpoint that is the best so far (`metric_for_best_model`) is
  labelled `best`. The Trainer's rotation is the retention: each checkpoint is labelled
  `transformers` (nebula's count never drops one, the interval never skips one), and
  after each save the Trainer's own `rotate_checkpoints` decides, over nebula's
  checkpoints, what goes (`save_total_limit`, the best and the newest kept); every rank
  hands those to its persister to delete (`Persister.forget`).
- `train` (trainer_resuming.py): `resume_from_checkpoint=True` takes nebula's newest
  checkpoint (the memory tier after a crash, else the persistent tier); a path
  `.../checkpoint-<N>` (or a tag) takes that checkpoint. A real checkpoint folder on disk
  still resumes as the Trainer would.
- `_load_from_checkpoint`, `_load_optimizer_and_scheduler`, `_load_scaler`,
  `_load_rng_state`, `_init_training_state`, `_load_best_model` (trainer_resuming.py):
  read those items (verified, weights_only=True) instead of files, when the resume path
  is nebula's.

`state.best_model_checkpoint` keeps the Trainer's form (`<output_dir>/checkpoint-<N>`):
nothing is written there; `tag_for_path` (trainer_tags.py) gives its tag. Not supported
(refused when the Trainer is built): DeepSpeed (use its own `"nebula"` config block),
FSDP, XLA, SageMaker MP; `push_to_hub` of checkpoints is not done (a warning says so).

May import: the public API, the layers below, hf_common.py, trainer_saving.py,
trainer_resuming.py and transformers.

Not for: what a save writes or a resume reads (trainer_saving.py, trainer_resuming.py);
exporting a model folder (trainer_export.py); Accelerate's own loop
(integrations/accelerate.py); Lightning (lightning_common.py); nebula's semantics
(checkpoint.py, api.py).
"""

from __future__ import annotations

import os
import sys
import warnings
from types import FrameType
from typing import Any

from transformers import Trainer, TrainerCallback

from nebulaml.api import init
from nebulaml.errors import InvalidArgumentError
from nebulaml.integrations.hf_common import ensure_session
from nebulaml.integrations.trainer_resuming import TrainerResuming
from nebulaml.integrations.trainer_saving import TrainerSaving
from nebulaml.runtime import session as _session


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
        self._originals: dict[str, Any] = {}  # the Trainer's own methods it replaced

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
        hooks = _hooks(trainer, self.num_of_version_in_retention, self._originals)
        missing = [name for name, _hook in hooks if not callable(getattr(Trainer, name, None))]
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
        for name, hook in hooks:
            self._originals[name] = getattr(trainer, name)
            trainer.__dict__[name] = hook

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


def _hooks(
    trainer: Trainer, retention: int | None, originals: dict[str, Any]
) -> list[tuple[str, Any]]:
    """(the name of a Trainer method, what replaces it on `trainer`) for each method the
    callback hooks: saving's (trainer_saving.py) and resuming's (trainer_resuming.py),
    which calls `originals` (the Trainer's own, kept as they are replaced) when the
    resume path is not nebula's."""
    saving = TrainerSaving(trainer, retention)
    resuming = TrainerResuming(trainer, originals)
    return [
        ("_save_checkpoint", saving.save_checkpoint),
        ("train", resuming.train),
        ("_load_from_checkpoint", resuming.load_from_checkpoint),
        ("_load_optimizer_and_scheduler", resuming.load_optimizer_and_scheduler),
        ("_load_scaler", resuming.load_scaler),
        ("_load_rng_state", resuming.load_rng_state),
        ("_init_training_state", resuming.init_training_state),
        ("_load_best_model", resuming.load_best_model),
    ]


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
