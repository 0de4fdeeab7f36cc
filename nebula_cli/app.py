"""The `nebula` Typer application: global options and command registration.

Help is plain text (`-h` or `--help`, for the program and every command) and a usage error
is one line, `nebula: error: ...`, exit 2 (help.py); Ctrl-C is one line,
`nebula: interrupted`, exit 130 (`main`).
`--show-completion [SHELL]` and `--install-completion [SHELL]` take the shell named (bash,
zsh or fish), else the one this runs under.

Not for: checkpoint logic (that lives in nebulaml) nor heavy imports: `nebula --help`
must not import torch or pandas, so commands import them lazily.
"""

from __future__ import annotations

import logging
import signal
import sys
from typing import Annotated

import typer

from .completion_classes import register as register_completion_classes
from .help import NebulaCommand, NebulaGroup

# The completion classes (bash, zsh, fish) answer `_NEBULA_COMPLETE=complete_<shell>`:
# registered here, since the app declares its own --show/--install-completion options.
register_completion_classes()

app = typer.Typer(
    name="nebula",
    cls=NebulaGroup,
    help=(
        "Inspect and manage nebula checkpoints.\n\n"
        "ROOT is a checkpoint directory given as a path or an fsspec URL "
        "(/ckpt, file:///ckpt, az://container/run1). Data goes to stdout, progress and "
        "errors to stderr; every command takes --json (a failure: an error object). Exit "
        "status: 0 ok, 1 error or not done (diff: the checkpoints differ), 2 usage, 3 not "
        "found, 4 declined at a prompt, 130 interrupted."
    ),
    no_args_is_help=True,
    # `-h` as gh, kubectl and git take it; the commands inherit it from the group's context.
    context_settings={"help_option_names": ["-h", "--help"]},
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


def _register() -> None:
    # Command modules import nebulaml (light) but never torch or pandas at import time.
    from .commands import (
        advise,
        copy,
        diff,
        export,
        flush,
        gc,
        history,
        inspect,
        latest,
        ls,
        memory,
        prune,
        unlock,
        verify,
    )

    for name, function in (
        ("ls", ls.ls_command),
        ("inspect", inspect.inspect_command),
        ("latest", latest.latest_command),
        ("verify", verify.verify_command),
        ("diff", diff.diff_command),
        ("export", export.export_command),
        ("copy", copy.copy_command),
        ("flush", flush.flush_command),
        ("prune", prune.prune_command),
        ("history", history.history_command),
        ("advise", advise.advise_command),
        ("memory", memory.memory_command),
        ("gc", gc.gc_command),
        ("unlock", unlock.unlock_command),
    ):
        app.command(name, cls=NebulaCommand)(function)


def _version_callback(value: bool) -> None:
    if value:
        from nebulaml import __version__

        typer.echo(f"nebula {__version__}")
        raise typer.Exit()


def _shell(value: str) -> str:
    from .completions import SCRIPT_FILES, detect_shell

    shell = detect_shell() if value == "auto" else value
    if shell is None:
        raise typer.BadParameter("cannot tell which shell this is; name it: bash, zsh or fish")
    if shell not in SCRIPT_FILES:
        raise typer.BadParameter(f"unsupported shell {shell!r}; one of bash, zsh, fish")
    return shell


def _show_completion(value: str | None) -> None:
    if value is None:
        return
    from .completions import script_path

    sys.stdout.write(script_path(_shell(value)).read_text(encoding="utf-8"))
    raise typer.Exit()


def _install_completion(value: str | None) -> None:
    if value is None:
        return
    from .completions import install

    shell = _shell(value)
    written = install(shell)
    typer.echo(f"Installed the {shell} completion in {written[0]}")
    for path in written[1:]:
        typer.echo(f"Updated {path}")
    typer.echo("It takes effect in a new shell.")
    raise typer.Exit()


@app.callback()
def _main(
    version: Annotated[
        bool,
        typer.Option(
            "--version",
            help="Print the version and exit.",
            callback=_version_callback,
            is_eager=True,
        ),
    ] = False,
    install_completion: Annotated[
        str | None,
        typer.Option(
            "--install-completion",
            metavar="[SHELL]",
            help="Install the completion script of SHELL (bash, zsh, fish; default: this "
            "shell) for this user, and exit.",
            callback=_install_completion,
            is_eager=True,
            expose_value=False,
            show_default=False,
        ),
    ] = None,
    show_completion: Annotated[
        str | None,
        typer.Option(
            "--show-completion",
            metavar="[SHELL]",
            help="Print the completion script of SHELL (bash, zsh, fish; default: this "
            "shell), and exit.",
            callback=_show_completion,
            is_eager=True,
            expose_value=False,
            show_default=False,
        ),
    ] = None,
) -> None:
    """Inspect and manage nebula checkpoints."""


_register()


EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports Ctrl-C


def _interrupt(_signum: int, _frame: object) -> None:
    # From the moment of Ctrl-C nothing more is logged: the requests the command abandons
    # (an az:// upload, say) would each report their end as the command unwinds.
    logging.disable(logging.CRITICAL)
    raise KeyboardInterrupt


def main() -> None:
    """Console-script entry point. Ctrl-C ends any command with one line on stderr,
    `nebula: interrupted`, and status 130 (Typer turns it into Exit(130))."""
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _interrupt)
    try:
        code = app(standalone_mode=True)
    except SystemExit as exc:
        code = exc.code
    except KeyboardInterrupt:  # before Typer took over, or while it unwound
        code = EXIT_INTERRUPTED
    if code == EXIT_INTERRUPTED:
        # A second Ctrl-C while the interpreter shuts down ends it at once, silently.
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        sys.stderr.write("nebula: interrupted\n")
    sys.exit(code or 0)
