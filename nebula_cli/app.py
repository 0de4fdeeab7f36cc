"""The `nebula` Typer application: global options and command registration.

Not for: checkpoint logic (that lives in nebulaml) nor heavy imports: `nebula --help`
must not import torch or pandas, so commands import them lazily.
"""

from __future__ import annotations

import sys

import typer

app = typer.Typer(
    name="nebula",
    help=(
        "Inspect and manage nebula checkpoints.\n\n"
        "ROOT is a checkpoint directory given as a path or an fsspec URL "
        "(/ckpt, file:///ckpt, az://container/run1)."
    ),
    no_args_is_help=True,
    add_completion=True,
    pretty_exceptions_enable=False,
)


def _register() -> None:
    # Command modules import nebulaml (light) but never torch or pandas at import time.
    from .commands import copy, flush, gc, history, inspect, latest, ls, memory, prune, verify

    app.command("ls")(ls.ls_command)
    app.command("prune")(prune.prune_command)
    app.command("copy")(copy.copy_command)
    app.command("flush")(flush.flush_command)
    app.command("inspect")(inspect.inspect_command)
    app.command("latest")(latest.latest_command)
    app.command("verify")(verify.verify_command)
    app.command("history")(history.history_command)
    app.command("memory")(memory.memory_command)
    app.command("gc")(gc.gc_command)


def _version_callback(value: bool) -> None:
    if value:
        from nebulaml._version import __version__

        typer.echo(f"nebula {__version__}")
        raise typer.Exit()


@app.callback()
def _main(
    version: bool = typer.Option(
        False,
        "--version",
        help="Print the version and exit.",
        callback=_version_callback,
        is_eager=True,
    ),
) -> None:
    """Inspect and manage nebula checkpoints."""


_register()


def main() -> None:
    """Console-script entry point."""
    sys.exit(app(standalone_mode=True) or 0)
