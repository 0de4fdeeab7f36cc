"""Keeping storage secrets out of every message nebula writes.

Storage options and Azure connection strings carry account keys, SAS signatures, client
secrets and tokens. `redact` is the one function that masks them: the storage boundary
applies it to every error message it raises and every log line it writes, and scrubs the
backend exceptions it chains (`scrub_exception`), so neither a traceback, a history row,
nor CLI output can show a secret.

Not for: deciding what is a credential for a backend (azure_auth.py resolves those).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterable, Mapping
from typing import Any

from nebulaml.errors import exception_chain

MASK = "***"

# Option names whose values are secrets, wherever they appear (storage options, kwargs).
SECRET_OPTION_NAMES = frozenset(
    {
        "account_key",
        "sas_token",
        "credential",
        "client_secret",
        "connection_string",
        "password",
        "token",
        # S3's (s3fs's options, botocore's client_kwargs)
        "secret",
        "aws_secret_access_key",
        "aws_session_token",
    }
)

_KEY_NAMES = "|".join(sorted(SECRET_OPTION_NAMES, key=len, reverse=True))
_PATTERNS: tuple[tuple[re.Pattern[str], str], ...] = (
    # Connection strings: AccountKey=...; SharedAccessSignature=...;
    (re.compile(r"(?i)\b(AccountKey|SharedAccessSignature)=[^;\s'\"]*"), rf"\1={MASK}"),
    # A SAS signature in a URL or token: sig=...& (the only secret part of a SAS).
    (re.compile(r"(?i)([?&;\s'\"]|^)sig=[^&;\s'\"]*"), rf"\1sig={MASK}"),
    # Authorization headers: SharedKey account:signature, Bearer token.
    (re.compile(r"(?i)\b(SharedKey(?:Lite)?\s+[^:\s'\"]+:)[^\s'\",]+"), rf"\1{MASK}"),
    (re.compile(r"(?i)\b(Bearer\s+)[^\s'\",]+"), rf"\1{MASK}"),
    # key=value and 'key': 'value' forms of secret option names (reprs, kwargs, logs).
    (
        re.compile(rf"(?i)(['\"]?\b(?:{_KEY_NAMES})['\"]?\s*[:=]\s*)(['\"])(.*?)\2"),
        rf"\1\2{MASK}\2",
    ),
    (re.compile(rf"(?i)(\b(?:{_KEY_NAMES})=)(?!['\"])[^\s,;&)}}]+"), rf"\1{MASK}"),
)


def redact(text: str, secrets: Iterable[str] = ()) -> str:
    """`text` with credentials masked: the `secrets` given (literal values), and anything
    that looks like an account key, SAS signature, secret option or auth header.

    Example:
        >>> redact("DefaultEndpointsProtocol=http;AccountName=a;AccountKey=c2VjcmV0;")
        'DefaultEndpointsProtocol=http;AccountName=a;AccountKey=***;'
        >>> redact("GET /c/b?sv=2024-08-04&sig=abc%2Bdef&se=x")
        'GET /c/b?sv=2024-08-04&sig=***&se=x'
        >>> redact("{'account_key': 'k3y', 'account_name': 'acct'}")
        "{'account_key': '***', 'account_name': 'acct'}"
        >>> redact("token xyz123 was refused", secrets=["xyz123"])
        'token *** was refused'
    """
    # Longest first, so that a secret containing another one is masked whole.
    for secret in sorted({s for s in secrets if s and len(s) >= 4}, key=len, reverse=True):
        text = text.replace(secret, MASK)
    for pattern, replacement in _PATTERNS:
        text = pattern.sub(replacement, text)
    return text


def secrets_in(options: Mapping[str, Any]) -> tuple[str, ...]:
    """The literal secret strings among storage options: values of secret option names,
    and the key and signature inside a connection string or SAS token.

    Example:
        >>> secrets_in({"account_name": "a", "sas_token": "sv=1&sig=s1gn"})
        ('sv=1&sig=s1gn', 's1gn')
    """
    found: list[str] = []
    for name, value in options.items():
        if name.lower() not in SECRET_OPTION_NAMES or not isinstance(value, str) or not value:
            continue
        found.append(value)
        for match in re.finditer(r"(?i)(?:AccountKey|sig)=([^;&\s]+)", value):
            found.append(match.group(1))
    return tuple(dict.fromkeys(found))


def scrub_exception(exc: BaseException, secrets: Iterable[str] = ()) -> None:
    """Redact, in place, the messages of `exc` and of every exception chained to it.

    A backend exception stays chained to the `StorageError` that reports it (its
    traceback is useful), so its own text must be clean too: a traceback prints it.
    """
    secrets = tuple(secrets)
    for current in exception_chain(exc):
        _scrub_one(current, secrets)


def _scrub_one(exc: BaseException, secrets: tuple[str, ...]) -> None:
    args = tuple(redact(a, secrets) if isinstance(a, str) else a for a in exc.args)
    if args != exc.args:
        exc.args = args
    for attr in ("message", "reason", "strerror", "filename", "filename2"):
        value = getattr(exc, attr, None)
        if isinstance(value, str):
            clean = redact(value, secrets)
            if clean != value:
                # A read-only property reads its args, which are scrubbed already.
                with contextlib.suppress(AttributeError):
                    setattr(exc, attr, clean)
