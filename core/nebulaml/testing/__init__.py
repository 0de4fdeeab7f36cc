"""The storage backend contract, shipped for any backend to run (public).

nebula relies on a handful of things from a store: a create-only publish that a second
cannot replace, files read back as written, listings, deletes, appends that concurrent
writers do not lose, and ranges written from an earlier file where a backend says it can.
`nebulaml.testing` holds the checks of each (`check_*`, one `Store` on an empty root each),
`run_contract` to run them all, and `BackendContract`, the same as a pytest class to
subclass. nebula's suite runs it against the local disk, Azure (Azurite), S3 (moto's
server) and a plugin registered through the `nebulaml.backends` entry point.

    from nebulaml.testing import BackendContract

    class TestMyStore(BackendContract):
        storage_options = {"endpoint_url": "http://127.0.0.1:9000"}

        def new_root(self) -> str:
            return f"mystore://bucket/{uuid.uuid4().hex}"

Holds: contract (the checks and the class). Layer: public, beside the package's namespace
(docs/architecture.md); nothing in the library imports it. May import: `nebulaml.errors`
and `nebulaml.storage`.

Example:
    >>> import tempfile
    >>> from nebulaml.testing import run_contract
    >>> "check_create_only_publish" in run_contract(tempfile.mkdtemp)
    True
"""

from nebulaml.testing.contract import (
    CHECKS,
    BackendContract,
    check_appends,
    check_capabilities,
    check_create_only_publish,
    check_delete,
    check_listing,
    check_prefixed_listing,
    check_racing_publishers,
    check_ranges,
    check_read_back,
    open_store,
    run_contract,
    unique_name,
)

__all__ = [
    "CHECKS",
    "BackendContract",
    "check_appends",
    "check_capabilities",
    "check_create_only_publish",
    "check_delete",
    "check_listing",
    "check_prefixed_listing",
    "check_racing_publishers",
    "check_ranges",
    "check_read_back",
    "open_store",
    "run_contract",
    "unique_name",
]
