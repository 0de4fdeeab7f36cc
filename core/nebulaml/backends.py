"""Storage backends for other stores: what a plugin needs to give nebula a new protocol.

A backend is a factory registered for a protocol: `register_backend("mystore", factory)` in
code, or an installed distribution's entry point in the group `nebulaml.backends` (its name
the protocol, its object the factory), read once, the first time a root of a protocol not
registered yet is opened. The factory takes an `OpenRequest` (the URL, the storage options,
the retry policy, ...) and returns a backend: an object with the primitives of `Backend`
that declares its `Capabilities`. nebula reads what a store can do from those, never from
its protocol's name; a persistent root's atomic create is probed once at `init` besides.
A store fsspec knows needs no code: `FsspecBackend` is nebula's backend over any fsspec
filesystem (a subclass overrides what the store does better, as S3's and Azure's do).
`nebulaml.testing` holds the contract a backend must pass.

Layer: public, beside the package's namespace (docs/architecture.md); nothing in the
library imports it. May import: `nebulaml.storage`.

Example:
    >>> import nebulaml.backends as nb
    >>> def open_mystore(request: nb.OpenRequest) -> nb.FsspecBackend:
    ...     path = request.url.split("://", 1)[1]  # this example keeps it in fsspec's memory://
    ...     return nb.open_fsspec(nb.OpenRequest(f"memory://{path}", "memory", request.options))
    >>> nb.register_backend("mystore-example", open_mystore)
    >>> import nebulaml as nm
    >>> nm.list_checkpoints("mystore-example://bucket/run1")
    []
"""

from __future__ import annotations

from nebulaml.storage.backend import Backend, Capabilities, OpenRequest, Parts, Written
from nebulaml.storage.registry import (
    ENTRY_POINT_GROUP,
    BackendFactory,
    register_backend,
    registered_protocols,
)
from nebulaml.storage.remote import RemoteBackend as FsspecBackend
from nebulaml.storage.remote import open_fsspec

__all__ = [
    "ENTRY_POINT_GROUP",
    "Backend",
    "BackendFactory",
    "Capabilities",
    "FsspecBackend",
    "OpenRequest",
    "Parts",
    "Written",
    "open_fsspec",
    "register_backend",
    "registered_protocols",
]
