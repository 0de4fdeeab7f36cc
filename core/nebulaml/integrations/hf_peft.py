"""A peft model's weights in a Hugging Face checkpoint: what the Trainer itself saves of a
`PeftModel` (its `save_pretrained`: each adapter's state as peft's
`get_peft_model_state_dict` gives it, and the adapters' configs), not the frozen base;
and the load back as the Trainer's resume does it (`load_adapter`, which sets those
states with `set_peft_model_state_dict`).

Items: `adapter_model` (the adapter "default"; another adapter `adapter_model-<name>`) and
`adapter_config` (a JSON text: each adapter's config, as `adapter_config.json` holds it).
A model that is not a `PeftModel` is saved whole, as the item `model`.

May import: the layers below the integrations, and peft inside the functions (a
`PeftModel` exists only once peft is imported: `sys.modules` says whether it is).

Not for: which items a Trainer's checkpoint holds (trainer_saving.py) or the Hugging Face
folder an export writes (trainer_export.py).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from typing import Any

MODEL_ITEM = "model"
ADAPTER_ITEM = "adapter_model"
ADAPTER_CONFIG_ITEM = "adapter_config"
DEFAULT_ADAPTER = "default"


def is_peft(model: Any) -> bool:
    """Whether `model` is a peft `PeftModel` (False when peft was never imported)."""
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(model, peft.PeftModel)


def base_model(model: Any) -> Any:
    """The transformers model under a `PeftModel` (its config is the base's); `model`
    itself otherwise."""
    return model.get_base_model() if is_peft(model) else model


def adapter_item(adapter: str) -> str:
    """The item of one adapter's state.

    Example:
        >>> adapter_item("default"), adapter_item("dpo")
        ('adapter_model', 'adapter_model-dpo')
    """
    return ADAPTER_ITEM if adapter == DEFAULT_ADAPTER else f"{ADAPTER_ITEM}-{adapter}"


def weight_items(model: Any) -> Iterator[tuple[str, Any]]:
    """The items of `model`'s weights, as the Trainer saves them: a `PeftModel`'s adapters
    (each adapter's state and the configs); any other model's whole `state_dict()`."""
    if not is_peft(model):
        yield MODEL_ITEM, model.state_dict()
        return
    from peft import get_peft_model_state_dict

    configs = {}
    for adapter, config in model.peft_config.items():
        yield adapter_item(adapter), get_peft_model_state_dict(model, adapter_name=adapter)
        configs[adapter] = _config_dict(config)
    text = json.dumps(configs, indent=2, sort_keys=True, default=str)
    yield ADAPTER_CONFIG_ITEM, text + "\n"


def adapter_configs(checkpoint: Any, load: Any) -> dict[str, Any] | None:
    """`{adapter: config dict}` of a checkpoint saved from a `PeftModel`, None for one of a
    whole model; `load(checkpoint, name)` reads an item (None when it is missing)."""
    text = load(checkpoint, ADAPTER_CONFIG_ITEM)
    if text is None:
        return None
    configs: dict[str, Any] = json.loads(text)
    return configs


def load_weights(checkpoint: Any, model: Any, load: Any) -> Any:
    """Load the weights item(s) of `checkpoint` into `model`: a `PeftModel`'s adapters with
    `set_peft_model_state_dict` (as the Trainer's `load_adapter` does; returns None), or a
    whole `state_dict` (returns `load_state_dict`'s result, not strict, for the Trainer's
    warnings). `load(checkpoint, name)` reads an item, None when it is missing."""
    configs = adapter_configs(checkpoint, load)
    if configs is None or not is_peft(model):
        state = load(checkpoint, MODEL_ITEM)
        if state is None:
            from nebulaml.errors import InvalidArgumentError

            raise InvalidArgumentError(
                f"checkpoint {checkpoint.tag!r} holds a peft model's adapters, not a whole "
                f"model: load it into the PeftModel it was saved from"
            )
        return model.load_state_dict(state, False)
    from peft import set_peft_model_state_dict

    for adapter in configs:
        if adapter in model.peft_config:
            set_peft_model_state_dict(model, load(checkpoint, adapter_item(adapter)), adapter)
    return None


def _config_dict(config: Any) -> dict[str, Any]:
    """An adapter's config as `adapter_config.json` holds it: sets as lists, and
    `inference_mode` true (what `save_pretrained` writes)."""
    out: dict[str, Any] = {}
    for key, value in config.to_dict().items():
        if isinstance(value, set):
            value = sorted(value, key=str)
        out[key] = getattr(value, "value", value)  # enums (peft_type, task_type) as values
    out["inference_mode"] = True
    return out
