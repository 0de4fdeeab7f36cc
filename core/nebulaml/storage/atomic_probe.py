"""Whether a persistent root's store publishes create-only atomically: probed once per
root and process, at init, before the root is trusted with a commit.

The commit protocol's one promise from a store is that of two create-only publishes of
one name (two writers committing one tag's manifest, two jobs taking one hold), exactly one
succeeds. A backend declares it (`Capabilities.atomic_create`); a declaration is checked
once on each persistent root by `probe`: two create-only publishes of one probe name
(different bytes: a retry finding its own bytes counts as a success), the second of which
must fail; the probe's file is removed after. A root whose backend does not declare it,
or whose probe shows otherwise (an fsspec store whose `xb` is not exclusive), is refused
with one line (`InvalidArgumentError`), unless its user opts into single-writer mode: the
storage option `nebula_single_writer=True` or `NEBULA_SINGLE_WRITER=1`, a promise that
one writer at a time uses the root (then nothing is probed).

Not for: when a root is probed (runtime/connect.py, as init reaches its root), or how a
backend publishes (its own module). May import: `nebulaml.errors`, `nebulaml.config`.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable, Mapping
from typing import Any

from nebulaml.config import ENV_SINGLE_WRITER, single_writer_env
from nebulaml.errors import CommitConflictError, InvalidArgumentError

log = logging.getLogger("nebulaml")

OPTION_SINGLE_WRITER = "nebula_single_writer"
PROBE_PREFIX = ".nebula-probe-"

_lock = threading.Lock()
_verdicts: dict[str, bool] = {}  # a root's location: whether its create is atomic
_said: set[str] = set()  # the roots used in single-writer mode, said once


def single_writer_mode(options: Mapping[str, Any]) -> bool:
    """The storage option `nebula_single_writer` (True or False; anything else refused),
    else `NEBULA_SINGLE_WRITER`, else off.

    Example:
        >>> single_writer_mode({"nebula_single_writer": True}), single_writer_mode({})
        (True, False)
    """
    value = options.get(OPTION_SINGLE_WRITER)
    if value is None:
        return single_writer_env()
    if not isinstance(value, bool):
        raise InvalidArgumentError(f"{OPTION_SINGLE_WRITER} must be True or False, not {value!r}")
    return value


def probe(publish: Callable[[str, bytes], None], remove: Callable[[str], None]) -> bool:
    """Whether a second create-only publish of one name fails: `publish(name, data)` is a
    create-only publish at the root (raising `CommitConflictError` when the name is
    taken), `remove(name)` removes the probe's file after.

    Example:
        >>> names: dict[str, bytes] = {}
        >>> def create(name, data):
        ...     if name in names: raise CommitConflictError("root", name)
        ...     names[name] = data
        >>> probe(create, names.pop), names
        (True, {})
        >>> probe(names.__setitem__, names.pop)  # a store that overwrites
        False
    """
    name = f"{PROBE_PREFIX}{uuid.uuid4().hex}.json"
    publish(name, b'{"probe": 1}\n')
    try:
        publish(name, b'{"probe": 2}\n')
    except CommitConflictError:
        return True
    finally:
        remove(name)
    return False


def require_store(store: Any) -> None:
    """`require_atomic_create` for a `Store` (store.py's `require_atomic_create`): declared
    by its backend (`capabilities.atomic_create`) and probed once per root in this process
    with its own create-only publishes, or its storage option / environment's
    `single_writer`."""

    def publish(name: str, data: bytes) -> None:
        store.publish((name,), data, create_only=True)

    require_atomic_create(
        store.location,
        store.url,
        declared=store.capabilities.atomic_create,
        single_writer=store.single_writer,
        run_probe=lambda: probe(publish, store.remove),
    )


def require_atomic_create(
    location: str,
    url: str,
    *,
    declared: bool,
    single_writer: bool,
    run_probe: Callable[[], bool],
) -> None:
    """Refuse the root `url` (`InvalidArgumentError`, one line) unless its create-only
    publish is atomic: `declared` by its backend and shown by `run_probe()`, run once per
    `location` in this process; or unless `single_writer` (said once, nothing probed)."""
    if single_writer:
        with _lock:
            first = location not in _said
            _said.add(location)
        if first:
            log.info("%s is used in single-writer mode: its create-only publish is not "
                     "relied on, one writer at a time must use it", url)  # fmt: skip
        return
    with _lock:
        verdict = _verdicts.get(location)
    if verdict is None:
        verdict = declared and run_probe()
        with _lock:
            _verdicts[location] = verdict
    if not verdict:
        why = "showed otherwise when probed" if declared else "does not declare one"
        raise InvalidArgumentError(
            f"{url}: this store cannot publish a file create-only atomically (its backend "
            f"{why}), so two writers could both commit one checkpoint; use another store, "
            f"or promise one writer at a time with the storage option "
            f"{OPTION_SINGLE_WRITER}=True or {ENV_SINGLE_WRITER}=1"
        )
