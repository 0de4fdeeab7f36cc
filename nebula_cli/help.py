"""How `nebula` prints help and usage errors: plain text, like gh and kubectl.

`NebulaGroup` and `NebulaCommand` replace Typer's rich panels with click's plain layout,
made exact: the usage line names arguments as `ROOT [TAG]`, options read `--keep N` (flags
take no value), docstring paragraphs are re-flowed to the terminal, and the command list
gives each command's whole first sentence. A usage error is one line on stderr,
`nebula: error: <what> (see 'nebula prune --help')`, and exit status 2; `nebula` alone
prints the help (exit 2, as a usage error).

Not for: the commands themselves (commands/) or errors of the library (exits.py).
"""

from __future__ import annotations

import datetime
import enum
import inspect
import os
import pathlib
import sys
from collections.abc import Sequence
from typing import Any

from typer import Abort, _click
from typer.core import TyperCommand, TyperGroup

from .console import JSON_STATE
from .exits import EXIT_ERROR, EXIT_USAGE, json_error
from .options import ROOT_ENV, ROOT_POSITIONALS

# What an option's value is called when its declaration names no metavar.
_METAVARS: dict[Any, str] = {
    int: "N",
    float: "NUMBER",
    str: "TEXT",
    pathlib.Path: "PATH",
    datetime.datetime: "WHEN",
}
HELP_WIDTH = 80


def _metavar(param: Any) -> str:
    if param.metavar:
        return str(param.metavar)
    descriptor = getattr(param, "type_descriptor", None)
    if descriptor is not None and descriptor.is_choice:
        return "[" + "|".join(str(c) for c in descriptor.choices or ()) + "]"
    annotation = getattr(descriptor, "annotation", None)
    return _METAVARS.get(annotation, param.name.upper() if param.name else "VALUE")


def _is_flag(param: Any) -> bool:
    return bool(getattr(param, "is_flag", False)) or bool(getattr(param, "count", False))


def _default(param: Any) -> str | None:
    if _is_flag(param) or param.required or getattr(param, "show_default", True) is False:
        return None
    default = param.default
    if default is None or callable(default) or default == [] or default == ():
        return None
    if isinstance(default, enum.Enum):
        return str(default.value)
    if isinstance(default, float):
        return f"{default:g}"
    return str(default)


def _option_record(param: Any) -> tuple[str, str]:
    names = sorted(param.opts, key=lambda o: (not o.startswith("-") or o.startswith("--"), o))
    spec = ", ".join(names)
    if param.secondary_opts:
        spec += " / " + ", ".join(param.secondary_opts)
    if not _is_flag(param):
        spec += f" {_metavar(param)}"
    extra = []
    default = _default(param)
    if default is not None:
        extra.append(f"default: {default}")
    if param.required:
        extra.append("required")
    help_text = " ".join((param.help or "").split())
    if extra:
        help_text += ("  " if help_text else "") + "[" + "; ".join(extra) + "]"
    return spec, help_text


def _usage_name(param: Any) -> str:
    name = _metavar(param) if param.metavar else (param.name or "ARG").upper()
    if param.nargs != 1:
        name += "..."
    return name if param.required else f"[{name}]"


def _format_params(command: Any, ctx: Any, formatter: Any) -> None:
    arguments, options = [], []
    for param in command.get_params(ctx):
        if getattr(param, "hidden", False):
            continue
        if param.param_type_name == "argument":
            help_text = " ".join((getattr(param, "help", None) or "").split())
            arguments.append((_usage_name(param).strip("[]"), help_text))
        else:
            options.append(_option_record(param))
    if arguments:
        with formatter.section("Arguments"):
            formatter.write_dl(arguments)
    if options:
        with formatter.section("Options"):
            formatter.write_dl(options)


class NebulaCommand(TyperCommand):
    """A command whose help and usage line are plain and exact (see the module)."""

    def format_help_text(self, ctx: Any, formatter: Any) -> None:
        """The docstring, its paragraphs re-flowed, but an `Example:` paragraph kept as
        written: a command line to copy is never broken over lines."""
        text = inspect.cleandoc(self.help or "").partition("\f")[0]
        paragraphs = [f"\b\n{p}" if p.startswith("Example:") else p for p in text.split("\n\n")]
        if text:
            formatter.write_paragraph()
            with formatter.indentation():
                formatter.write_text("\n\n".join(paragraphs))

    def collect_usage_pieces(self, ctx: Any) -> list[str]:
        pieces = [self.options_metavar] if self.options_metavar else []
        for param in self.get_params(ctx):
            if param.param_type_name == "argument" and not getattr(param, "hidden", False):
                pieces.append(_usage_name(param))
        return pieces

    def format_options(self, ctx: Any, formatter: Any) -> None:
        _format_params(self, ctx, formatter)

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        return super().parse_args(ctx, self._root_from_env(ctx, args))

    def _root_from_env(self, ctx: Any, args: list[str]) -> list[str]:
        """`args` with $NEBULA_PERSISTENT_STORAGE_PATH put first as ROOT when the command
        takes ROOT and was given fewer arguments than it needs with it (the required
        ones, or what `ROOT_POSITIONALS` says): `nebula inspect global_step500`. A word
        that could be ROOT is ROOT: `nebula verify TAG` names ROOT too."""
        root = os.environ.get(ROOT_ENV, "")
        arguments = [p for p in self.get_params(ctx) if p.param_type_name == "argument"]
        if not root or not arguments or arguments[0].name != "root":
            return args
        try:
            values, extra, _order = self.make_parser(ctx).parse_args(args=list(args))
        except _click.exceptions.UsageError:
            return args  # said when the command parses them
        given = sum(values.get(p.name) is not None for p in arguments) + len(extra)
        needed = ROOT_POSITIONALS.get(ctx.info_name)
        wanted = needed(values) if needed else sum(p.required for p in arguments)
        return [root, *args] if given < wanted else args


class NebulaGroup(TyperGroup):
    """The `nebula` group: plain help, whole first sentences in the command list, and
    usage errors as one line (see the module)."""

    def format_options(self, ctx: Any, formatter: Any) -> None:
        _format_params(self, ctx, formatter)
        rows = []
        for name in self.list_commands(ctx):
            command = self.get_command(ctx, name)
            if command is not None and not command.hidden:
                rows.append((name, command.get_short_help_str(limit=1000)))
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)

    def main(
        self,
        args: Sequence[str] | None = None,
        prog_name: str | None = None,
        complete_var: str | None = None,
        standalone_mode: bool = True,
        windows_expand_args: bool = True,
        **extra: Any,
    ) -> Any:
        args = list(sys.argv[1:] if args is None else args)
        args = _shell_defaulted(args)
        extra.setdefault("max_content_width", HELP_WIDTH)
        try:
            code = super().main(
                args=args,
                prog_name=prog_name,
                complete_var=complete_var,
                standalone_mode=False,
                windows_expand_args=windows_expand_args,
                **extra,
            )
        except _click.exceptions.NoArgsIsHelpError as exc:
            sys.stderr.write(exc.format_message() + "\n")
            code = EXIT_USAGE
        except _click.exceptions.UsageError as exc:
            sys.stderr.write(usage_error_line(exc) + "\n")
            code = EXIT_USAGE
            if "--json" in (args[: args.index("--")] if "--" in args else args):
                _json_usage_error(exc)
        except _click.ClickException as exc:
            sys.stderr.write(f"nebula: error: {_sentence(exc.format_message())}\n")
            code = exc.exit_code
        except Abort:
            sys.stderr.write("nebula: error: aborted\n")
            code = EXIT_ERROR
        if not isinstance(code, int):
            code = 0
        if standalone_mode:
            sys.exit(code)
        return code


def _json_usage_error(exc: Any) -> None:
    """A usage error of a command given --json, as its error object on stdout (exits.py
    `json_error`: the command never ran, so it wrote nothing)."""
    _plain_words(exc)
    token = JSON_STATE.set({"wanted": True, "written": False})
    try:
        json_error(_sentence(exc.format_message()), EXIT_USAGE)
    finally:
        JSON_STATE.reset(token)


# What a bad option value is told, by the type of pydantic's error (typer's parsing):
# plain words, as the commands' own checks write them, not "Input should be ...".
_PLAIN = {
    "int_parsing": "{input!r} is not a whole number",
    "int_from_float": "{input!r} is not a whole number",
    "float_parsing": "{input!r} is not a number",
    "bool_parsing": "{input!r} is not one of true, false, yes, no, 1, 0",
    "greater_than_equal": "must be at least {ge}, not {input}",
    "greater_than": "must be more than {gt}, not {input}",
    "less_than_equal": "must be at most {le}, not {input}",
    "less_than": "must be less than {lt}, not {input}",
}


def _plain_words(exc: Any) -> None:
    """A bad value's message in plain words, where typer gave pydantic's ('Input should be
    a valid integer, unable to parse string as an integer'): `'abc' is not a whole
    number`, `must be at least 0, not -3`."""
    cause = exc.__cause__
    errors = getattr(cause, "errors", None)
    if not callable(errors) or not isinstance(getattr(exc, "message", None), str):
        return
    try:
        (error,) = errors()
        words = _PLAIN[error["type"]].format(input=error.get("input"), **error.get("ctx", {}))
    except (ValueError, KeyError, TypeError, IndexError):
        words = exc.message.replace("Input should be", "must be")
    exc.message = words


def _sentence(message: str) -> str:
    """Click's 'Missing option '--keep'.' as nebula writes errors: 'missing option ...'."""
    message = " ".join(message.split())
    if message[:1].isupper() and message[1:2].islower():
        message = message[0].lower() + message[1:]
    return message[:-1] if message.endswith(".") else message


def usage_error_line(exc: Any) -> str:
    """`nebula: error: missing option '--keep' (see 'nebula prune --help')`."""
    ctx = getattr(exc, "ctx", None)
    where = ctx.command_path if ctx is not None else "nebula"
    _plain_words(exc)
    message = _sentence(exc.format_message())
    if message == "missing argument 'ROOT'":
        message += f": give it, or set {ROOT_ENV}"
    return f"nebula: error: {message} (see '{where} --help')"


_SHELL_OPTIONS = ("--show-completion", "--install-completion")


def _shell_defaulted(args: list[str]) -> list[str]:
    """`--show-completion` / `--install-completion` given no shell: `auto` (this shell, as
    detected) is put after it, so that they take an optional value."""
    for i, word in enumerate(args):
        if word in _SHELL_OPTIONS:
            if i + 1 == len(args) or args[i + 1].startswith("-"):
                return [*args[: i + 1], "auto", *args[i + 1 :]]
            return args
        if not word.startswith("-"):
            return args  # a command: what follows is its own
    return args
