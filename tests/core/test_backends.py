"""The open backend seam (storage/registry.py) and the atomic-create probe at init
(storage/atomic_probe.py): a store is opened by the factory registered for its protocol,
what it can do comes from the capabilities its backend declares (never its protocol's
name), and a persistent root whose create-only publish is not atomic is refused at init
unless single-writer mode is asked for."""

from __future__ import annotations

import ast
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import fsspec
import pytest
import torch
from fsspec.implementations.memory import MemoryFileSystem

import nebulaml as nm
from nebulaml.errors import InvalidArgumentError
from nebulaml.storage import atomic_probe
from nebulaml.storage.backend import Capabilities, OpenRequest, Parts
from nebulaml.storage.registry import factory_for, register_backend, registered_protocols
from nebulaml.storage.remote import RemoteBackend, open_fsspec
from nebulaml.storage.store import Store


def _memory_url(request: OpenRequest) -> str:
    return "memory://" + request.url.split("://", 1)[1]


class Overwriting(RemoteBackend):
    """A store whose create-only publish overwrites (s3fs's `xb` on small files, once)."""

    def publish(self, parts: Parts, data: bytes, *, create_only: bool) -> None:
        super().publish(parts, data, create_only=False)


def _register(factory_caps: Capabilities | None, cls: type[RemoteBackend] = RemoteBackend) -> str:
    """A new protocol over fsspec's memory store, its backend `cls` declaring
    `factory_caps`; returns the protocol."""
    protocol = f"nebtest{uuid.uuid4().hex[:8]}"

    def factory(request: OpenRequest) -> RemoteBackend:
        fs, root = fsspec.core.url_to_fs(_memory_url(request))
        return cls(fs, root.rstrip("/"), capabilities=factory_caps or Capabilities(),
                   url=request.url.rstrip("/"))  # fmt: skip

    register_backend(protocol, factory)
    return protocol


@pytest.fixture
def memory_root() -> Iterator[str]:
    path = f"/backends-{uuid.uuid4().hex[:12]}"
    yield path
    fs = fsspec.filesystem("memory")
    if fs.exists(path):
        fs.rm(path, recursive=True)


def test_the_builtin_backends_register_through_the_seam() -> None:
    assert {"file", "local", "az", "abfs", "abfss", "s3", "s3a"} <= set(registered_protocols())
    local = Store("file:///tmp")
    assert local.capabilities.local_path and local.capabilities.clones
    assert factory_for("s3").__name__ == "open_s3" and factory_for("az").__name__ == "open_azure"


def test_a_protocol_is_registered_once_unless_replaced() -> None:
    protocol = _register(Capabilities(atomic_create=True))
    with pytest.raises(InvalidArgumentError, match="registered for"):
        register_backend(protocol, open_fsspec)
    register_backend(protocol, open_fsspec, replace=True)
    assert factory_for(protocol) is open_fsspec
    with pytest.raises(InvalidArgumentError):
        register_backend("s3://", open_fsspec)


def test_appends_follow_the_declared_capability_not_the_protocol_name(memory_root: str) -> None:
    # Catches: object appends chosen by protocol name (memory, s3, az...): fsspec's memory
    # store registered under an unknown name read, then rewrote the file, and two writers
    # lost each other's appends.
    name = f"nebmem{uuid.uuid4().hex[:8]}"

    class Renamed(MemoryFileSystem):
        protocol = name

    fsspec.register_implementation(name, Renamed, clobber=True)
    store = Store(f"{name}://{memory_root.lstrip('/')}")
    assert store.capabilities.object_appends and not store.capabilities.local_path
    writers = [Store(store.url) for _ in range(2)]
    barrier = threading.Barrier(2)

    def write(s: Store, who: int) -> None:
        barrier.wait()
        for i in range(25):
            s.append_text(("log.csv",), f"{who},{i}\n")

    threads = [threading.Thread(target=write, args=(s, w)) for w, s in enumerate(writers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    lines = (store.read_appended("log.csv") or b"").decode().splitlines()
    assert sorted(lines) == sorted(f"{w},{i}" for w in range(2) for i in range(25))


def test_a_root_without_an_atomic_create_is_refused_at_init(memory_root: str) -> None:
    protocol = _register(Capabilities(object_appends=True))  # declares no atomic create
    url = f"{protocol}://{memory_root.lstrip('/')}"
    with pytest.raises(InvalidArgumentError, match="does not declare one") as caught:
        nm.init(url, persistent_time_interval=0)
    assert "\n" not in str(caught.value) and "nebula_single_writer=True" in str(caught.value)


def test_a_create_that_overwrites_is_found_by_the_probe(memory_root: str) -> None:
    # Catches: a declaration trusted without the probe (a store whose `xb` overwrites
    # would let a second manifest replace the first, unnoticed).
    protocol = _register(Capabilities(atomic_create=True, object_appends=True), Overwriting)
    url = f"{protocol}://{memory_root.lstrip('/')}"
    with pytest.raises(InvalidArgumentError, match="showed otherwise when probed"):
        nm.init(url, persistent_time_interval=0)
    fs = fsspec.filesystem("memory")
    assert not [p for p in fs.find(memory_root) if atomic_probe.PROBE_PREFIX in p]


def test_single_writer_mode_takes_such_a_root(
    memory_root: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    protocol = _register(Capabilities(object_appends=True))
    url = f"{protocol}://{memory_root.lstrip('/')}"
    nm.init(url, persistent_time_interval=0, storage_options={"nebula_single_writer": True})
    ckpt = nm.Checkpoint("global_step1", 1)
    ckpt.save("w", {"w": torch.arange(4.0)})
    assert nm.flush_persistence()
    assert [c["tag"] for c in nm.list_checkpoints(url)] == ["global_step1"]
    monkeypatch.setenv("NEBULA_SINGLE_WRITER", "y")  # parsed strictly
    with pytest.raises(InvalidArgumentError, match="NEBULA_SINGLE_WRITER"):
        Store(url)
    with pytest.raises(InvalidArgumentError, match="nebula_single_writer"):
        Store(url, {"nebula_single_writer": "yes"})


def test_the_probe_runs_once_per_root_and_process(memory_root: str) -> None:
    probes: list[str] = []

    class Counting(RemoteBackend):
        def publish(self, parts: Parts, data: bytes, *, create_only: bool) -> None:
            if parts[-1].startswith(atomic_probe.PROBE_PREFIX):
                probes.append(parts[-1])
            super().publish(parts, data, create_only=create_only)

    protocol = _register(Capabilities(atomic_create=True, object_appends=True), Counting)
    url = f"{protocol}://{memory_root.lstrip('/')}"
    for _ in range(3):
        Store(url).require_atomic_create()
    assert len(probes) == 2 and probes[0] == probes[1]  # one probe: two publishes of a name


BACKEND_CLASSES = {"LocalBackend", "RemoteBackend", "AzureBackend", "S3Backend"}
PROTOCOL_NAMES = {"s3", "s3a", "az", "abfs", "abfss", "gs", "gcs"}
# The backends themselves, and the registrations that name their protocols.
BACKEND_MODULES = {"local.py", "remote.py", "azure.py", "azure_auth.py", "s3.py", "builtins.py"}


def _strings(node: ast.AST) -> set[str]:
    items = node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else [node]
    return {i.value for i in items if isinstance(i, ast.Constant) and isinstance(i.value, str)}


def test_no_module_tells_backends_apart_by_class_or_protocol_name() -> None:
    # Catches: an isinstance on a backend class, or a protocol's name compared, outside the
    # backends (what a store can do is what its backend declares: Capabilities).
    package = Path(__file__).resolve().parents[2] / "core" / "nebulaml"
    breaches = []
    for path in sorted(package.rglob("*.py")):
        if path.parent.name == "storage" and path.name in BACKEND_MODULES:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            where = f"{path.relative_to(package)}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "isinstance":
                names = {getattr(n, "id", getattr(n, "attr", "")) for n in ast.walk(node.args[1])}
                if names & BACKEND_CLASSES:
                    breaches.append(f"{where}: isinstance on a backend class")
            if isinstance(node, ast.Compare):
                for operand in [node.left, *node.comparators]:
                    if _strings(operand) & PROTOCOL_NAMES:
                        breaches.append(f"{where}: a protocol's name compared")
    assert breaches == []
