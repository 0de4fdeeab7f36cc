"""Dynamic shell completion: the tags and item names of the ROOT typed on the command line,
and `nebula copy`'s DEST words.

Typer calls these at TAB time (`autocompletion=`), with the words parsed so far in
`ctx.params`. They read `nebulaml.list_checkpoints(ROOT)` once and say nothing on any
failure (no such root, no credentials, a typo): a completion that fails offers nothing.

Not for: the shell scripts (completions.py) or the completion options (app.py).
"""

from __future__ import annotations

import logging
import os
import shlex
import warnings
from typing import Any


def _typed() -> list[str]:
    """The words typed before the one being completed, as the shell script passed them
    (bash: COMP_WORDS and COMP_CWORD; zsh and fish: _TYPER_COMPLETE_ARGS)."""
    try:
        if "COMP_WORDS" in os.environ:
            words = shlex.split(os.environ["COMP_WORDS"])
            return words[: int(os.environ.get("COMP_CWORD", len(words)))]
        words = shlex.split(os.environ.get("_TYPER_COMPLETE_ARGS", ""))
        complete_word = os.environ.get("_TYPER_COMPLETE_ARGS", "").endswith(" ")
        return words if complete_word else words[:-1]
    except ValueError:  # an open quote
        return []


def _words(ctx: Any) -> dict[str, Any]:
    """The command's arguments by name: as click parsed them, else (click parses nothing
    when an option's value is being completed) read from the words typed so far."""
    params = dict(ctx.params)
    if params.get("root"):
        return params
    command = ctx.command
    names = [p.name for p in command.params if p.param_type_name == "argument"]
    valued = {
        opt
        for p in command.params
        if p.param_type_name == "option" and not getattr(p, "is_flag", False)
        for opt in p.opts
    }
    words = _typed()
    if ctx.info_name in words:
        words = words[words.index(ctx.info_name) + 1 :]
    positional, skip = [], False
    for word in words:
        if skip:
            skip = False
        elif word in valued:
            skip = True
        elif not word.startswith("-"):
            positional.append(word)
    params.update(zip(names, positional, strict=False))
    return params


def _checkpoints(params: dict[str, Any]) -> list[dict[str, Any]]:
    root = params.get("root")
    if not isinstance(root, str) or not root:
        return []
    logger = logging.getLogger("nebulaml")
    disabled = logger.disabled
    logger.disabled = True  # nothing on the terminal while the user types
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import nebulaml as nm

            from .options import parse_storage_options

            options = parse_storage_options(list(params.get("storage_option") or []))
            with nm.using_storage_options(options):
                return nm.list_checkpoints(root, hold=False)
    except Exception:  # noqa: BLE001 - completion offers nothing rather than failing
        return []
    finally:
        logger.disabled = disabled


def complete_tag(ctx: Any, incomplete: str) -> list[str]:
    """The committed tags of ROOT that start with what was typed, newest first."""
    checkpoints = _checkpoints(_words(ctx))
    return [c["tag"] for c in checkpoints if c["tag"].startswith(incomplete)]


def complete_item(ctx: Any, incomplete: str) -> list[str]:
    """The item names of the checkpoint(s) named on the line (TAG, or TAG_A and TAG_B), or
    of the newest one, that start with what was typed."""
    params = _words(ctx)
    checkpoints = _checkpoints(params)
    tags = {params.get(name) for name in ("tag", "tag_a", "tag_b")} - {None}
    chosen = [c for c in checkpoints if c["tag"] in tags] if tags else checkpoints[:1]
    names: dict[str, None] = {}
    for checkpoint in chosen:
        for name in checkpoint["items"]:
            names.setdefault(name)
    return [name for name in names if name.startswith(incomplete)]


# `nebula copy`'s DEST: a root (the shell completes paths when nothing here matches), or
# one of ROOT's own tiers by name.
DEST_WORDS = (
    ("memory", "this node's memory tier of ROOT"),
    ("persistent", "ROOT itself"),
)


def complete_dest(ctx: Any, incomplete: str) -> list[tuple[str, str]]:
    """`memory` and `persistent` when they start with what was typed (else nothing, and
    the shell offers paths)."""
    return [(word, why) for word, why in DEST_WORDS if word.startswith(incomplete)]


def complete_copy_source(ctx: Any, incomplete: str) -> list[Any]:
    """`nebula copy`'s second word: a tag of ROOT, or with `--latest` (no TAG) the DEST."""
    if ctx.params.get("latest") or "--latest" in _typed():
        return list(complete_dest(ctx, incomplete))
    return list(complete_tag(ctx, incomplete))
