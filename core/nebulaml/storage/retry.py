"""Bounded retries of transient storage errors, for the storage boundary.

A network store fails now and then in ways that a second try fixes: a timeout, a reset
connection, a 5xx, throttling (408, 429). `RetryPolicy` says how often and how long to
try again (exponential backoff with jitter, capped); `is_transient` says which errors
those are. Anything else (403, 404, a conflict, a bug) is raised at once.

The policy comes from storage options (`nebula_retries`, `nebula_retry_base_s`,
`nebula_retry_max_s`, `nebula_call_timeout_s`), else the environment
(`NEBULA_STORAGE_RETRIES`, `NEBULA_STORAGE_RETRY_BASE_S`, `NEBULA_STORAGE_RETRY_MAX_S`,
`NEBULA_STORAGE_CALL_TIMEOUT_S`), else the defaults: 5 retries, 0.5 s doubling to at most
8 s (about 15 s of waiting in all), and a call of a network store answered within 30 s,
its retries included (deadline.py). No retry starts that would end past the deadline of
the block it runs in (`deadline.within`), nor any inside a block that forbids them.

Not for: translating errors (failures.py) or deciding what an operation is (its caller).
"""

from __future__ import annotations

import asyncio
import logging
import random
import sys
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from nebulaml.config import (
    ENV_STORAGE_CALL_TIMEOUT_S,
    ENV_STORAGE_RETRIES,
    ENV_STORAGE_RETRY_BASE_S,
    ENV_STORAGE_RETRY_MAX_S,
)
from nebulaml.errors import InvalidArgumentError, NebulaError, exception_chain
from nebulaml.storage.deadline import retry_allowed

log = logging.getLogger("nebulaml")

T = TypeVar("T")

OPTION_RETRIES = "nebula_retries"
OPTION_BASE_S = "nebula_retry_base_s"
OPTION_MAX_S = "nebula_retry_max_s"
OPTION_CALL_TIMEOUT_S = "nebula_call_timeout_s"
OPTION_NAMES = (OPTION_RETRIES, OPTION_BASE_S, OPTION_MAX_S, OPTION_CALL_TIMEOUT_S)

_TRANSIENT_STATUS = frozenset({408, 429, 500, 502, 503, 504})
# Outcomes that a retry cannot change, whatever caused them.
_DEFINITIVE = (FileNotFoundError, FileExistsError, PermissionError, IsADirectoryError)


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """How many times to retry a transient failure, and the backoff between tries.

    Example:
        >>> policy = RetryPolicy(retries=4, base_s=0.5, max_s=2.0)
        >>> list(policy.delays(jitter=False))
        [0.5, 1.0, 2.0, 2.0]
    """

    retries: int = 5
    base_s: float = 0.5
    max_s: float = 8.0
    call_timeout_s: float = 30.0  # one call of a network store, its retries included

    def delays(self, *, jitter: bool = True) -> Iterator[float]:
        """The wait before each retry: base_s doubling up to max_s, less up to half of it
        at random (so that many ranks retrying at once spread out)."""
        for attempt in range(self.retries):
            delay = float(min(self.max_s, self.base_s * (2**attempt)))
            yield delay * random.uniform(0.5, 1.0) if jitter else delay

    @classmethod
    def from_options(cls, options: Mapping[str, Any], env: Mapping[str, str]) -> RetryPolicy:
        """The policy that storage options, else the environment, else defaults give."""
        default = cls()

        def pick(option: str, var: str, kind: type, fallback: Any) -> Any:
            value, source = options.get(option), option
            if value is None:
                value, source = env.get(var), var
            if value is None or value == "":
                return fallback
            try:
                if isinstance(value, bool):
                    raise ValueError
                number = kind(value)
            except (TypeError, ValueError):
                raise InvalidArgumentError(
                    f"{source} must be a {kind.__name__}, not {value!r}"
                ) from None
            if number != number:  # NaN: every comparison with it is False
                raise InvalidArgumentError(f"{source} must be a number, not {value!r}")
            if number < 0:
                raise InvalidArgumentError(f"{source} must not be negative, not {value!r}")
            return number

        call_timeout_s = pick(
            OPTION_CALL_TIMEOUT_S, ENV_STORAGE_CALL_TIMEOUT_S, float, default.call_timeout_s
        )
        return cls(
            retries=pick(OPTION_RETRIES, ENV_STORAGE_RETRIES, int, default.retries),
            base_s=pick(OPTION_BASE_S, ENV_STORAGE_RETRY_BASE_S, float, default.base_s),
            max_s=pick(OPTION_MAX_S, ENV_STORAGE_RETRY_MAX_S, float, default.max_s),
            call_timeout_s=call_timeout_s or _refuse_zero(),
        )


def _refuse_zero() -> float:
    raise InvalidArgumentError(
        f"{OPTION_CALL_TIMEOUT_S} ({ENV_STORAGE_CALL_TIMEOUT_S}) must be more than 0 s"
    )


def is_transient(exc: BaseException) -> bool:
    """Whether a second try might succeed: timeouts, dropped or refused connections,
    HTTP 408/429/5xx, whether raised directly or wrapped by the storage library.

    Example:
        >>> is_transient(ConnectionResetError()), is_transient(FileNotFoundError())
        (True, False)
    """
    if isinstance(exc, (NebulaError, *_DEFINITIVE)):
        return False
    for current in exception_chain(exc):
        verdict = _classify(current)
        if verdict is not None:
            return verdict
    return False


def _classify(exc: BaseException) -> bool | None:
    """True or False when `exc` decides it; None to look at what it wraps."""
    if isinstance(exc, (ConnectionError, TimeoutError, asyncio.TimeoutError)):
        return True
    if isinstance(exc, _DEFINITIVE):
        return False
    azure = sys.modules.get("azure.core.exceptions")
    if azure is not None:
        if isinstance(exc, (azure.ServiceRequestError, azure.ServiceResponseError)):
            return True
        if isinstance(exc, azure.IncompleteReadError):
            return True
        if isinstance(exc, azure.HttpResponseError):
            status = getattr(exc, "status_code", None)
            if status is None:
                return None  # no response: decided by what it wraps
            return status in _TRANSIENT_STATUS or status >= 500
    botocore = sys.modules.get("botocore.exceptions")  # S3's (s3fs, aiobotocore)
    if botocore is not None:
        if isinstance(exc, (botocore.EndpointConnectionError, botocore.ConnectionClosedError,
                            botocore.ReadTimeoutError, botocore.ConnectTimeoutError)):  # fmt: skip
            return True
        if isinstance(exc, botocore.ClientError):
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if status is None:
                return None
            return status in _TRANSIENT_STATUS or status >= 500
    gcsfs = sys.modules.get("gcsfs.retry")  # GCS's (gcsfs): an answer that is not 2xx
    if gcsfs is not None and isinstance(exc, gcsfs.HttpError):
        code = getattr(exc, "code", None)
        return None if not isinstance(code, int) else code in _TRANSIENT_STATUS or code >= 500
    aiohttp = sys.modules.get("aiohttp")
    if aiohttp is not None and isinstance(exc, aiohttp.ClientError):
        # A 4xx answer is an answer; a broken connection or payload is not.
        return not isinstance(exc, aiohttp.ClientResponseError) or exc.status >= 500
    return None


def call(
    fn: Callable[[], T],
    policy: RetryPolicy,
    what: str,
    *,
    describe: Callable[[BaseException], str] = str,
) -> T:
    """`fn()`, tried again after a transient failure as `policy` allows; the last failure
    (or the first that is not transient) is raised as it is."""
    retries = _Retries(policy, what, describe)
    while True:
        try:
            return fn()
        except Exception as exc:
            delay = retries.after(exc)
            if delay is None:
                raise
            time.sleep(delay)


async def call_async(
    fn: Callable[[], Awaitable[T]],
    policy: RetryPolicy,
    what: str,
    *,
    describe: Callable[[BaseException], str] = str,
) -> T:
    """`call` for coroutines (the Azure block uploads run on fsspec's event loop)."""
    retries = _Retries(policy, what, describe)
    while True:
        try:
            return await fn()
        except Exception as exc:
            delay = retries.after(exc)
            if delay is None:
                raise
            await asyncio.sleep(delay)


class _Retries:
    """The retries of one `call`: after each failure, the delay before the next try (the
    retry logged), or None when the failure is to be raised."""

    def __init__(
        self, policy: RetryPolicy, what: str, describe: Callable[[BaseException], str]
    ) -> None:
        self._policy, self._what, self._describe = policy, what, describe
        self._delays = policy.delays()
        self._attempt = 0

    def after(self, exc: BaseException) -> float | None:
        if not is_transient(exc):
            return None
        delay = next(self._delays, None)
        if delay is None or not retry_allowed(delay):
            return None  # no retry left, or none that ends before the block's deadline
        self._attempt += 1
        _log_retry(self._what, exc, self._attempt, self._policy, delay, self._describe)
        return delay


def _log_retry(
    what: str,
    exc: BaseException,
    attempt: int,
    policy: RetryPolicy,
    delay: float,
    describe: Callable[[BaseException], str],
) -> None:
    # The command line prints each retry (nebula_cli/logs.py knows this function's name).
    log.info(
        "%s: %s; retry %d of %d in %.2f s",
        what,
        describe(exc),
        attempt,
        policy.retries,
        delay,
    )


async def all_or_cancel(jobs: list[Awaitable[None]]) -> None:
    """Run `jobs` concurrently; on the first failure cancel the rest and wait for them
    (none may still read the caller's memory once this returns), then raise it. The
    uploads of a write by ranges run so (azure_ranges.py, s3_parts.py).

    Example:
        >>> async def fail() -> None: raise OSError("gone")
        >>> asyncio.run(all_or_cancel([asyncio.sleep(0), fail()]))
        Traceback (most recent call last):
        OSError: gone
    """
    tasks = [asyncio.ensure_future(job) for job in jobs]
    if not tasks:
        return
    _, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    for task in pending:
        task.cancel()
    outcomes = await asyncio.gather(*tasks, return_exceptions=True)
    for outcome in outcomes:
        if isinstance(outcome, BaseException) and not isinstance(outcome, asyncio.CancelledError):
            raise outcome
