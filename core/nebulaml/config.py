"""Every environment variable nebula reads, and the functions that read and check them.

    NEBULA_PERSISTENT_STORAGE_PATH      init()'s persistent_storage_path (none: memory only)
    NEBULA_PERSISTENT_TIME_INTERVAL     init()'s persistent_time_interval (s, default 100)
    NEBULA_NUM_OF_VERSION_IN_RETENTION  init()'s num_of_version_in_retention (default 2)
    NEBULA_EXIT_TIMEOUT_S               init()'s exit_timeout_s (default 600)
    NEBULA_RANK_TIMEOUT_S               init()'s rank_timeout_s (default 300)
    NEBULA_LAZY_SNAPSHOT                init()'s lazy_snapshot: "auto" (the default), or a
                                        boolean (on: every save lazy; off: none)
    NEBULA_KEEP_MEMORY_TIER             init()'s keep_memory_tier (a boolean; default off)
    NEBULA_REUSE_UNCHANGED              init()'s reuse_unchanged (a boolean; default on; off:
                                        every save copies every tensor)
    NEBULA_SPARE_BUFFERS                init()'s spare_buffers (a boolean; default on; off:
                                        the memory tier keeps no buffer for the next save)
    NEBULA_ON_PERSIST_ERROR             init()'s on_persist_error: "retry" (default) or "raise"
    NEBULA_PEER_REPLICAS                init()'s peer_replicas: 0 (default) or 1 (each node's
                                        memory tier replicated to the next node)
    NEBULA_PRIVATE                      init()'s private, and what the CLI writes to a local
                                        root or exports (a boolean; on: files 0600, folders
                                        0700)
    NEBULA_MEMORY_BUFFER_SIZE           the node's memory budget in bytes (half for checkpoints)
    NEBULA_MEMORY_TIER_PATH             the base folder of this user's memory tiers
    NEBULA_STORAGE_RETRIES              retries of a transient storage error (default 5)
    NEBULA_STORAGE_RETRY_BASE_S         the first backoff (s, default 0.5), doubling
    NEBULA_STORAGE_RETRY_MAX_S          the longest backoff (s, default 8)
    NEBULA_STORAGE_CALL_TIMEOUT_S       how long one call to a network store may go
                                        unanswered, its retries included (s, default 30)
    NEBULA_JOB_ID                       which job this process is of (runtime/job.py; default:
                                        from torchrun's or the rendezvous's variables)
    RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE   torchrun's (runtime/ranks.py)
    GROUP_RANK                          torchrun's node of this process (runtime/peers.py)
    TORCHELASTIC_RUN_ID, TORCHELASTIC_RESTART_COUNT  torchrun's run and restart: the
                                        generation of a job's checkpoint parts (ranks.py)

A boolean is 1/true/yes/on or 0/false/no/off, in any case (`env_flag`); unset or empty:
the default. `init()`'s settings are resolved here (`resolve_config`: arguments first, then the
environment, then the defaults; bad values refused), the others read when they are used.

May import: `nebulaml.errors` only (the base layer). Not for: Azure's own variables
(`AZURE_STORAGE_*`, read by the Azure modules of storage/ as the Azure SDK names them) or
what the settings do (session, budget, tiers, retries).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from nebulaml.errors import InvalidArgumentError

ENV_PATH = "NEBULA_PERSISTENT_STORAGE_PATH"
ENV_INTERVAL = "NEBULA_PERSISTENT_TIME_INTERVAL"
ENV_RETENTION = "NEBULA_NUM_OF_VERSION_IN_RETENTION"
ENV_EXIT_TIMEOUT = "NEBULA_EXIT_TIMEOUT_S"
ENV_RANK_TIMEOUT = "NEBULA_RANK_TIMEOUT_S"
ENV_LAZY = "NEBULA_LAZY_SNAPSHOT"
ENV_KEEP_MEMORY_TIER = "NEBULA_KEEP_MEMORY_TIER"
ENV_REUSE_UNCHANGED = "NEBULA_REUSE_UNCHANGED"
ENV_SPARE_BUFFERS = "NEBULA_SPARE_BUFFERS"
ENV_ON_PERSIST_ERROR = "NEBULA_ON_PERSIST_ERROR"
ENV_PEER_REPLICAS = "NEBULA_PEER_REPLICAS"
ENV_PRIVATE = "NEBULA_PRIVATE"
ENV_MEMORY_BUFFER = "NEBULA_MEMORY_BUFFER_SIZE"
ENV_MEMORY_TIER_PATH = "NEBULA_MEMORY_TIER_PATH"
ENV_STORAGE_RETRIES = "NEBULA_STORAGE_RETRIES"
ENV_STORAGE_RETRY_BASE_S = "NEBULA_STORAGE_RETRY_BASE_S"
ENV_STORAGE_RETRY_MAX_S = "NEBULA_STORAGE_RETRY_MAX_S"
ENV_STORAGE_CALL_TIMEOUT_S = "NEBULA_STORAGE_CALL_TIMEOUT_S"
# A persistent root whose store has no atomic create-only publish, used by one writer at a
# time (storage/atomic_probe.py).
ENV_SINGLE_WRITER = "NEBULA_SINGLE_WRITER"
# torchrun's (and most launchers'): who this process is in the job.
ENV_RANK = "RANK"
ENV_WORLD_SIZE = "WORLD_SIZE"
ENV_LOCAL_RANK = "LOCAL_RANK"
ENV_LOCAL_WORLD_SIZE = "LOCAL_WORLD_SIZE"
ENV_GROUP_RANK = "GROUP_RANK"  # the node's number in the job (runtime/peers.py)
ENV_ELASTIC_RUN_ID = "TORCHELASTIC_RUN_ID"
ENV_ELASTIC_RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"
ENV_JOB_ID = "NEBULA_JOB_ID"
ENV_MASTER_ADDR = "MASTER_ADDR"  # the rendezvous of a job's ranks (runtime/job.py)
ENV_MASTER_PORT = "MASTER_PORT"

DEFAULT_INTERVAL_S = 100.0
DEFAULT_RETENTION = 2
DEFAULT_EXIT_TIMEOUT_S = 600.0
DEFAULT_RANK_TIMEOUT_S = 300.0
KNOWN_OPTIONS = (
    "storage_options",
    "exit_timeout_s",
    "rank_timeout_s",
    "lazy_snapshot",
    "keep_memory_tier",
    "on_persist_error",
    "private",
    "reuse_unchanged",
    "peer_replicas",
    "spare_buffers",
)
# What a failed persist does: "raise" (the default, for now: the next call into nebula
# raises the failure) or "retry" (the memory tier keeps the checkpoint and the persister
# tries again until it is durable; training is never stopped).
PERSIST_ERROR_MODES = ("retry", "raise")
# How many other nodes keep a replica of each node's memory-tier parts (runtime/peers.py,
# runtime/replication.py): none, or the next node of the ring.
PEER_REPLICA_COUNTS = (0, 1)
# lazy_snapshot's default: a save's copy is deferred where every write to what it has not
# copied yet is seen (runtime/fence.py says where), and taken at save() elsewhere.
LAZY_AUTO = "auto"
# The words a boolean variable accepts, in any case; anything else is refused.
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


@dataclass(frozen=True, slots=True)
class Config:
    """What `init()` resolved from its arguments and the environment."""

    persistent_storage_path: str | None
    persistent_time_interval_s: float
    num_of_version_in_retention: int
    exit_timeout_s: float
    rank_timeout_s: float = DEFAULT_RANK_TIMEOUT_S
    storage_options: tuple[tuple[str, Any], ...] = ()
    lazy_snapshot: bool | str = LAZY_AUTO
    keep_memory_tier: bool = False
    on_persist_error: str = "retry"
    private: bool = False
    reuse_unchanged: bool = True
    peer_replicas: int = 0
    spare_buffers: bool = True


def _number(value: object, source: str, kind: type, minimum: float) -> Any:
    try:
        if isinstance(value, bool):
            raise ValueError
        number = kind(value)
        if kind is int and isinstance(value, float) and not value.is_integer():
            raise ValueError
    except (TypeError, ValueError):
        raise InvalidArgumentError(f"{source} must be a {kind.__name__}, not {value!r}") from None
    if number != number:  # NaN: every comparison with it is False
        raise InvalidArgumentError(f"{source} must be a number, not {value!r}")
    if number < minimum:
        raise InvalidArgumentError(f"{source} must be at least {minimum}, not {value!r}")
    return number


def resolve_config(
    persistent_storage_path: Any,
    persistent_time_interval: Any,
    num_of_version_in_retention: Any,
    options: dict[str, Any],
) -> Config:
    """Arguments first, then the environment, then the defaults; bad values are refused.

    Example:
        >>> resolve_config("/ckpt", 5, None, {"lazy_snapshot": True}).lazy_snapshot
        True
    """
    unknown = sorted(set(options) - set(KNOWN_OPTIONS))
    if unknown:  # a typo (path=...) would otherwise run memory-only: nothing made durable
        raise TypeError(
            f"nm.init() got unexpected keyword argument(s) {', '.join(map(repr, unknown))}; "
            "it takes persistent_storage_path, persistent_time_interval, "
            f"num_of_version_in_retention and {', '.join(KNOWN_OPTIONS)}"
        )
    path = persistent_storage_path
    # The seed writes `persistent_storage_path="/tmp/test",` (a one-element tuple).
    if isinstance(path, (tuple, list)) and len(path) == 1:
        path = path[0]
    if path is None:
        path = os.environ.get(ENV_PATH) or None
    if path is not None:
        if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
            raise InvalidArgumentError(
                f"persistent_storage_path must be a path or URL, not {persistent_storage_path!r}"
            )
        path = os.fspath(path)
    interval = persistent_time_interval
    if interval is None:
        interval = os.environ.get(ENV_INTERVAL, DEFAULT_INTERVAL_S)
        interval_src = ENV_INTERVAL if ENV_INTERVAL in os.environ else "persistent_time_interval"
    else:
        interval_src = "persistent_time_interval"
    retention = num_of_version_in_retention
    retention_src = "num_of_version_in_retention"
    if retention is None:
        retention = os.environ.get(ENV_RETENTION, DEFAULT_RETENTION)
        retention_src = ENV_RETENTION if ENV_RETENTION in os.environ else retention_src
    rank_timeout, rank_timeout_src = _option_or_env(
        options, "rank_timeout_s", ENV_RANK_TIMEOUT, DEFAULT_RANK_TIMEOUT_S
    )
    exit_timeout, exit_timeout_src = _option_or_env(
        options, "exit_timeout_s", ENV_EXIT_TIMEOUT, DEFAULT_EXIT_TIMEOUT_S
    )
    lazy = _lazy_mode(options.get("lazy_snapshot"))
    keep = _flag(options, "keep_memory_tier", ENV_KEEP_MEMORY_TIER, False)
    on_error, on_error_src = _option_or_env(
        options, "on_persist_error", ENV_ON_PERSIST_ERROR, "retry"
    )
    if on_error_src == ENV_ON_PERSIST_ERROR:
        on_error = on_error.strip().lower() or "retry"
    if on_error not in PERSIST_ERROR_MODES:
        raise InvalidArgumentError(
            f"{on_error_src} must be one of {', '.join(PERSIST_ERROR_MODES)}, not {on_error!r}"
        )
    private = _flag(options, "private", ENV_PRIVATE, False)
    reuse = _flag(options, "reuse_unchanged", ENV_REUSE_UNCHANGED, True)
    spares = _flag(options, "spare_buffers", ENV_SPARE_BUFFERS, True)
    peers = options.get("peer_replicas")
    peers_src = "peer_replicas"
    if peers is None and os.environ.get(ENV_PEER_REPLICAS, "").strip():
        peers, peers_src = os.environ[ENV_PEER_REPLICAS].strip(), ENV_PEER_REPLICAS
    peer_replicas = _peer_replicas(0 if peers is None else peers, peers_src)
    storage_options = options.get("storage_options") or {}
    if not isinstance(storage_options, dict):
        raise InvalidArgumentError("storage_options must be a dict")
    return Config(
        persistent_storage_path=path,
        persistent_time_interval_s=_number(interval, interval_src, float, 0),
        num_of_version_in_retention=_number(retention, retention_src, int, 1),
        exit_timeout_s=_number(exit_timeout, exit_timeout_src, float, 0),
        rank_timeout_s=_number(rank_timeout, rank_timeout_src, float, 0),
        storage_options=tuple(sorted(storage_options.items())),
        lazy_snapshot=lazy,
        keep_memory_tier=keep,
        on_persist_error=on_error,
        private=private,
        reuse_unchanged=reuse,
        peer_replicas=peer_replicas,
        spare_buffers=spares,
    )


def _option_or_env(
    options: dict[str, Any], option: str, variable: str, default: Any
) -> tuple[Any, str]:
    """The option if given, else the variable if set, else the default; with the name an
    error about the value should give (the option's, or the variable's)."""
    if options.get(option) is not None:
        return options[option], option
    if variable in os.environ:
        return os.environ[variable], variable
    return default, option


def _lazy_mode(value: Any) -> bool | str:
    """init()'s `lazy_snapshot`: True, False or "auto"; else `NEBULA_LAZY_SNAPSHOT` (a
    boolean word, or "auto"); else "auto".

    Example:
        >>> _lazy_mode(None), _lazy_mode(False), _lazy_mode("auto")
        ('auto', False, 'auto')
    """
    if value is None:
        word = os.environ.get(ENV_LAZY, "").strip().lower()
        if word in ("", LAZY_AUTO):
            return LAZY_AUTO
        if word not in _TRUE + _FALSE:
            raise InvalidArgumentError(
                f"{ENV_LAZY} must be auto, one of {', '.join(_TRUE)} (every save lazy) or one "
                f"of {', '.join(_FALSE)} (every save copied at once), not {word!r}"
            )
        return word in _TRUE
    if value is not True and value is not False and value != LAZY_AUTO:
        raise InvalidArgumentError(f"lazy_snapshot must be True, False or 'auto', not {value!r}")
    return value


def _flag(options: dict[str, Any], option: str, variable: str, default: bool) -> bool:
    """A boolean option (True or False), else its variable (`env_flag`), else the default."""
    value = options.get(option)
    if value is None:
        return env_flag(variable, default)
    if not isinstance(value, bool):
        raise InvalidArgumentError(f"{option} must be True or False, not {value!r}")
    return value


def env_flag(name: str, default: bool) -> bool:
    """The boolean environment variable `name`: 1/true/yes/on or 0/false/no/off, in any
    case; unset or empty: `default`. Anything else raises `InvalidArgumentError` naming
    the variable and these words (`NEBULA_PRIVATE=y` too: a guess could leave files
    readable that were meant to be private).

    Example:
        >>> import os
        >>> os.environ["NEBULA_EXAMPLE_FLAG"] = "Off"
        >>> env_flag("NEBULA_EXAMPLE_FLAG", True), env_flag("NEBULA_NOT_SET", True)
        (False, True)
        >>> del os.environ["NEBULA_EXAMPLE_FLAG"]
    """
    value = os.environ.get(name, "")
    word = value.strip().lower()
    if not word:
        return default
    if word in _TRUE or word in _FALSE:
        return word in _TRUE
    raise InvalidArgumentError(
        f"{name} must be one of {', '.join(_TRUE)} (on) or {', '.join(_FALSE)} (off), "
        f"in any case; not {value!r}"
    )


def _peer_replicas(value: object, source: str) -> int:
    """`peer_replicas` (or `NEBULA_PEER_REPLICAS`, a string) as 0 or 1; anything else is
    refused.

    Example:
        >>> _peer_replicas("1", "NEBULA_PEER_REPLICAS"), _peer_replicas(0, "peer_replicas")
        (1, 0)
    """
    if isinstance(value, str) and value.strip() in ("0", "1"):
        return int(value)
    if isinstance(value, int) and not isinstance(value, bool) and value in PEER_REPLICA_COUNTS:
        return value
    raise InvalidArgumentError(
        f"{source} must be 0 (no replicas) or 1 (each node's memory tier replicated to the "
        f"next node of the job), not {value!r}"
    )


def private_default() -> bool:
    """Whether `NEBULA_PRIVATE` asks for a private persistent root (what init() does
    without `private=`, and what the CLI writes to a local root).

    Example:
        >>> import os
        >>> os.environ.pop("NEBULA_PRIVATE", None) and None
        >>> private_default()
        False
    """
    return env_flag(ENV_PRIVATE, False)


def env_count(name: str) -> int | None:
    """The environment variable `name` as a count (an int, not negative); None when it is
    unset or empty. Raises `InvalidArgumentError` for anything else.

    Example:
        >>> import os
        >>> os.environ["NEBULA_EXAMPLE_COUNT"] = "3"
        >>> env_count("NEBULA_EXAMPLE_COUNT"), env_count("NEBULA_NOT_SET")
        (3, None)
        >>> del os.environ["NEBULA_EXAMPLE_COUNT"]
    """
    value = os.environ.get(name)
    if value is None or value == "":
        return None
    try:
        number = int(value)
    except ValueError:
        raise InvalidArgumentError(f"{name} must be an integer, not {value!r}") from None
    if number < 0:
        raise InvalidArgumentError(f"{name} must not be negative, not {value!r}")
    return number


def rank_env_set() -> tuple[bool, bool]:
    """Whether `RANK` and `WORLD_SIZE` are set (a launcher that sets only some of them, as
    Lightning's does for the processes it starts, says nothing certain about the rank)."""
    return bool(os.environ.get(ENV_RANK)), bool(os.environ.get(ENV_WORLD_SIZE))


def elastic_generation() -> str | None:
    """torchrun's `TORCHELASTIC_RUN_ID` and `TORCHELASTIC_RESTART_COUNT` as one id of this
    run and restart of the job, e.g. "5f0c2d.1"; None outside torchrun.

    Example:
        >>> import os
        >>> os.environ.update(TORCHELASTIC_RUN_ID="job7", TORCHELASTIC_RESTART_COUNT="2")
        >>> elastic_generation()
        'job7.2'
        >>> del os.environ["TORCHELASTIC_RUN_ID"], os.environ["TORCHELASTIC_RESTART_COUNT"]
    """
    run_id = os.environ.get(ENV_ELASTIC_RUN_ID)
    if not run_id:
        return None
    restarts = env_count(ENV_ELASTIC_RESTART_COUNT) or 0
    return f"{run_id}.{restarts}"


def job_env() -> dict[str, str]:
    """What the environment says of this process's job (runtime/job.py): the non-empty
    ones of `NEBULA_JOB_ID`, `TORCHELASTIC_RUN_ID`, `MASTER_ADDR` and `MASTER_PORT`.

    Example:
        >>> import os
        >>> os.environ["NEBULA_JOB_ID"] = "run7"
        >>> job_env()["NEBULA_JOB_ID"]
        'run7'
        >>> del os.environ["NEBULA_JOB_ID"]
    """
    names = (ENV_JOB_ID, ENV_ELASTIC_RUN_ID, ENV_MASTER_ADDR, ENV_MASTER_PORT)
    return {name: value.strip() for name in names if (value := os.environ.get(name, "").strip())}


def memory_buffer_bytes() -> int | None:
    """`NEBULA_MEMORY_BUFFER_SIZE`: the node's memory budget in bytes; None when unset."""
    return env_count(ENV_MEMORY_BUFFER)


def memory_tier_base() -> str | None:
    """`NEBULA_MEMORY_TIER_PATH`: the base folder of the memory tiers; None when unset."""
    return os.environ.get(ENV_MEMORY_TIER_PATH) or None


def storage_retry_env() -> dict[str, str]:
    """The `NEBULA_STORAGE_RETRY*` and `NEBULA_STORAGE_CALL_TIMEOUT_S` variables that are
    set, by name (storage/retry.py's `RetryPolicy.from_options` parses them, after the
    storage options)."""
    names = (
        ENV_STORAGE_RETRIES,
        ENV_STORAGE_RETRY_BASE_S,
        ENV_STORAGE_RETRY_MAX_S,
        ENV_STORAGE_CALL_TIMEOUT_S,
    )
    return {name: os.environ[name] for name in names if name in os.environ}


def single_writer_env() -> bool:
    """`NEBULA_SINGLE_WRITER` (a boolean, parsed as `env_flag`; off when unset): a
    persistent root whose store cannot publish create-only atomically is used anyway, its
    user promising one writer at a time (storage/atomic_probe.py).

    Example:
        >>> single_writer_env() in (True, False)
        True
    """
    return env_flag(ENV_SINGLE_WRITER, False)
