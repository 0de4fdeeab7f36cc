"""The arguments and options the commands share (ROOT, TAG, --json, --quiet, --verbose,
--item, --storage-option), and reading the values of --storage-option and --since.

May import: complete.py (TAG and --item complete from the root), formatting.py, the
standard library and typer.
Not for: a command's own options (each command's module), running a command
(exits.py `handles_errors`) or the global options (app.py).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from typing import Annotated, Any

import typer

from .complete import complete_item, complete_tag
from .formatting import ROWS_SHOWN

# Where a command left without ROOT finds it (help.py `NebulaCommand`), as nm.init does.
ROOT_ENV = "NEBULA_PERSISTENT_STORAGE_PATH"
# How many arguments a command needs with ROOT, by command, where its required ones do
# not say (copy's TAG and DEST are optional to click): from the options parsed.
ROOT_POSITIONALS: dict[str, Callable[[dict[str, Any]], int]] = {}


def _root_given(value: str) -> str:
    """ROOT as given; an empty one refused (it would name the current folder unseen)."""
    if not value.strip():
        raise typer.BadParameter("must not be empty: a path ('.' for this folder) or a URL")
    return value


RootArg = Annotated[
    str,
    typer.Argument(
        metavar="ROOT",
        help="Checkpoint root: a path or an fsspec URL (its memory tier on this node is "
        f"included). Left out: ${ROOT_ENV}.",
        callback=_root_given,
    ),
]
TagArg = Annotated[
    str,
    typer.Argument(
        metavar="TAG",
        help="The checkpoint's tag, e.g. global_step500.",
        autocompletion=complete_tag,
    ),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON document on stdout.")]
QuietOpt = Annotated[
    bool,
    typer.Option(
        "--quiet",
        "-q",
        help="No progress and no retry notices on stderr (warnings and errors still).",
    ),
]
VerboseOpt = Annotated[
    bool,
    typer.Option(
        "--verbose",
        "-v",
        help=f"Show every row and tag (else the first {ROWS_SHOWN} of a kind, and a count).",
    ),
]
StorageOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--storage-option",
        metavar="KEY=VALUE",
        show_default=False,
        help="An fsspec storage option for URL roots, repeatable: e.g. account_name=ACCOUNT "
        "with sas_token=... or account_key=..., or connection_string=... (az://). Without "
        "it Azure credentials come from AZURE_STORAGE_CONNECTION_STRING, "
        "AZURE_STORAGE_ACCOUNT_NAME with _KEY or _SAS_TOKEN, else DefaultAzureCredential.",
    ),
]


def since_option(what: str) -> Any:
    """`--since WHEN` (read by `parse_since`), keeping `what` was at or after WHEN."""
    return typer.Option(
        "--since",
        metavar="WHEN",
        parser=parse_since,
        help=f"Only {what} at or after WHEN: an ISO-8601 time (UTC unless it names an offset) "
        "or a duration back from now: 30m, 2h, 7d.",
    )


def item_option(help_text: str) -> Any:
    """`--item NAME` (completed from the checkpoint's items), with this help text."""
    return typer.Option("--item", metavar="NAME", help=help_text, autocompletion=complete_item)


# Fields of an Azure connection string: given without `connection_string=`, the first one
# would otherwise pass for an option's name.
_CONNECTION_STRING_FIELDS = (
    "DefaultEndpointsProtocol",
    "AccountName",
    "AccountKey",
    "BlobEndpoint",
    "SharedAccessSignature",
    "EndpointSuffix",
    "UseDevelopmentStorage",
)


def parse_storage_options(items: list[str] | None) -> dict[str, str]:
    """`--storage-option KEY=VALUE` values as a dict (a later KEY wins).

    A malformed one is a usage error that never repeats what was given: it may hold a
    secret. An Azure connection string given without `connection_string=` is refused
    (its first field would pass for a KEY).

    Example:
        >>> parse_storage_options(["account_name=acct", "sas_token=sv=1&sig=x"])
        {'account_name': 'acct', 'sas_token': 'sv=1&sig=x'}
    """
    options: dict[str, str] = {}
    for number, item in enumerate(items or [], start=1):
        key, sep, value = item.partition("=")
        key = key.strip()
        if key in _CONNECTION_STRING_FIELDS or (
            key != "connection_string" and any(f"{f}=" in value for f in _CONNECTION_STRING_FIELDS)
        ):
            raise typer.BadParameter(
                f"storage option #{number} looks like an Azure connection string; give it "
                "as connection_string=... (quoted)",
                param_hint="--storage-option",
            )
        if not sep or not key.isidentifier():  # e.g. a key pasted without its name
            raise typer.BadParameter(
                f"storage option #{number} is not KEY=VALUE (KEY a name like account_name)",
                param_hint="--storage-option",
            )
        options[key] = value
    return options


_DURATION_RE = re.compile(r"(\d+(?:\.\d+)?)\s*([smhdw])")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_since(text: str) -> datetime:
    """`--since`: an ISO-8601 time (UTC unless it names an offset) or a duration back from
    now (`90s`, `30m`, `2h`, `7d`, `1w`); a timezone-aware datetime.

    Example:
        >>> parse_since("2026-01-01T10:00:00Z").isoformat()
        '2026-01-01T10:00:00+00:00'
    """
    text = text.strip()
    match = _DURATION_RE.fullmatch(text)
    if match:
        seconds = float(match[1]) * _UNIT_S[match[2]]
        return datetime.now(timezone.utc) - timedelta(seconds=seconds)
    try:
        when = datetime.fromisoformat(text.replace("Z", "+00:00").replace("z", "+00:00"))
    except ValueError:
        raise typer.BadParameter(
            f"{text!r} is neither an ISO-8601 time (2026-01-31T09:00:00Z) nor a duration "
            "(30m, 2h, 7d)"
        ) from None
    return when if when.tzinfo is not None else when.replace(tzinfo=timezone.utc)
