"""A third-party storage backend for nebula, written as a plugin would be: it imports only
the public `nebulaml.backends`, and its distribution declares it in the entry-point group
`nebulaml.backends` (`demo = demo_backend:open_demo`). tests/plugins/test_plugin_backend.py
installs it beside a child process (a `.dist-info` on its path) and runs nebula's backend
contract and a checkpoint through it, with no edit to nebula.

The store is an object store kept in this process's memory (one per root URL's bucket):
objects written whole, a create-only put under a lock (atomic), each append an object of
its own (`.<file>.d/<append id>.part`), no folders of its own (a folder exists while it
holds an object).
"""

from __future__ import annotations

import io
import threading
from datetime import datetime, timezone
from typing import Any

from nebulaml.backends import Capabilities, OpenRequest, Parts

_objects: dict[str, tuple[bytes, datetime]] = {}
_lock = threading.Lock()


class _Writer:
    """An object written whole when closed; abandoned, nothing."""

    def __init__(self, put: Any) -> None:
        self._buffer, self._put = io.BytesIO(), put

    def write(self, data: Any) -> int:
        return self._buffer.write(data)

    def close(self) -> None:
        self._put(self._buffer.getvalue())

    def abort(self) -> None:
        self._buffer = io.BytesIO()


class DemoBackend:
    writer_retries = False
    aborted_write_may_leave_file = False
    capabilities = Capabilities(atomic_create=True, object_appends=True)

    def __init__(self, root: str) -> None:
        self.root = root
        self.url = f"demo://{root}"
        self.location = self.url

    def path(self, parts: Parts) -> str:
        return "/".join([self.root, *parts])

    def _put(self, key: str, data: bytes, *, create_only: bool = False) -> None:
        with _lock:
            if create_only and key in _objects:
                raise FileExistsError(key)
            _objects[key] = (bytes(data), datetime.now(timezone.utc))

    def _children(self, parts: Parts) -> list[str]:
        prefix = self.path(parts) + "/"
        with _lock:
            return [k[len(prefix) :] for k in _objects if k.startswith(prefix)]

    def exists(self, parts: Parts) -> bool:
        with _lock:
            if self.path(parts) in _objects:
                return True
        return bool(self._children(parts))

    def list_folders(self, parts: Parts) -> list[str]:
        names = {rel.split("/", 1)[0] for rel in self._children(parts) if "/" in rel}
        return sorted(n for n in names if not n.startswith("."))

    def list_files(self, parts: Parts) -> dict[str, int]:
        prefix = self.path(parts) + "/"
        with _lock:
            return {k[len(prefix) :]: len(v[0]) for k, v in _objects.items()
                    if k.startswith(prefix) and "/" not in k[len(prefix) :]}  # fmt: skip

    def modified_at(self, parts: Parts) -> datetime | None:
        with _lock:
            found = _objects.get(self.path(parts))
        return None if found is None else found[1]

    def read_bytes(self, parts: Parts) -> bytes:
        with _lock:
            found = _objects.get(self.path(parts))
        if found is None:
            raise FileNotFoundError(self.path(parts))
        return found[0]

    def open_read(self, parts: Parts) -> Any:
        return io.BytesIO(self.read_bytes(parts))

    def make_dir(self, parts: Parts) -> None:
        return None  # folders exist while they hold an object

    def open_write(self, parts: Parts) -> _Writer:
        key = self.path(parts)
        return _Writer(lambda data: self._put(key, data))

    def publish(self, parts: Parts, data: bytes, *, create_only: bool) -> None:
        self._put(self.path(parts), data, create_only=create_only)

    def _appends(self, parts: Parts) -> Parts:
        return (*parts[:-1], f".{parts[-1]}.d")

    def append(self, parts: Parts, data: bytes, *, append_id: str) -> None:
        try:
            self.publish((*self._appends(parts), f"{append_id}.part"), data, create_only=True)
        except FileExistsError:
            return  # a retry of an append that landed

    def read_appended(self, parts: Parts) -> bytes | None:
        try:
            head: bytes | None = self.read_bytes(parts)
        except FileNotFoundError:
            head = None
        folder = self._appends(parts)
        names = sorted(self.list_files(folder))
        if head is None and not names:
            return None
        pieces = ([head] if head else []) + [self.read_bytes((*folder, n)) for n in names]
        return b"".join(p if p.endswith(b"\n") else p + b"\n" for p in pieces if p)

    def rotate_appended(self, parts: Parts, max_bytes: int, head: bytes) -> bool:
        folder = self._appends(parts)
        sizes = self.list_files(folder)
        kept, old = 0, []
        for name in sorted(sizes, reverse=True):
            kept += sizes[name]
            if kept > 2 * max_bytes:
                old.append(name)
        for name in old:
            self.remove((*folder, name))
        return bool(old)

    def remove(self, parts: Parts) -> None:
        with _lock:
            _objects.pop(self.path(parts), None)

    def remove_dir(self, parts: Parts) -> None:
        return None  # nothing left once its objects are gone


def open_demo(request: OpenRequest) -> DemoBackend:
    """The entry point's factory: `demo://bucket/path` is a root in this process's store.

    Example:
        >>> open_demo(OpenRequest("demo://b/run1", "demo", {})).url
        'demo://b/run1'
    """
    root = request.url.split("://", 1)[1].strip("/")
    if not root:
        raise ValueError(f"{request.url}: a demo root names a bucket (demo://bucket/path)")
    return DemoBackend(root)
