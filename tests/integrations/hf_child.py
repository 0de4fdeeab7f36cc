"""A Hugging Face training process that checkpoints through nebula (run by
test_transformers.py, which also imports its model and data helpers).

Usage: hf_child.py MODE SPEC_JSON. SPEC_JSON holds `root` (the persistent root), `out`
(where this process writes its result JSON; `{rank}` is replaced), `output_dir` (the
Trainer's), `max_steps`, `save_steps`, `interval` (the persistent time interval),
`retention`, and optionally `kill_at` (SIGKILL this process right after the save at that
step), `stop_at` (stop training, cleanly, after the save at that step), `flush` (True:
persist every checkpoint, none skipped by the interval; a list: the saves at those steps),
`resume` (True: resume from nebula's newest; a path: from that checkpoint) and
`start_state` (where to torch.save the state training starts from: model, optimizer,
scheduler, global step; `{rank}` is replaced). A JSON list of such specs runs them one
after another in this process.

MODE "trainer": a tiny GPT-2 (built from a config, no downloads) trained by a `Trainer`
with `NebulaCallback`; under RANK / WORLD_SIZE (as a launcher sets them) it is a DDP job
over gloo. MODE "accelerate": a small torch model with dropout in an Accelerate loop saving
with `nebulaml.accelerate.save_state` every `save_steps` and resuming with `load_state`.
The result JSON holds the loss of every step this process trained, and the global step
it started from.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import torch

VOCAB, SEQ, SAMPLES, BATCH = 64, 8, 32, 4


def tiny_gpt2(seed: int = 0) -> Any:
    """A 2-layer GPT-2 with dropout (so a resume needs the RNG states), from a config."""
    from transformers import GPT2Config, GPT2LMHeadModel, set_seed

    set_seed(seed)
    config = GPT2Config(
        n_layer=2,
        n_embd=32,
        n_head=2,
        vocab_size=VOCAB,
        n_positions=16,
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(config)


class Tokens(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Fixed random token sequences: the labels are the inputs (causal LM)."""

    def __init__(self, n: int = SAMPLES, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, VOCAB, (n, SEQ), generator=gen)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def training_args(out: str, **kwargs: Any) -> Any:
    from transformers import TrainingArguments

    options: dict[str, Any] = dict(
        output_dir=out,
        per_device_train_batch_size=BATCH,
        logging_steps=1,
        save_strategy="steps",
        report_to=[],
        seed=0,
        use_cpu=True,
        disable_tqdm=True,
        learning_rate=1e-3,
        warmup_steps=2,
        dataloader_num_workers=0,
    )
    options.update(kwargs)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        options.update(ddp_backend="gloo", ddp_find_unused_parameters=False)
    return TrainingArguments(**options)


def losses(log_history: list[dict[str, Any]]) -> dict[int, list[float]]:
    """step -> [loss, grad_norm, learning_rate], for every step that logged a loss."""
    return {
        int(h["step"]): [h["loss"], h["grad_norm"], h["learning_rate"]]
        for h in log_history
        if "loss" in h
    }


def run_trainer(spec: dict[str, Any]) -> dict[str, Any]:
    from transformers import Trainer, TrainerCallback

    import nebulaml as nm
    from nebulaml.transformers import NebulaCallback

    class Control(TrainerCallback):
        """Record where training starts; die or stop right after a chosen save."""

        def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self.start = state.global_step
            if spec.get("start_state"):
                torch.save(
                    {
                        "model": kw["model"].state_dict(),
                        "optimizer": kw["optimizer"].state_dict(),
                        "scheduler": kw["lr_scheduler"].state_dict(),
                        "global_step": state.global_step,
                    },
                    spec["start_state"].format(rank=args.process_index),
                )

        def on_save(self, args: Any, state: Any, control: Any, **kw: Any) -> Any:
            if spec.get("flush") is True or state.global_step in (spec.get("flush") or ()):
                nm.flush_persistence()  # persisted before training goes on
            if state.global_step == spec.get("kill_at"):
                nm.wait_for_snapshot()  # acknowledged: its lazy copy (the default) taken
                os.kill(os.getpid(), signal.SIGKILL)
            if state.global_step == spec.get("stop_at"):
                control.should_training_stop = True
            return control

    control = Control()
    trainer = Trainer(
        model=tiny_gpt2(),
        args=training_args(
            spec["output_dir"], max_steps=spec["max_steps"], save_steps=spec["save_steps"]
        ),
        train_dataset=Tokens(),
        callbacks=[
            NebulaCallback(
                persistent_storage_path=spec["root"],
                persistent_time_interval=spec["interval"],
                num_of_version_in_retention=spec["retention"],
            ),
            control,
        ],
    )
    trainer.train(resume_from_checkpoint=spec.get("resume") or None)
    return {
        "start": control.start,
        "global_step": trainer.state.global_step,
        "losses": losses(trainer.state.log_history),
        "output_dir": sorted(os.listdir(spec["output_dir"]))
        if os.path.isdir(spec["output_dir"])
        else [],
    }


class DropoutNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(32, 1)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def run_accelerate(spec: dict[str, Any]) -> dict[str, Any]:
    from accelerate import Accelerator

    import nebulaml as nm
    import nebulaml.accelerate as nma

    nm.init(spec["root"], spec["interval"], spec["retention"])
    torch.manual_seed(0)
    accelerator = Accelerator(cpu=True)
    model = DropoutNet()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
    gen = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(
        torch.randn(spec["max_steps"] * BATCH, 8, generator=gen),
        torch.randn(spec["max_steps"] * BATCH, 1, generator=gen),
    )
    # Not prepared, and with its own generator: iterating it draws nothing from the global
    # RNG, so the dropout masks are the only draws (Accelerate's loader draws a seed when
    # its iterator starts: after load_state on a resume, before the first step otherwise).
    loader = torch.utils.data.DataLoader(
        data, batch_size=BATCH, generator=torch.Generator().manual_seed(2)
    )
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    start = 0
    if spec.get("resume"):
        tag = nma.load_state(accelerator)
        assert tag is not None, "nothing to resume from"
        start = int(tag.removeprefix("global_step"))
    result: dict[str, Any] = {"start": start, "losses": {}}
    for step, (x, y) in enumerate(itertools.islice(loader, start, None), start=start + 1):
        loss = torch.nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        result["losses"][step] = [loss.item()]
        if step % spec["save_steps"] == 0:
            nma.save_state(accelerator, f"global_step{step}")
            if spec.get("flush") is True or step in (spec.get("flush") or ()):
                nm.flush_persistence()
            if step == spec.get("kill_at"):
                nm.wait_for_snapshot()  # acknowledged: its lazy copy (the default) taken
                os.kill(os.getpid(), signal.SIGKILL)
    result["global_step"] = spec["max_steps"]
    return result


def main() -> None:
    mode, specs = sys.argv[1], json.loads(sys.argv[2])
    rank = int(os.environ.get("RANK", "0"))
    for spec in specs if isinstance(specs, list) else [specs]:  # a list: one run after another
        result = run_trainer(spec) if mode == "trainer" else run_accelerate(spec)
        Path(spec["out"].format(rank=rank)).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
