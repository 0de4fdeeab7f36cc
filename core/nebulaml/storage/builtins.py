"""The backends nebula ships, by protocol: what registry.py registers before anything else.

    plain path, file://, local://    local.py's `open_local`
    az://, abfs://, abfss://         azure.py's `open_azure` (the azure extra)
    s3://, s3a://                    s3.py's `open_s3` (the s3 extra)
    gs://, gcs://                    gcs.py's `open_gcs` (the gcs extra)

A protocol none of these (nor a plugin) names is opened by remote.py's `open_fsspec`
(`FALLBACK`): any store fsspec knows (memory://, hf://, ...).

Not for: looking a backend up or registering one (registry.py). May import: storage/'s
backend.py, local.py, remote.py, s3.py, gcs.py, azure.py.
"""

from __future__ import annotations

from collections.abc import Callable

from nebulaml.storage.azure import open_azure
from nebulaml.storage.backend import Backend, OpenRequest
from nebulaml.storage.gcs import open_gcs
from nebulaml.storage.local import open_local
from nebulaml.storage.remote import open_fsspec
from nebulaml.storage.s3 import open_s3

# The key None is a plain path (no protocol).
BUILTIN: dict[str | None, Callable[[OpenRequest], Backend]] = {
    None: open_local,
    "file": open_local,
    "local": open_local,
    "az": open_azure,
    "abfs": open_azure,
    "abfss": open_azure,
    "s3": open_s3,
    "s3a": open_s3,
    "gs": open_gcs,
    "gcs": open_gcs,
}


def FALLBACK(request: OpenRequest) -> Backend:
    """A root whose protocol no backend is registered for: fsspec's store for it."""
    return open_fsspec(request)
