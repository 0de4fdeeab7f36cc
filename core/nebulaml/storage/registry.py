"""Which backend opens a root: one factory per protocol, registered in code or by an
installed distribution's entry point.

    register_backend(protocol, factory)   a backend for `protocol://...` roots
    factory_for(protocol)                  the factory that opens such a root
    registered_protocols()                 the protocols with a registered backend

The built-in backends (builtins.py: local disks, Azure, S3, GCS) are registered first, through
the same `register_backend`. The entry-point group `nebulaml.backends` is read once, lazily
(the first time a root's protocol is not registered yet): each entry point's name is a
protocol and its object a factory, as `register_backend` takes them. An entry point never
replaces a protocol registered already (built-in or in code); `register_backend(...,
replace=True)` does. A protocol nothing registers is opened by fsspec's store of that name
(builtins.FALLBACK), which declares only what any fsspec store gives.

A factory is called with an `OpenRequest` (backend.py) and returns a `Backend` that
declares its `Capabilities`: `Store` reads what a root can do from them, never from the
protocol's name or the backend's class.

Not for: opening a root (store.py does it, through the factory found here), or any
backend's code. May import: `nebulaml.errors` and storage/'s backend.py, builtins.py.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from nebulaml.errors import InvalidArgumentError
from nebulaml.storage.backend import Backend, OpenRequest
from nebulaml.storage.builtins import BUILTIN, FALLBACK

log = logging.getLogger("nebulaml")

ENTRY_POINT_GROUP = "nebulaml.backends"

BackendFactory = Callable[[OpenRequest], Backend]

_lock = threading.Lock()
_factories: dict[str | None, BackendFactory] = dict(BUILTIN)
_entry_points_read = False


def register_backend(protocol: str, factory: BackendFactory, *, replace: bool = False) -> None:
    """Open roots `protocol://...` with `factory` (it takes an `OpenRequest` and returns a
    `Backend` declaring its `Capabilities`). A protocol registered already (nebula's own:
    file, local, az, abfs, abfss, s3, s3a, gs, gcs; or another registration) is refused unless
    `replace`.

    Example:
        >>> from nebulaml.storage.remote import open_fsspec
        >>> register_backend("example-mem", lambda request: open_fsspec(
        ...     OpenRequest(request.url.replace("example-mem://", "memory://"), "memory",
        ...                 request.options)))
        >>> "example-mem" in registered_protocols()
        True
    """
    if not isinstance(protocol, str) or not protocol or "://" in protocol:
        raise InvalidArgumentError(f"a backend's protocol is a name such as 's3', not {protocol!r}")
    if not callable(factory):
        raise InvalidArgumentError(f"the backend factory for {protocol!r} is not callable")
    with _lock:
        if protocol in _factories and not replace:
            raise InvalidArgumentError(
                f"a backend is registered for {protocol!r} already (replace=True replaces it)"
            )
        _factories[protocol] = factory


def registered_protocols() -> list[str]:
    """The protocols a backend is registered for (nebula's, the code's and the installed
    plugins'), sorted.

    Example:
        >>> {"file", "az", "s3"} <= set(registered_protocols())
        True
    """
    _read_entry_points()
    with _lock:
        return sorted(p for p in _factories if p is not None)


def factory_for(protocol: str | None) -> BackendFactory:
    """The factory that opens a root of `protocol` (None: a plain path): the registered
    one (the entry points read first, once, if it is not registered), else fsspec's.

    Example:
        >>> factory_for("memory").__name__
        'FALLBACK'
    """
    with _lock:
        found = _factories.get(protocol)
    if found is not None:
        return found
    _read_entry_points()
    with _lock:
        return _factories.get(protocol, FALLBACK)


def _read_entry_points() -> None:
    """Register the `nebulaml.backends` entry points of the installed distributions, once
    per process. One that cannot be loaded is said (once) and skipped: a broken plugin
    does not keep the other stores from opening."""
    global _entry_points_read
    with _lock:
        if _entry_points_read:
            return
        _entry_points_read = True
    from importlib import metadata  # read once, and only for a protocol nothing registered

    for point in metadata.entry_points(group=ENTRY_POINT_GROUP):
        try:
            factory = point.load()
        except Exception as exc:  # noqa: BLE001 (a plugin's import error is the plugin's)
            log.warning("the storage backend %r (%s) could not be loaded: %s",
                        point.name, point.value, exc)  # fmt: skip
            continue
        with _lock:
            if point.name in _factories:
                log.warning("the storage backend %r (%s) is ignored: %r has a backend already",
                            point.name, point.value, point.name)  # fmt: skip
                continue
            _factories[point.name] = factory
