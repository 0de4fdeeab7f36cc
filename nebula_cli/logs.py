"""What a command lets through of the Python logging of the processes it drives: nebula's
own log as `nebula: retrying: ...` and `nebula: warning: ...` lines on stderr, and nothing
of the storage SDKs' unless asked.

The Azure SDK and adlfs log warnings of their own (a credential chain that found no
token writes a dozen lines), which Python prints on stderr when no one configured logging:
on a terminal they bury nebula's one-line error, which already says what failed. A
command given `--verbose` lets them through, for when that line is not enough.

Not for: the error line itself (exits.py `handles_errors`) or progress (progress.py).
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator

from .console import printable

# The loggers of what nebula drives under az:// and other fsspec URLs: their children too
# (azure.identity, azure.core.pipeline...), whose level is their parent's.
SDK_LOGGERS = ("azure", "adlfs", "fsspec", "aiohttp", "asyncio", "urllib3")
_SILENT = logging.CRITICAL + 1


class _LibraryLog(logging.Handler):
    """The library's log on stderr while a command runs: each storage retry as a line
    (`nebula: retrying: ...`, unless --quiet) and every warning (`nebula: warning: ...`)."""

    def __init__(self, quiet: bool) -> None:
        super().__init__(logging.INFO)
        self.quiet = quiet

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = record.getMessage()
        except (TypeError, ValueError):
            message = str(record.msg)
        if record.funcName == "_log_retry":
            if not self.quiet:
                sys.stderr.write(f"nebula: retrying: {printable(message)}\n")
        elif record.levelno >= logging.WARNING:
            sys.stderr.write(f"nebula: warning: {printable(message)}\n")


@contextlib.contextmanager
def command_logging(quiet: bool, verbose: bool) -> Iterator[None]:
    """For the length of a command: nebula's log on stderr (`_LibraryLog`), and the
    storage SDKs' loggers silenced unless `verbose`. Each logger is left as it was found.

    Example:
        >>> with command_logging(quiet=False, verbose=False):
        ...     logging.getLogger("azure.identity").isEnabledFor(logging.CRITICAL)
        False
    """
    logger = logging.getLogger("nebulaml")
    handler = _LibraryLog(quiet)
    level = logger.level
    logger.addHandler(handler)
    if logger.getEffectiveLevel() > logging.INFO:
        logger.setLevel(logging.INFO)
    silenced = {} if verbose else {name: logging.getLogger(name).level for name in SDK_LOGGERS}
    for name in silenced:
        logging.getLogger(name).setLevel(_SILENT)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        for name, old in silenced.items():
            logging.getLogger(name).setLevel(old)
