"""Shared by the crash and exit tests and the child processes they start.

`FaultFS` is a real fsspec filesystem that keeps its files on the local disk (through
fsspec's LocalFileSystem) and can make item writes block or fail part-way. It is not a
LocalFileSystem itself: nebula's Store takes a fast path (plain os calls) for those, which
would bypass the injected faults, so FaultFS is driven through fsspec like a remote store.
Only item files are affected, never nebula's markers, manifests or the history file.

`known_state(step, item)` is what a test saves, the same in every process. `Child` runs one
scenario of nebula_child.py with bounded waits on its output and its exit.

Not for: anything the library itself uses.
"""

from __future__ import annotations

import errno
import os
import selectors
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem
from fsspec.spec import AbstractFileSystem

ITEMS = ("model", "optimizer")
CHILD_SCRIPT = Path(__file__).with_name("nebula_child.py")
_NOT_ITEMS = ("manifest.json", "checkpointHistories.csv")


def known_state(step: int, item: str) -> dict[str, Any]:
    """The object saved as `item` of `global_step<step>`: seeded, so reproducible anywhere."""
    import torch

    gen = torch.Generator().manual_seed(1000 * step + ITEMS.index(item))
    return {
        "w": torch.randn(64, 64, generator=gen),
        "b": torch.randn(64, generator=gen).to(torch.float64),
        "step": step,
    }


def save_step(step: int, items: tuple[str, ...] = ITEMS) -> None:
    """Save `known_state` as the items of `global_step<step>`; the last save commits.
    Returns once it is committed in the memory tier: a lazy save (the default) is waited
    for, as a training loop's next optimizer.step() waits for its copy."""
    import nebulaml as nm

    ckpt = nm.Checkpoint(f"global_step{step}", len(items))
    for item in items:
        ckpt.save(item, known_state(step, item))
    nm.wait_for_snapshot()


def assert_same_state(actual: dict[str, Any], expected: dict[str, Any]) -> None:
    """Bit-for-bit: the same keys, tensors of the same dtype and shape with equal bytes."""
    import torch

    assert actual.keys() == expected.keys()
    for key, want in expected.items():
        got = actual[key]
        if isinstance(want, torch.Tensor):
            assert isinstance(got, torch.Tensor) and got.dtype == want.dtype, key
            assert torch.equal(got, want), key
        else:
            assert got == want, key


def committed_tags(store: Any) -> list[str]:
    """Tags committed on one tier (a nebulaml Store), oldest first."""
    from nebulaml.protocol.catalog import list_committed

    return [info.tag for info in list_committed(store)]


def assert_files_hold_known(folder: Path, step: int) -> None:
    """The items of `global_step<step>` under `folder`, read with plain torch.load as any
    user would, hold `known_state` bit for bit."""
    import torch

    for item in ITEMS:
        loaded = torch.load(folder / f"global_step{step}" / item, weights_only=True)
        assert_same_state(loaded, known_state(step, item))


def history_rows(folder: Path) -> list[dict[str, str]]:
    """The rows of checkpointHistories.csv at a persistent root on this disk (a local
    root, or a FaultFS one: there each batch of rows is an object of its own, as on any
    fsspec store, `_read`)."""
    import csv
    import io

    return list(csv.DictReader(io.StringIO(_read(str(folder / "checkpointHistories.csv")))))


def unique_protocol() -> str:
    """A protocol name of its own for one test (fsspec's registry is process-global)."""
    return f"faultfs{uuid.uuid4().hex[:10]}"


class FaultFS(AbstractFileSystem):
    """A local-disk fsspec filesystem whose item writes can block or fail.

    Configure a registered subclass (see `register`) through its class attributes:
    `mode` is "ok", "block" (write `fault_after_bytes` bytes, announce, then wait for
    `release`) or "fail" (write `fault_after_bytes` bytes, then raise OSError(`fail_errno`));
    `fault_tags` limits the faults to items of those tags (None: every tag).
    """

    protocol: Any = ("faultfs",)
    root_marker = "/"
    cachable = False

    mode = "ok"
    fault_after_bytes = 4096
    fail_errno = errno.EIO
    fault_tags: frozenset[str] | None = None
    blocked: threading.Event
    release: threading.Event
    history_written: threading.Condition

    def __init__(self, **storage_options: Any) -> None:
        super().__init__(**storage_options)
        self._local = LocalFileSystem()

    # what the fault applies to ----------------------------------------------------------
    @classmethod
    def _faulty(cls, path: str) -> bool:
        folder, _, name = path.rpartition("/")
        if name.startswith(".") or name in _NOT_ITEMS:
            return False
        tag = folder.rpartition("/")[2]
        return cls.fault_tags is None or tag in cls.fault_tags

    # the filesystem, delegated to the local disk -----------------------------------------
    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
        raw = self._local.open(path, mode)
        if "r" in mode:
            return raw
        return _Writer(type(self), raw, path)

    def ls(self, path: str, detail: bool = True, **kwargs: Any) -> Any:
        return self._local.ls(path, detail=detail)

    def info(self, path: str, **kwargs: Any) -> dict[str, Any]:
        return self._local.info(path)

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        self._local.makedirs(path, exist_ok=exist_ok)

    def mkdir(self, path: str, create_parents: bool = True, **kwargs: Any) -> None:
        self._local.mkdir(path, create_parents=create_parents)

    def rm_file(self, path: str) -> None:
        self._local.rm_file(path)

    def rm(self, path: Any, recursive: bool = False, maxdepth: int | None = None) -> None:
        self._local.rm(path, recursive=recursive, maxdepth=maxdepth)

    def cat_file(self, path: str, start: int | None = None, end: int | None = None, **kw: Any):
        return self._local.cat_file(path, start=start, end=end)


class _Writer:
    """A file being written through FaultFS: injects the configured fault into writes."""

    def __init__(self, fs_cls: type[FaultFS], raw: Any, path: str) -> None:
        self._cls, self._raw, self._path = fs_cls, raw, path
        self._faulty = fs_cls._faulty(path)
        self._written = 0

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        cls = self._cls
        room = cls.fault_after_bytes - self._written
        if self._faulty and cls.mode != "ok" and len(view) > room:
            self._raw.write(view[: max(room, 0)])
            self._raw.flush()
            self._written += max(room, 0)
            if cls.mode == "fail":
                raise OSError(cls.fail_errno, os.strerror(cls.fail_errno), self._path)
            cls.blocked.set()
            sys.stdout.write(f"PERSISTING {self._path}\n")
            sys.stdout.flush()
            cls.release.wait()
            view = view[max(room, 0) :]
        self._raw.write(view)
        self._written += len(view)
        return len(view)

    def flush(self) -> None:
        self._raw.flush()

    def writable(self) -> bool:
        return True

    @property
    def closed(self) -> bool:
        return bool(self._raw.closed)

    def close(self) -> None:
        self._raw.close()
        if "/checkpointHistories.csv" in self._path or "/.checkpointHistories.csv.d/" in self._path:
            with self._cls.history_written:
                self._cls.history_written.notify_all()

    def __enter__(self) -> _Writer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def register(protocol: str, **config: Any) -> type[FaultFS]:
    """Register a FaultFS subclass under `protocol` (replacing an earlier one)."""
    attrs = {
        "protocol": (protocol,),
        "blocked": threading.Event(),
        "release": threading.Event(),
        "history_written": threading.Condition(),
        **config,
    }
    cls = type(f"FaultFS_{protocol}", (FaultFS,), attrs)
    fsspec.register_implementation(protocol, cls, clobber=True)
    return cls


def wait_for_history(cls: type[FaultFS], path: str, done: Callable[[str], bool], timeout_s: float):
    """Wait (bounded) until the history file at `path`, written through `cls`, satisfies
    `done(text)`; returns the text, or raises TimeoutError."""
    with cls.history_written:
        ok = cls.history_written.wait_for(lambda: done(_read(path)), timeout=timeout_s)
    if not ok:
        raise TimeoutError(f"{path} did not reach the expected state within {timeout_s} s")
    return _read(path)


def _read(path: str) -> str:
    """An appended file's text as nebula reads it back: the file, then (on an fsspec store,
    where each append is an object of its own) `.<name>.d/*.part` in the order of their
    names."""
    folder, _, name = path.rpartition("/")
    parts = Path(folder) / f".{name}.d"
    pieces = []
    try:
        with open(path, encoding="utf-8") as f:
            pieces.append(f.read())
    except FileNotFoundError:
        pass
    if parts.is_dir():
        pieces += [p.read_text(encoding="utf-8") for p in sorted(parts.glob("*.part"))]
    return "".join(p if p.endswith("\n") else p + "\n" for p in pieces if p)


class Child:
    """A child process running `nebula_child.py SCENARIO ARGS...`; every wait is bounded.

    stdout is read here (the scenario's progress lines); stderr goes to `stderr_path`.
    """

    def __init__(self, scenario: str, *args: object, env: dict[str, str], stderr_path: Path):
        import warm  # tests/: the test's side only (the children import this module too)

        self._stderr_path = stderr_path
        with open(stderr_path, "wb") as err:
            self.proc = warm.Popen(
                [sys.executable, str(CHILD_SCRIPT), scenario, *map(str, args)],
                stdout=subprocess.PIPE,
                stderr=err,
                env=env,
            )
        self._out = b""

    @property
    def stdout(self) -> str:
        return self._out.decode(errors="replace")

    @property
    def stderr(self) -> str:
        return self._stderr_path.read_text(errors="replace")

    def _describe(self) -> str:
        return f"stdout:\n{self.stdout}\nstderr:\n{self.stderr}"

    def wait_for(self, prefix: str, timeout_s: float) -> str:
        """The first stdout line starting with `prefix`; fails after `timeout_s`, or if the
        child exits first."""
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout_s
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            while True:
                for line in self.stdout.splitlines():
                    if line.startswith(prefix):
                        return line
                left = deadline - time.monotonic()
                if left <= 0:
                    self.kill()
                    raise AssertionError(
                        f"no {prefix!r} line within {timeout_s} s\n{self._describe()}"
                    )
                if sel.select(left):
                    chunk = os.read(self.proc.stdout.fileno(), 1 << 16)
                    if not chunk:
                        rc = self.proc.wait(timeout=10)
                        raise AssertionError(
                            f"the child exited ({rc}) before printing {prefix!r}\n"
                            + self._describe()
                        )
                    self._out += chunk

    def wait(self, timeout_s: float) -> int:
        """Wait for the child to exit on its own; its return code. Kills it after timeout_s."""
        try:
            out, _ = self.proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"the child ran past {timeout_s} s\n{self._describe()}") from None
        self._out += out or b""
        return self.proc.returncode

    def kill(self) -> int:
        """SIGKILL the child (if it still runs) and reap it; its return code."""
        if self.proc.poll() is None:
            self.proc.kill()
        out, _ = self.proc.communicate(timeout=30)
        self._out += out or b""
        return self.proc.returncode
