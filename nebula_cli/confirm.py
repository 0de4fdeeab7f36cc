"""Asking a person before a command deletes or releases something (y/N, on stderr), and
refusing when no one can be asked (off a terminal, without --yes).

May import: console.py, exits.py, the standard library and typer.
Not for: what is deleted or released (nebulaml.ops) or the --yes and --dry-run options
(each command's module).
"""

from __future__ import annotations

import sys

import typer

from .console import stderr
from .exits import EXIT_DECLINED, fail, json_error


def confirm(question: str, refusal: str, declined: str) -> None:
    """Ask `question` (y/N, on stderr) before a command deletes or releases something.

    Off a terminal there is no one to ask: fail with `refusal` (`--yes` is needed there).
    A "no" (or Ctrl-D) prints `declined` and exits 4 (`EXIT_DECLINED`: nothing was done,
    and nothing failed; with --json, an error object of kind "declined"); Ctrl-C ends the
    command as anywhere else (`nebula: interrupted`, exit 130).

    Example: confirm("Release 2 memory tier(s)?", f"{base}: 2 memory tier(s) to release;
    refusing to release without --yes when not on a terminal (add --yes, or --dry-run to
    see the plan only)", "Nothing released.")
    """
    if not sys.stdin.isatty():
        fail(refusal)
    try:
        answer = typer.confirm(question, default=False, err=True)
    except typer.Abort as exc:  # the prompt turns Ctrl-C and Ctrl-D into Abort
        sys.stderr.write("\n")  # the prompt's line is left open
        if isinstance(exc.__context__, KeyboardInterrupt):
            raise KeyboardInterrupt from None  # app.main: `nebula: interrupted`, 130
        answer = False
    if not answer:
        stderr().print(declined, highlight=False)
        json_error(declined, EXIT_DECLINED)
        raise typer.Exit(EXIT_DECLINED)
