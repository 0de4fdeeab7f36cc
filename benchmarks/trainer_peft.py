"""A peft LoRA fine-tune under the Hugging Face Trainer (issue #48): the bytes each
checkpoint writes, with `NebulaCallback` against the Trainer's own files, counted where
they land.

    python benchmarks/trainer_peft.py [--work DIR] [--steps 12] [--save-steps 2]

The model: a GPT-2-style config built here, no download (6 layers, 384 wide, a vocabulary
of 8192: 14 M parameters, 56 MB in fp32), wrapped by peft in a LoRA adapter (r=8 on
`c_attn` and `c_fc`: 0.17 M parameters), trained by the real `Trainer` with AdamW on
random tokens, a checkpoint every `--save-steps`. The same run twice in this process:

  native   the Trainer's own checkpoint folders (`checkpoint-<N>` in the work folder)
  nebula   `NebulaCallback`, persisting to a root in the work folder at every save
           (`persistent_time_interval=0`, and `nm.flush_persistence()` in `on_save`: the
           persist is inside the measurement), its memory tier in a folder of /dev/shm

Per checkpoint:

  disk     `write_bytes` of /proc/self/io (every thread of this process: the Trainer
           writes in the training thread, nebula's persister in its own) from `on_step_end`
           (before the Trainer saves) to `on_save` (after it, and after the flush): what the
           kernel counts as sent to the disk for this process (pages dirtied, direct I/O,
           the in-kernel copies of `copy_file_range`), not what passed through user space
  memory   nebula: the `bytes_written` of the checkpoint's `memory` rows in
           checkpointHistories.csv (what the save copied into the memory tier, a tmpfs,
           whose writes /proc/self/io does not count) and the checkpoint's size there
  files    the size of what one checkpoint holds: native, its folder; nebula, its items

Target (issue #48): nebula's bytes per checkpoint <= 1.2 x the Trainer's own, on the disk
and in the memory tier. The first checkpoint of each run is reported apart (nebula writes
its first version of each item whole; after it, an item equal to its previous version
costs only its changed blocks on the disk: protocol/reuse.py). Figures go to
benchmarks/results/trainer-peft.json.

Not for: the LoRA workload of synthetic tensors (lora.py) or the Trainer's save stall
(transformers_save.py).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

import measure
import torch

RESULTS = Path(__file__).resolve().parent / "results"
TARGET = 1.2
VOCAB, SEQ, SAMPLES = 8192, 64, 64


def write_bytes() -> int:
    """This process's `write_bytes` (every thread's) from /proc/self/io (measure.py's
    reader); this workload has no figure without it."""
    counted = measure.write_bytes()
    if counted is None:
        raise RuntimeError("no write_bytes in /proc/self/io")
    return counted


class Tokens(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __init__(self) -> None:
        self.ids = torch.randint(
            0, VOCAB, (SAMPLES, SEQ), generator=torch.Generator().manual_seed(0)
        )

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def peft_model() -> Any:
    from peft import LoraConfig, get_peft_model
    from transformers import GPT2Config, GPT2LMHeadModel, set_seed

    set_seed(0)
    config = GPT2Config(n_layer=6, n_embd=384, n_head=6, vocab_size=VOCAB, n_positions=SEQ)
    lora = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.05, target_modules=["c_attn", "c_fc"])
    return get_peft_model(GPT2LMHeadModel(config), lora)


def run(output_dir: Path, args: argparse.Namespace, nebula_root: Path | None) -> dict[str, Any]:
    """Train once; returns the disk bytes of each save (in step order) and the run's facts."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    import nebulaml as nm

    class Meter(TrainerCallback):
        def __init__(self) -> None:
            self.before = 0
            self.saves: list[int] = []

        def on_step_end(self, *_a: Any, **_k: Any) -> None:
            self.before = write_bytes()

        def on_save(self, *_a: Any, **_k: Any) -> None:
            if nebula_root is not None:
                nm.flush_persistence()
            self.saves.append(write_bytes() - self.before)

    meter = Meter()
    callbacks: list[Any] = [meter]
    if nebula_root is not None:
        from nebulaml.transformers import NebulaCallback

        callbacks.insert(
            0, NebulaCallback(persistent_storage_path=str(nebula_root), persistent_time_interval=0)
        )
    training = TrainingArguments(
        output_dir=str(output_dir),
        per_device_train_batch_size=4,
        max_steps=args.steps,
        save_strategy="steps",
        save_steps=args.save_steps,
        learning_rate=1e-3,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        logging_steps=args.steps,
        seed=0,
    )
    model = peft_model()
    trainer = Trainer(model=model, args=training, train_dataset=Tokens(), callbacks=callbacks)
    trainer.train()
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return {
        "saves": meter.saves,
        "parameters": sum(p.numel() for p in model.parameters()),
        "trainable": trainable,
    }


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def nebula_memory(root: Path) -> tuple[list[int], list[int]]:
    """Per checkpoint, in step order: the bytes copied into the memory tier (history) and
    the checkpoint's size (its items)."""
    import nebulaml as nm

    df = nm.ops.read_history(str(root))
    memory = df[(df["tier"] == "memory") & (df["status"] == "ok")]
    copied = [int(memory[memory["tag"] == tag]["bytes_written"].sum()) for tag in _tags(root)]
    sizes = {c["tag"]: c["size_bytes"] for c in nm.list_checkpoints(str(root))}
    return copied, [sizes[tag] for tag in _tags(root)]


def _tags(root: Path) -> list[str]:
    import nebulaml as nm

    return sorted((c["tag"] for c in nm.list_checkpoints(str(root))), key=nm_step)


def nm_step(tag: str) -> int:
    return int(tag.removeprefix("global_step"))


def summary(values: list[int]) -> dict[str, Any]:
    """The first value apart, the median of the others."""
    rest = values[1:] or values
    return {"first": values[0], "median_after_first": statistics.median(rest), "all": values}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="trainer_peft.py", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--work", type=Path, help="a folder on the disk to measure (default: the temporary folder)"
    )
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--save-steps", type=int, default=2)
    parser.add_argument("--json", type=Path, default=RESULTS / "trainer-peft.json")
    args = parser.parse_args(argv)
    if args.work is not None and not args.work.is_dir():
        parser.error(f"--work {args.work}: no such folder (make it first, on the disk to measure)")
    warnings.filterwarnings("ignore")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    work = Path(tempfile.mkdtemp(prefix="nebula-peft-", dir=args.work))
    tier = Path(
        tempfile.mkdtemp(
            prefix="nebula-peft-tier-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None
        )
    )
    os.environ["NEBULA_MEMORY_TIER_PATH"] = str(tier)
    try:
        from bench import fs_type

        import nebulaml as nm

        print("native: the Trainer's own checkpoints ...", file=sys.stderr)
        native = run(work / "native", args, None)
        native_files = [
            folder_bytes(p)
            for p in sorted(
                (work / "native").glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1])
            )
        ]
        print("nebula: NebulaCallback ...", file=sys.stderr)
        root = work / "root"
        ours = run(work / "nebula-out", args, root)
        copied, sizes = nebula_memory(root)
        nm.shutdown()
        doc = {
            "work_fs_type": fs_type(work),
            "memory_tier_fs_type": fs_type(tier),
            "steps": args.steps,
            "save_steps": args.save_steps,
            "parameters": native["parameters"],
            "trainable": native["trainable"],
            "native": {"disk": summary(native["saves"]), "files": summary(native_files)},
            "nebula": {
                "disk": summary(ours["saves"]),
                "memory_copied": summary(copied),
                "files": summary(sizes),
            },
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(tier, ignore_errors=True)
    base = doc["native"]["disk"]["median_after_first"]
    ratios = {
        "disk": doc["nebula"]["disk"]["median_after_first"] / base,
        "memory": doc["nebula"]["memory_copied"]["median_after_first"] / base,
        "disk_first": doc["nebula"]["disk"]["first"] / doc["native"]["disk"]["first"],
    }
    doc["ratios"] = ratios
    doc["target"] = TARGET
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    render(doc)
    return 0 if ratios["disk"] <= TARGET and ratios["memory"] <= TARGET else 1


def render(doc: dict[str, Any]) -> None:
    mb = 1e6
    n, o = doc["native"], doc["nebula"]
    print(
        f"peft LoRA under the Trainer: {doc['parameters'] / 1e6:.1f} M parameters, "
        f"{doc['trainable'] / 1e6:.2f} M trainable; {doc['steps']} steps, a checkpoint every "
        f"{doc['save_steps']}; work folder on {doc['work_fs_type']}, memory tier on "
        f"{doc['memory_tier_fs_type']}"
    )
    print(f"{'MB per checkpoint':<44}{'first':>8}{'later (median)':>16}")
    rows = [
        ("native Trainer: disk (write_bytes)", n["disk"]),
        ("native Trainer: its checkpoint folder", n["files"]),
        ("nebula: disk (write_bytes, persist included)", o["disk"]),
        ("nebula: copied into the memory tier", o["memory_copied"]),
        ("nebula: the checkpoint's items", o["files"]),
    ]
    for label, s in rows:
        print(f"{label:<44}{s['first'] / mb:>8.2f}{s['median_after_first'] / mb:>16.2f}")
    r = doc["ratios"]
    for key, label in (("disk", "disk"), ("memory", "memory tier")):
        verdict = "met" if r[key] <= doc["target"] else "MISSED"
        print(f"nebula / native, {label}: {r[key]:.2f}x (target <= {doc['target']}x: {verdict})")


if __name__ == "__main__":
    sys.exit(main())
