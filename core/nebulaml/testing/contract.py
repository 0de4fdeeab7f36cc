"""The contract every storage backend passes: the checks, one function each, and
`BackendContract`, the pytest class that runs them against a backend's roots.

Each check takes a `Store` on a new, empty root and asserts what the commit protocol relies
on: a create-only publish that a second one cannot replace (declared `atomic_create`),
files read back as written (streamed and whole), listings (folders, files and sizes, a
missing folder empty; a folder's files by the start of their names), deletes (a missing
file no error), appends that two concurrent writers lose none of (declared
`object_appends`, or a local path; otherwise one writer's), and ranges written from an
earlier file (declared `range_copy` or `clones`). A check skips nothing silently: what a
backend does not declare is checked for what it gives instead.

Not for: nebula's own backend tests beyond the contract (tests/core/test_store_contract.py).
May import: `nebulaml.errors` and `nebulaml.storage`; no test framework (pytest finds
`BackendContract`'s subclasses by name, and calls `setup_method`/`teardown_method`).
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Mapping
from typing import Any

from nebulaml.errors import CommitConflictError
from nebulaml.storage.failures import MissingFileError
from nebulaml.storage.store import Store

_BIG = (1 << 20) + 12_345  # a streamed file of more than one piece, not a round size


def _pattern(size: int, seed: int) -> bytes:
    """`size` bytes that differ from one offset to the next (a shifted write shows)."""
    return bytes((i * 31 + seed) % 251 for i in range(size))


def check_capabilities(store: Store) -> None:
    """The backend declares its capabilities, and has the primitives."""
    caps = store.capabilities
    for name in ("atomic_create", "object_appends", "range_copy", "clones", "local_path"):
        assert isinstance(getattr(caps, name), bool), f"capability {name} is not a bool"
    assert isinstance(store.url, str) and store.url, "a backend has a URL"
    assert isinstance(store.location, str) and store.location, "a backend has a location"


def check_create_only_publish(store: Store) -> None:
    """Of two create-only publishes of one name the second fails, and the first's bytes
    stay (declared `atomic_create`); a publish that is not create-only replaces."""
    store.make_dir("tag1")
    store.publish(("tag1", "manifest.json"), b'{"first": 1}')
    assert store.read_bytes("tag1", "manifest.json") == b'{"first": 1}'
    if store.capabilities.atomic_create:
        try:
            store.publish(("tag1", "manifest.json"), b'{"second": 2}')
        except CommitConflictError:
            pass
        else:
            raise AssertionError("a second create-only publish of one name succeeded")
        assert store.read_bytes("tag1", "manifest.json") == b'{"first": 1}'
    store.publish(("tag1", "manifest.json"), b'{"third": 3}', create_only=False)
    assert store.read_bytes("tag1", "manifest.json") == b'{"third": 3}'


def check_racing_publishers(store: Store, writers: int = 4) -> None:
    """Of `writers` threads publishing one name create-only at once, exactly one wins
    (declared `atomic_create`; nothing to check otherwise)."""
    if not store.capabilities.atomic_create:
        return
    store.make_dir("race")
    barrier = threading.Barrier(writers)
    won: list[int] = []
    errors: list[BaseException] = []

    def publish(who: int) -> None:
        barrier.wait()
        try:
            store.publish(("race", "manifest.json"), f"writer {who}".encode())
            won.append(who)
        except CommitConflictError:
            pass
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=publish, args=(w,)) for w in range(writers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, f"a racing publish failed otherwise: {errors[0]!r}"
    assert len(won) == 1, f"{len(won)} of {writers} racing create-only publishes won"
    assert store.read_bytes("race", "manifest.json") == f"writer {won[0]}".encode()


def check_read_back(store: Store) -> None:
    """Files read back as written: small ones whole, a large one streamed in odd pieces;
    a missing file is `MissingFileError`."""
    store.make_dir("t")
    store.write_bytes(("t", "small"), b"12345")
    data = _pattern(_BIG, 7)
    with store.open_write("t", "big") as f:
        for start in range(0, len(data), 100_003):
            f.write(data[start : start + 100_003])
    assert store.read_bytes("t", "small") == b"12345"
    assert store.read_bytes("t", "big") == data
    with store.open_read("t", "big") as f:
        f.seek(1 << 20)
        assert f.read(100) == data[1 << 20 : (1 << 20) + 100]
    try:
        store.read_bytes("t", "missing")
    except MissingFileError:
        pass
    else:
        raise AssertionError("reading a missing file raised nothing")


def check_listing(store: Store) -> None:
    """Folders (hidden ones left out) and files with their sizes (hidden ones in); a
    missing folder lists empty; the whole root's listing (`list_tree`, where the backend
    has one) agrees."""
    for tag, files in (("tag1", {"a": 5, "b": 0, ".hidden": 1}), ("tag2", {"c": 3})):
        store.make_dir(tag)
        for name, size in files.items():
            store.write_bytes((tag, name), b"x" * size)
    store.make_dir(".private")
    store.write_bytes((".private", "d"), b"1")
    assert sorted(store.list_dirs()) == ["tag1", "tag2"]
    assert store.list_files("tag1") == {"a": 5, "b": 0, ".hidden": 1}
    assert store.list_files("missing") == {}
    assert store.exists("tag1", "a") and not store.exists("tag1", "zzz")
    tree = store.list_tree()
    if tree is not None:
        assert {k: {n: s for n, (s, _v) in v.items()} for k, v in tree.items()
                if not k.startswith(".")} == {"tag1": {"a": 5, "b": 0, ".hidden": 1},
                                               "tag2": {"c": 3}}  # fmt: skip


def check_prefixed_listing(store: Store) -> None:
    """The files of a folder whose names begin with a prefix (`Store.list_prefixed`, the
    backend's own listing or else the whole folder's, filtered), with their sizes: hidden
    ones in, the folder's other files and any folder of such a name out, at the root and
    in a folder; a prefix that matches nothing, or a missing folder, lists empty."""
    for folder in ("tag1", ".job-dir", ".job-folder"):
        store.make_dir(folder)
    for parts, size in (((".job-1.json",), 3), ((".job-22.json",), 0), ((".jobs",), 1),
                        ((".other",), 2), (("job-1",), 4), (("tag1", ".job-x"), 5),
                        (("tag1", "b"), 6), ((".job-dir", "f"), 7),
                        ((".job-folder", ".job-2.json"), 1)):  # fmt: skip
        store.write_bytes(parts, b"x" * size)
    assert store.list_prefixed(prefix=".job-") == {".job-1.json": 3, ".job-22.json": 0}
    assert store.list_prefixed(prefix=".job-1") == {".job-1.json": 3}
    assert store.list_prefixed(prefix=".jobs") == {".jobs": 1}
    assert store.list_prefixed(prefix=".nothing-") == {}
    assert store.list_prefixed("tag1", prefix=".job-") == {".job-x": 5}
    assert store.list_prefixed("tag1", prefix="") == store.list_files("tag1")
    assert store.list_prefixed("missing", prefix=".job-") == {}


def check_delete(store: Store) -> None:
    """A file removed is gone, a missing one is no error, and a folder emptied and
    removed is no longer listed."""
    store.make_dir("t")
    store.write_bytes(("t", "a"), b"1")
    store.write_bytes(("t", "b"), b"2")
    store.remove("t", "a")
    store.remove("t", "a")
    assert store.list_files("t") == {"b": 1} and not store.exists("t", "a")
    store.remove_dir("t")
    store.remove_dir("t")
    assert store.list_dirs() == [] and store.list_files("t") == {}


def check_appends(store: Store, per_writer: int = 20) -> None:
    """Appends read back in order; two writers appending at once lose none of each
    other's (declared `object_appends`, or a local path's atomic append); a backend that
    declares neither is checked with one writer."""
    concurrent = store.capabilities.object_appends or store.capabilities.local_path
    writers = [Store(store.url, _options(store)) for _ in range(2 if concurrent else 1)]
    barrier = threading.Barrier(len(writers))

    def append(s: Store, who: int) -> None:
        barrier.wait()
        for i in range(per_writer):
            s.append_text(("log.csv",), f"{who},{i}\n")

    threads = [threading.Thread(target=append, args=(s, w)) for w, s in enumerate(writers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    lines = (store.read_appended("log.csv") or b"").decode().splitlines()
    expected = [f"{w},{i}" for w in range(len(writers)) for i in range(per_writer)]
    assert sorted(lines) == sorted(expected), f"{len(lines)} of {len(expected)} appends read"
    for w in range(len(writers)):
        mine = [line for line in lines if line.startswith(f"{w},")]
        assert mine == [f"{w},{i}" for i in range(per_writer)], "appends out of order"


def check_ranges(store: Store) -> None:
    """A file written by ranges from an earlier one reads back whole, and its bytes
    written and taken from the earlier file add up (where the backend declares
    `range_copy` or `clones`: `Store.clones`); elsewhere it is written whole."""
    store.make_dir("t1")
    store.make_dir("t2")
    size = 3 * (1 << 20)
    old = bytearray(_pattern(size, 1))
    first = store.write_ranges(("t1", "item"), memoryview(old), [(0, size, False)], None)
    new = bytearray(old)
    new[(1 << 20) : (1 << 20) + 4096] = _pattern(4096, 9)  # one changed run
    ranges = [(0, 1 << 20, True), (1 << 20, 1 << 20, False), (2 << 20, 1 << 20, True)]
    written = store.write_ranges(("t2", "item"), memoryview(new), ranges, ("t1", "item"),
                                 base_stamp=first.stamp)  # fmt: skip
    assert store.read_bytes("t2", "item") == bytes(new)
    assert store.read_bytes("t1", "item") == bytes(old), "the earlier file changed"
    assert written.written + written.reused == size
    if not store.clones:
        assert written.reused == 0


CHECKS: tuple[Callable[[Store], None], ...] = (
    check_capabilities,
    check_create_only_publish,
    check_racing_publishers,
    check_read_back,
    check_listing,
    check_prefixed_listing,
    check_delete,
    check_appends,
    check_ranges,
)


def _options(store: Store) -> dict[str, Any]:
    return dict(getattr(store, "_contract_options", {}))


def open_store(url: str, storage_options: Mapping[str, Any] | None = None) -> Store:
    """A `Store` on `url` for the checks (which open more handles on it with the same
    options), its root made.

    Example:
        >>> import tempfile
        >>> open_store(tempfile.mkdtemp()).capabilities.local_path
        True
    """
    store = Store(url, dict(storage_options or {}))
    store.make_dir()  # as a session does first
    store._contract_options = dict(storage_options or {})  # type: ignore[attr-defined]
    return store


def run_contract(new_root: Callable[[], str], storage_options: Mapping[str, Any] | None = None
                 ) -> list[str]:  # fmt: skip
    """Run every check, each on a new empty root `new_root()` gives (a URL), and return
    the names of those that passed; the first that fails raises its `AssertionError`.

    Example:
        >>> import tempfile
        >>> len(run_contract(tempfile.mkdtemp)) == len(CHECKS)
        True
    """
    passed = []
    for check in CHECKS:
        check(open_store(new_root(), storage_options))
        passed.append(check.__name__)
    return passed


class BackendContract:
    """The contract as a pytest class: subclass it as `Test...` and give `new_root()` (a
    new, empty root's URL for each test) and, if the store needs them,
    `storage_options`; `remove_root(url)` is called after each test to clean up.

    Example (in a test module; the server is the subclass's to start):
        class TestMyStore(BackendContract):
            storage_options = {"endpoint_url": "http://127.0.0.1:9000"}

            def new_root(self) -> str:
                return f"mystore://bucket/{uuid.uuid4().hex}"
    """

    storage_options: Mapping[str, Any] = {}

    def new_root(self) -> str:
        """A URL of a new, empty root of the backend under test."""
        raise NotImplementedError("a BackendContract subclass gives new_root()")

    def remove_root(self, url: str) -> None:
        """Remove what a test left at `url` (nothing by default)."""

    def setup_method(self, method: Any = None) -> None:
        self._roots: list[str] = []

    def teardown_method(self, method: Any = None) -> None:
        for url in getattr(self, "_roots", []):
            self.remove_root(url)

    def open(self) -> Store:
        """A store on a new root (removed after the test)."""
        url = self.new_root()
        self._roots.append(url)
        return open_store(url, self.storage_options)

    def test_capabilities(self) -> None:
        check_capabilities(self.open())

    def test_create_only_publish(self) -> None:
        check_create_only_publish(self.open())

    def test_racing_publishers(self) -> None:
        check_racing_publishers(self.open())

    def test_read_back(self) -> None:
        check_read_back(self.open())

    def test_listing(self) -> None:
        check_listing(self.open())

    def test_prefixed_listing(self) -> None:
        check_prefixed_listing(self.open())

    def test_delete(self) -> None:
        check_delete(self.open())

    def test_appends(self) -> None:
        check_appends(self.open())

    def test_ranges(self) -> None:
        check_ranges(self.open())


# a unique name per process, for roots a caller builds from a base
def unique_name(prefix: str = "contract") -> str:
    """`prefix-<random>`: a root's name no other test picks.

    Example:
        >>> unique_name("x").startswith("x-")
        True
    """
    return f"{prefix}-{uuid.uuid4().hex[:12]}"
