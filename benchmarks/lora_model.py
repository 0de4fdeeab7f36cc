"""The LoRA fine-tune workload's training state: a frozen base and a small trained adapter.

`LoraModel` is a stack of `n_layer` square linear layers (the base: weights and biases,
`requires_grad=False`, in no optimizer) with a LoRA adapter on each (`lora_a`, rank x d,
and `lora_b`, d x rank: trainable), trained with Adam. Sized from the state's bytes
(`LoraShape.for_state_bytes`): the base holds ~95% of `model` + `optimizer` state, the
adapter and Adam's `exp_avg` / `exp_avg_sq` the rest. `LoraState` is a `TrainState` (the
same interface the methods save: `state_dict()`, `forward_backward()`, `optimizer_step()`),
so every method saves it as it saves the GPT-2 state; `model_items()` splits `model` into
the base's tensors and the adapter's, for a save that keeps the base an item of its own.
With `all_changed=True` it is the control: the same model and sizes, whose base is changed
in place (`add_` under `torch.no_grad()`) at every optimizer step, so every byte of each
checkpoint differs from the previous one.

Not for: the GPT-2 state (model.py) or timing (lora.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from model import TrainState, _tensors
from torch import nn
from torch.nn import functional as F

BYTES_PER_PARAM = 4  # fp32
FROZEN_SHARE = 0.95  # of the state's bytes, in the base
BASE_NUDGE = 1e-6  # what the control adds to every base weight at each step (changes every fp32)


@dataclass(frozen=True, slots=True)
class LoraShape:
    """The model's width `d`, depth `n_layer`, the adapter's `rank`, and the batch."""

    d: int
    n_layer: int
    rank: int
    batch: int = 8

    @classmethod
    def for_state_bytes(cls, state_bytes: int) -> LoraShape:
        """The shape whose `model` + Adam state is about `state_bytes`, ~95% of it frozen:
        the widest `d` (a power of two, at most 2048) that leaves at least 4 layers.

        Example:
            >>> LoraShape.for_state_bytes(200_000_000)
            LoraShape(d=2048, n_layer=11, rank=18, batch=8)
        """
        frozen = FROZEN_SHARE * state_bytes
        d = 2048
        while d > 16 and 4 * _layer_bytes(d) > frozen:
            d //= 2
        n_layer = max(1, round(frozen / _layer_bytes(d)))
        # adapter + exp_avg + exp_avg_sq = 3 x the adapter: the rest of the state
        adapter = (1 - FROZEN_SHARE) * state_bytes / 3
        rank = max(1, round(adapter / (n_layer * 2 * d * BYTES_PER_PARAM)))
        return cls(d=d, n_layer=n_layer, rank=rank)


def _layer_bytes(d: int) -> int:
    return (d * d + d) * BYTES_PER_PARAM


class LoraLinear(nn.Module):
    """A frozen `d x d` linear layer plus a trainable low-rank update `B @ A`."""

    def __init__(self, d: int, rank: int) -> None:
        super().__init__()
        self.base = nn.Linear(d, d)
        self.base.requires_grad_(False)
        # B is not zero (as LoRA starts it): every adapter byte changes from the first step.
        self.lora_a = nn.Parameter(torch.randn(rank, d) / math.sqrt(d))
        self.lora_b = nn.Parameter(torch.randn(d, rank) * 0.01)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.lora_a.t()) @ self.lora_b.t()


class LoraModel(nn.Module):
    """`n_layer` LoRA-adapted linear layers with ReLU between them; the loss is the MSE
    to a fixed target."""

    def __init__(self, shape: LoraShape) -> None:
        super().__init__()
        self.layers = nn.ModuleList(LoraLinear(shape.d, shape.rank) for _ in range(shape.n_layer))

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = F.relu(layer(x))
        return F.mse_loss(x, target)

    def frozen(self) -> list[torch.Tensor]:
        """The base's tensors (weights and biases)."""
        return [p for p in self.parameters() if not p.requires_grad]

    def trainable(self) -> list[nn.Parameter]:
        """The adapter's parameters."""
        return [p for p in self.parameters() if p.requires_grad]


class LoraState(TrainState):
    """A `LoraModel`, Adam over its adapter only (stepped once), and one fixed batch; with
    `all_changed`, the control whose base changes at every optimizer step."""

    def __init__(self, shape: LoraShape, *, all_changed: bool = False, seed: int = 0) -> None:
        # Not TrainState.__init__: that builds the GPT-2 model; the interface is the same.
        torch.manual_seed(seed)
        self.shape = shape
        self.all_changed = all_changed
        self.model = LoraModel(shape)
        self.optimizer = torch.optim.Adam(self.model.trainable(), lr=1e-3)
        gen = torch.Generator().manual_seed(seed)
        # the base's names in `model.state_dict()`: its weights and biases
        self.frozen_names = frozenset(
            name for name, p in self.model.named_parameters() if not p.requires_grad
        )
        self.inputs = torch.randn(shape.batch, shape.d, generator=gen)
        self.targets = torch.randn(shape.batch, shape.d, generator=gen)
        self.step()  # Adam's exp_avg and exp_avg_sq exist from the first step on

    def optimizer_step(self) -> None:
        """Adam's step on the adapter; the control also changes the whole base in place."""
        self.optimizer.step()
        if self.all_changed:
            with torch.no_grad():
                for tensor in self.model.frozen():
                    tensor.add_(BASE_NUDGE)

    def model_items(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """`model.state_dict()` in two: the base's tensors (frozen) and the rest (the
        adapter's), each in the state dict's order."""
        model = self.model.state_dict()
        base = {k: v for k, v in model.items() if k in self.frozen_names}
        return base, {k: v for k, v in model.items() if k not in self.frozen_names}

    @property
    def frozen_bytes(self) -> int:
        """Bytes of the base's tensors."""
        return sum(t.untyped_storage().nbytes() for t in self.model.frozen())

    @property
    def changed_bytes(self) -> int:
        """Bytes a step changes in a frozen-base run: the adapter's parameters and every
        tensor of Adam's state (each storage once)."""
        seen: set[int] = set()
        total = 0
        tensors = [*self.model.trainable(), *_tensors(self.optimizer.state_dict()["state"])]
        for tensor in tensors:
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
        return total
