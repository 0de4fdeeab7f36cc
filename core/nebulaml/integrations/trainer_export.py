"""A nebula checkpoint of a Trainer's model exported as a Hugging Face model folder
(`from_pretrained` loads it): the model built from its saved config, its weights loaded,
written by `save_pretrained`, the files' modes as the caller's `private` says.

May import: the layers below the integrations, hf_common.py, hf_peft.py, transformers and
safetensors (inside the functions).

Not for: the checkpoint's own items as plain files (ops/export.py) or DeepSpeed's
(integrations/deepspeed.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from nebulaml.config import private_default
from nebulaml.errors import CheckpointNotFoundError, InvalidArgumentError
from nebulaml.format.jsonbounds import MAX_MANIFEST_BYTES, load_json
from nebulaml.integrations.hf_common import find, load_optional
from nebulaml.integrations.hf_peft import DEFAULT_ADAPTER, adapter_configs, adapter_item
from nebulaml.storage.local_files import make_folders, new_file_mode


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

    A peft model's checkpoint (its adapters) becomes the folder the Trainer writes for it:
    `adapter_model.safetensors` and `adapter_config.json` (another adapter than "default":
    in a folder of its name), which `PeftModel.from_pretrained(base, dest)` loads.
    """
    import transformers
    from transformers import AutoConfig

    checkpoint = find(tag, root)
    if checkpoint is None:
        raise CheckpointNotFoundError(os.fspath(root), tag or "(the newest)")
    adapters = adapter_configs(checkpoint, load_optional)
    dest_path = Path(dest)
    private = private_default() if private is None else private
    if adapters is not None:  # a peft model's: the Trainer's folder for PeftModel.from_pretrained
        make_folders(str(dest_path), private)
        for adapter, adapter_config in adapters.items():
            _write_adapter(checkpoint, adapter, adapter_config, dest_path, private)
        return dest_path
    config_text = load_optional(checkpoint, "config")
    if config_text is None:
        raise InvalidArgumentError(
            f"checkpoint {checkpoint.tag!r} has no item 'config': its model was not a "
            f"transformers PreTrainedModel, so there is no config to export"
        )
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


def _write_adapter(
    checkpoint: Any, adapter: str, config: dict[str, Any], dest: Path, private: bool
) -> None:
    """One adapter of a peft checkpoint as `save_pretrained` writes it:
    `adapter_model.safetensors` and `adapter_config.json`, in `dest` for the adapter
    "default" and in `dest/<adapter>` for another."""
    from safetensors.torch import save_file

    folder = dest if adapter == DEFAULT_ADAPTER else dest / adapter
    make_folders(str(folder), private)
    state = load_optional(checkpoint, adapter_item(adapter)) or {}
    weights = folder / "adapter_model.safetensors"
    save_file({k: v.contiguous().clone() for k, v in state.items()}, str(weights), {"format": "pt"})
    text = json.dumps(config, indent=2, sort_keys=True) + "\n"
    (folder / "adapter_config.json").write_text(text, encoding="utf-8")
    mode = new_file_mode(str(folder), private)
    for path in (weights, folder / "adapter_config.json"):
        os.chmod(path, mode, follow_symlinks=False)
