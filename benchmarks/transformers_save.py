"""The Hugging Face Trainer's save stall: its own save against `NebulaCallback`'s (issue #20).

    python benchmarks/transformers_save.py [--steps 5] [--layers 12] [--lazy]

One process, one GPT-2-small-sized model built from a config (`GPT2Config()`: 12 layers,
768 wide, vocabulary 50257, 124M parameters; nothing downloaded), trained by two Trainers
in turn from the same initial weights, each saving after every step (`save_steps=1`,
`save_total_limit=2`): first the Trainer's own save (model.safetensors, optimizer.pt,
scheduler, RNG and trainer state written into `output_dir` on local disk), then the same
run with `NebulaCallback` (nebula's defaults: the memory tier, a persistent root on the
same disk, `persistent_time_interval` 100 s). The stall is the wall time of the Trainer's
`_save_checkpoint`, during which training waits; the first save of each run is shown
apart (nebula plans its layout and maps its buffers then), the figure is the median of
the others. `--lazy` adds a third run with `lazy_snapshot=True` (its stall leaves the big
copies to the background; the next optimizer step waits for them, and the total time
shows it).

Prints both stalls, the ratio, and each run's total training time. Not a test.
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

SEQ = 32


class Tokens(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __init__(self, n: int, vocab: int) -> None:
        self.ids = torch.randint(0, vocab, (n, SEQ), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def run(name: str, layers: int, steps: int, workdir: Path, callbacks: list[Any]) -> dict[str, Any]:
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments, set_seed

    set_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=layers))
    params = sum(p.numel() for p in model.parameters())
    args = TrainingArguments(
        output_dir=str(workdir / f"{name}-output"),
        per_device_train_batch_size=1,
        max_steps=steps,
        save_steps=1,
        save_total_limit=2,
        logging_steps=1000,
        report_to=[],
        seed=0,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    trainer = Trainer(
        model=model, args=args, train_dataset=Tokens(steps, 50257), callbacks=callbacks
    )
    stalls: list[float] = []
    save = trainer._save_checkpoint  # the Trainer's own, or NebulaCallback's hook

    def timed(model: Any, trial: Any) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        save(model, trial)
        stalls.append(time.perf_counter() - t0)

    trainer.__dict__["_save_checkpoint"] = timed
    t0 = time.perf_counter()
    trainer.train()
    total = time.perf_counter() - t0
    state_bytes = sum(p.numel() * p.element_size() for p in model.parameters()) * 3  # + Adam
    del trainer, model
    gc.collect()
    return {"name": name, "stalls": stalls, "total": total, "params": params, "bytes": state_bytes}


def show(result: dict[str, Any]) -> float:
    stalls = result["stalls"]
    median = statistics.median(stalls[1:]) if len(stalls) > 1 else stalls[0]
    rest = " ".join(f"{s * 1000:.0f}" for s in stalls[1:])
    print(
        f"  {result['name']:<22} stall {median * 1000:8.0f} ms (median; first save "
        f"{stalls[0] * 1000:.0f} ms; the others {rest} ms)   train() {result['total']:.1f} s"
    )
    return median


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=5, help="training steps, one save each")
    parser.add_argument("--layers", type=int, default=12, help="GPT-2 layers (12: 124M)")
    parser.add_argument("--lazy", action="store_true", help="also nebula with lazy_snapshot")
    options = parser.parse_args(argv)

    import nebulaml as nm
    from nebulaml.transformers import NebulaCallback

    workdir = Path(tempfile.mkdtemp(prefix="nebula-hf-bench-", dir=os.environ.get("TMPDIR")))
    runs: list[tuple[str, Callable[[], list[Any]]]] = [
        ("Trainer's own save", list),
        ("NebulaCallback", lambda: [NebulaCallback(persistent_storage_path=workdir / "root")]),
    ]
    if options.lazy:
        runs.append(
            (
                "NebulaCallback, lazy",
                lambda: [
                    NebulaCallback(
                        persistent_storage_path=workdir / "root-lazy", lazy_snapshot=True
                    )
                ],
            )
        )
    try:
        results = []
        for name, callbacks in runs:
            results.append(run(name, options.layers, options.steps, workdir, callbacks()))
            if name != runs[0][0]:
                nm.shutdown()  # persist what is pending before the next run, not during it
        first = results[0]
        device = "cuda" if torch.cuda.is_available() else "cpu"
        print(
            f"GPT-2 from GPT2Config(n_layer={options.layers}): {first['params'] / 1e6:.0f}M "
            f"parameters, {first['bytes'] / 2**30:.2f} GiB of weights and AdamW state; "
            f"{options.steps} steps, a save after each; {device}, "
            f"{torch.get_num_threads()} threads, torch {torch.__version__}"
        )
        medians = [show(result) for result in results]
        for result, median in zip(results[1:], medians[1:], strict=True):
            print(
                f"  ratio, Trainer's own / {result['name']}: {medians[0] / median:.1f}x "
                f"shorter stall"
            )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
