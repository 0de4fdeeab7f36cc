"""A peft LoRA fine-tune under the Hugging Face Trainer through nebula (issue #48): a
checkpoint holds what the Trainer's own holds (the adapter, not the frozen base), and a
resume from it is bit-identical to the Trainer's own resume.

The same tiny GPT-2 (hf_child.py, with dropout: a resume needs the RNG states) wrapped in a
LoRA adapter (with dropout too) trains 4 steps, saving at 2 and 4, once with the Trainer's
own files and once with `NebulaCallback`; each run is then resumed from its step-2
checkpoint by a fresh Trainer and trained to step 4. What each checkpoint holds and what
each resume ends with are compared.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from frameworks import require, same

import nebulaml as nm

STEPS, SAVE = 4, 2


@pytest.fixture(autouse=True)
def _frameworks() -> None:
    require("transformers")
    require("peft")


def _trainer(output_dir: Path, callbacks: list[Any]) -> Any:
    from hf_child import Tokens, tiny_gpt2, training_args
    from peft import LoraConfig, get_peft_model
    from transformers import Trainer

    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1, target_modules=["c_attn", "c_fc"])
    model = get_peft_model(tiny_gpt2(), lora)
    args = training_args(str(output_dir), max_steps=STEPS, save_steps=SAVE)
    return Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=callbacks)


def _resumed(trainer: Any, resume_from: str) -> dict[str, Any]:
    trainer.train(resume_from_checkpoint=resume_from)
    return {
        "weights": trainer.model.state_dict(),
        "optimizer": trainer.optimizer.state_dict(),
        "scheduler": trainer.lr_scheduler.state_dict(),
        "step": trainer.state.global_step,
        "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
        "rng": torch.random.get_rng_state(),
    }


def test_a_lora_checkpoint_is_the_trainers_and_resumes_bit_identical(tmp_path: Path) -> None:
    """Bugs caught: the whole model (every frozen base weight) saved as the item `model`
    where the Trainer saves the adapter alone; a resume that does not load the adapter as
    the Trainer's `load_adapter` does (weights, optimizer, scheduler, RNG or step differing
    from the Trainer's own resume); an export that is not the adapter folder
    `PeftModel.from_pretrained` loads."""
    from peft import PeftModel
    from safetensors.torch import load_file

    from nebulaml.transformers import NebulaCallback, export_pretrained

    native_dir, root = tmp_path / "native", str(tmp_path / "root")
    _trainer(native_dir, []).train()
    native_ckpt = native_dir / f"checkpoint-{SAVE}"
    _trainer(tmp_path / "nebula-out", [NebulaCallback(persistent_storage_path=root)]).train()
    nm.flush_persistence()

    # What the checkpoint holds: the Trainer's files, the adapter in place of the model.
    (listed,) = [c for c in nm.list_checkpoints(root) if c["tag"] == f"global_step{SAVE}"]
    assert "model" not in listed["items"]
    assert {"adapter_model", "adapter_config", "optimizer", "scheduler", "rng_state"} <= set(
        listed["items"]
    )
    found = nm.get_checkpoint(f"global_step{SAVE}", root)
    assert found is not None
    with found:
        adapter = found.load("adapter_model")
        assert same(adapter, load_file(native_ckpt / "adapter_model.safetensors"))
        native_optimizer = torch.load(native_ckpt / "optimizer.pt", weights_only=True)
        assert same(found.load("optimizer"), native_optimizer)
        assert same(found.load("scheduler"), torch.load(native_ckpt / "scheduler.pt"))
        rng = torch.load(native_ckpt / "rng_state.pth", weights_only=False)
        assert same(found.load("rng_state")["cpu"], rng["cpu"])
    adapter_bytes = sum(t.numel() * t.element_size() for t in adapter.values())
    optimizer_bytes = (native_ckpt / "optimizer.pt").stat().st_size
    assert listed["size_bytes"] < 3 * (adapter_bytes + optimizer_bytes)  # not the base

    # Each resumed from its step-2 checkpoint by a fresh Trainer: the same end, bit for bit.
    native = _resumed(_trainer(native_dir, []), str(native_ckpt))
    callback = NebulaCallback(persistent_storage_path=root)
    ours_dir = tmp_path / "nebula-out"  # its checkpoint-2 is not on disk: nebula's
    ours = _resumed(_trainer(ours_dir, [callback]), str(ours_dir / f"checkpoint-{SAVE}"))
    assert native["step"] == ours["step"] == STEPS
    assert len(ours["losses"]) == STEPS  # the log history of steps 1-2 restored, 3-4 trained
    for key in ("weights", "optimizer", "scheduler", "losses", "rng"):
        assert same(native[key], ours[key]), key

    # The export is the Trainer's adapter folder.
    dest = export_pretrained(root, f"global_step{STEPS}", tmp_path / "export")
    assert sorted(p.name for p in dest.iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    from hf_child import tiny_gpt2

    loaded = PeftModel.from_pretrained(tiny_gpt2(), str(dest))
    expected = {k: v for k, v in ours["weights"].items() if "lora_" in k}
    assert same({k: v for k, v in loaded.state_dict().items() if "lora_" in k}, expected)
