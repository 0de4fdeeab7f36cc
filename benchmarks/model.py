"""The training state the peer benchmark checkpoints: a GPT-2-style model and AdamW.

Everything is built in memory from a seed; nothing is downloaded. What matters for a
checkpoint benchmark is the shape of a real training state: fp32 parameters (token and
position embeddings, N blocks of attention and MLP, layer norms, a head tied to the token
embedding) and AdamW's `exp_avg` and `exp_avg_sq` after one step, i.e. about 12 bytes per
parameter. `TrainState` also runs real training steps (forward, backward, AdamW) for the
loop benchmark.

Not for: training a useful model (the weights and tokens are random).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F


@dataclass(frozen=True, slots=True)
class Preset:
    """A model size and the batch one training step uses."""

    name: str
    n_layer: int
    n_head: int
    n_embd: int
    batch: int
    seq_len: int
    vocab_size: int = 50257
    n_ctx: int = 1024
    about: str = ""
    lora_mb: int = 200  # the LoRA fine-tune workload's state (lora_model.py), 10^6 bytes


PRESETS: dict[str, Preset] = {
    preset.name: preset
    for preset in (
        Preset("small", n_layer=4, n_head=4, n_embd=256, batch=1, seq_len=32, about="~16M"),
        Preset("default", n_layer=12, n_head=12, n_embd=768, batch=1, seq_len=64, about="~124M"),
        Preset(
            "large",
            n_layer=24,
            n_head=16,
            n_embd=1024,
            batch=1,
            seq_len=64,
            about="~355M",
            lora_mb=1000,
        ),
    )
}


class _Attention(nn.Module):
    def __init__(self, preset: Preset) -> None:
        super().__init__()
        self.n_head = preset.n_head
        self.c_attn = nn.Linear(preset.n_embd, 3 * preset.n_embd)
        self.c_proj = nn.Linear(preset.n_embd, preset.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))


class _Block(nn.Module):
    def __init__(self, preset: Preset) -> None:
        super().__init__()
        d = preset.n_embd
        self.ln_1 = nn.LayerNorm(d)
        self.attn = _Attention(preset)
        self.ln_2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """GPT-2's architecture: embeddings, `n_layer` pre-norm blocks, a final layer norm and
    an output head that shares its weight with the token embedding."""

    def __init__(self, preset: Preset) -> None:
        super().__init__()
        self.wte = nn.Embedding(preset.vocab_size, preset.n_embd)
        self.wpe = nn.Embedding(preset.n_ctx, preset.n_embd)
        self.blocks = nn.ModuleList(_Block(preset) for _ in range(preset.n_layer))
        self.ln_f = nn.LayerNorm(preset.n_embd)
        self.lm_head = nn.Linear(preset.n_embd, preset.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied, as in GPT-2
        for name, param in self.named_parameters():
            if name.endswith("weight") and param.dim() == 2:
                std = 0.02 / math.sqrt(2 * preset.n_layer) if "c_proj" in name else 0.02
                nn.init.normal_(param, std=std)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The mean cross-entropy loss of predicting `targets` from `idx`."""
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


class TrainState:
    """A model, its AdamW optimizer (already stepped once) and one fixed batch."""

    def __init__(self, preset: Preset, seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.preset = preset
        self.model = GPT(preset)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4, weight_decay=0.1)
        shape = (preset.batch, preset.seq_len + 1)
        tokens = torch.randint(
            0, preset.vocab_size, shape, generator=torch.Generator().manual_seed(seed)
        )
        self.inputs, self.targets = tokens[:, :-1], tokens[:, 1:]
        self.step()  # AdamW's exp_avg and exp_avg_sq exist from the first step on

    @property
    def num_params(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    @property
    def state_bytes(self) -> int:
        """Bytes of tensor storage in `state_dict()`, each storage counted once (the tied
        head is not counted twice)."""
        seen: set[int] = set()
        total = 0
        for tensor in _tensors(self.state_dict()):
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
        return total

    def state_dict(self) -> dict[str, Any]:
        """What every method checkpoints: `{"model": ..., "optimizer": ...}`."""
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}

    def forward_backward(self) -> float:
        """The compute of one step (gradients only; the state is not mutated)."""
        self.optimizer.zero_grad(set_to_none=False)
        loss = self.model(self.inputs, self.targets)
        loss.backward()
        return float(loss.detach())

    def optimizer_step(self) -> None:
        """The part of a step that mutates the checkpointed tensors."""
        self.optimizer.step()

    def step(self) -> float:
        """One full training step; returns the loss."""
        loss = self.forward_backward()
        self.optimizer_step()
        return loss

    def time_step(self, repeats: int = 3) -> float:
        """The median seconds of one full step, over `repeats` steps."""
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            self.step()
            times.append(time.perf_counter() - t0)
        return sorted(times)[len(times) // 2]


def _tensors(obj: Any) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    stack = [obj]
    while stack:
        cur = stack.pop()
        if isinstance(cur, torch.Tensor):
            out.append(cur)
        elif isinstance(cur, dict):
            stack.extend(cur.values())
        elif isinstance(cur, (list, tuple)):
            stack.extend(cur)
    return out
