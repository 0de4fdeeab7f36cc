"""Dynamic shell completion: the tags and item names of the ROOT typed on the command line.

Typer calls these at TAB time (`autocompletion=`), with the words parsed so far in
`ctx.params`. They read `nebulaml.list_checkpoints(ROOT)` once and say nothing on any
failure (no such root, no credentials, a typo): a completion that fails offers nothing.

Not for: the shell scripts (completions.py) or the completion options (app.py).
"""

from __future__ import annotations

import logging
import warnings
from typing import Any


def _checkpoints(ctx: Any) -> list[dict[str, Any]]:
    root = ctx.params.get("root")
    if not isinstance(root, str) or not root:
        return []
    logger = logging.getLogger("nebulaml")
    disabled = logger.disabled
    logger.disabled = True  # nothing on the terminal while the user types
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import nebulaml as nm

            from .output import parse_storage_options

            options = parse_storage_options(ctx.params.get("storage_option"))
            with nm.using_storage_options(options):
                return nm.list_checkpoints(root)
    except Exception:  # noqa: BLE001 - completion offers nothing rather than failing
        return []
    finally:
        logger.disabled = disabled


def complete_tag(ctx: Any, incomplete: str) -> list[str]:
    """The committed tags of ROOT that start with what was typed, newest first."""
    return [c["tag"] for c in _checkpoints(ctx) if c["tag"].startswith(incomplete)]


def complete_item(ctx: Any, incomplete: str) -> list[str]:
    """The item names of the checkpoint(s) named on the line (TAG, or TAG_A and TAG_B), or
    of the newest one, that start with what was typed."""
    checkpoints = _checkpoints(ctx)
    tags = {ctx.params.get(name) for name in ("tag", "tag_a", "tag_b")} - {None}
    chosen = [c for c in checkpoints if c["tag"] in tags] if tags else checkpoints[:1]
    names: dict[str, None] = {}
    for checkpoint in chosen:
        for name in checkpoint["items"]:
            names.setdefault(name)
    return [name for name in names if name.startswith(incomplete)]
