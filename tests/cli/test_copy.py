"""`nebula copy`: verified, committed last, resumable; faults from a real fsspec filesystem.

`FaultFS` keeps its files on the local disk (through fsspec's LocalFileSystem) but is not a
LocalFileSystem, so nebula drives it through fsspec as it would a remote store. It counts
the bytes written per file, and can fail (EIO) or corrupt the write of a chosen item file.
Each test registers a subclass under a protocol of its own (fsspec's registry is global).
"""

from __future__ import annotations

import errno
import json
import os
import socket
import sys
import uuid
from collections import Counter
from pathlib import Path
from typing import Any, ClassVar

import fsspec
import pytest
import torch
import warm
from fsspec.implementations.local import LocalFileSystem
from fsspec.spec import AbstractFileSystem
from typer.testing import CliRunner

import nebulaml as nm
from nebula_cli.app import app

EXE = Path(sys.executable).parent / "nebula"
STATE = {"w": torch.randn(300, 300, generator=torch.Generator().manual_seed(7)), "n": 3}


class FaultFS(AbstractFileSystem):
    """A local-disk fsspec filesystem whose writes of one item file can fail or corrupt."""

    protocol: ClassVar[Any] = ("faultcopy",)
    root_marker = "/"
    cachable = False
    fail_file: ClassVar[str | None] = None  # its first write raises OSError(EIO)
    corrupt_file: ClassVar[str | None] = None  # its bytes reach the disk with one bit flipped
    written: ClassVar[Counter[str]]  # bytes written, per file name

    def __init__(self, **storage_options: Any) -> None:
        super().__init__(**storage_options)
        self._local = LocalFileSystem()

    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
        raw = self._local.open(path, mode)
        return raw if "r" in mode else _Writer(type(self), raw, path.rsplit("/", 1)[-1])

    def ls(self, path: str, detail: bool = True, **kwargs: Any) -> Any:
        return self._local.ls(path, detail=detail)

    def info(self, path: str, **kwargs: Any) -> dict[str, Any]:
        return self._local.info(path)

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        self._local.makedirs(path, exist_ok=exist_ok)

    def rm_file(self, path: str) -> None:
        self._local.rm_file(path)

    def rm(self, path: Any, recursive: bool = False, maxdepth: int | None = None) -> None:
        self._local.rm(path, recursive=recursive, maxdepth=maxdepth)

    def cat_file(self, path: str, start: int | None = None, end: int | None = None, **kw: Any):
        return self._local.cat_file(path, start=start, end=end)


class _Writer:
    def __init__(self, fs: type[FaultFS], raw: Any, name: str) -> None:
        self._fs, self._raw, self._name = fs, raw, name

    def write(self, data: Any) -> int:
        chunk = bytes(memoryview(data).cast("B"))
        if self._name == self._fs.fail_file:
            raise OSError(errno.EIO, os.strerror(errno.EIO), self._name)
        if self._name == self._fs.corrupt_file and chunk:
            chunk = bytes([chunk[0] ^ 1]) + chunk[1:]
        self._fs.written[self._name] += len(chunk)
        return self._raw.write(chunk)

    def flush(self) -> None:
        self._raw.flush()

    @property
    def closed(self) -> bool:
        return bool(self._raw.closed)

    def close(self) -> None:
        self._raw.close()

    def __enter__(self) -> _Writer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@pytest.fixture
def faultfs() -> type[FaultFS]:
    protocol = f"faultcopy{uuid.uuid4().hex[:10]}"
    cls = type(f"FaultFS_{protocol}", (FaultFS,), {"protocol": (protocol,), "written": Counter()})
    fsspec.register_implementation(protocol, cls, clobber=True)
    return cls


def populate(root: Path) -> None:
    """global_step1 on the persistent root; global_step2 in the memory tier only."""
    nm.init(str(root), persistent_time_interval=3600)
    for step in (1, 2):
        ckpt = nm.Checkpoint(f"global_step{step}", 2)
        ckpt.save("model", STATE)
        ckpt.save("optimizer", {"lr": 0.1 * step})
        if step == 1:
            nm.flush_persistence()


def copy(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(app, ["copy", *args])
    return result.exit_code, result.stdout, result.stderr


def assert_same_files(folder: Path, step: int) -> None:
    """The copied items, read by plain torch.load, hold the saved state bit for bit."""
    model = torch.load(folder / f"global_step{step}" / "model", weights_only=True)
    assert model["n"] == 3 and torch.equal(model["w"], STATE["w"])
    assert torch.load(folder / f"global_step{step}" / "optimizer", weights_only=True) == {
        "lr": 0.1 * step
    }


def test_resume_after_a_failed_write_skips_the_verified_item(
    root: Path, tmp_path: Path, faultfs: type[FaultFS]
) -> None:
    # catches: a rerun that rewrites what was already copied, or commits a half copy
    populate(root)
    folder = tmp_path / "dest"
    dest = f"{faultfs.protocol[0]}://{folder}"
    faultfs.fail_file = "optimizer"  # the 2nd item
    code, out, err = copy(str(root), "global_step1", dest, "--json")
    assert code == 1 and json.loads(out)["error"]["exception"] == "StorageError"
    (line,) = [x for x in err.splitlines() if x.startswith("nebula:")]
    assert line.startswith(f"nebula: error: {dest}/global_step1/optimizer: ")
    assert "Input/output error" in line and "Traceback" not in err
    assert nm.list_checkpoints(dest) == []  # not committed
    assert not (folder / "global_step1" / "manifest.json").exists()
    model_written = faultfs.written["model"]
    model_stat = (folder / "global_step1" / "model").stat()
    assert model_written == model_stat.st_size > 0

    faultfs.fail_file = None
    code, out, err = copy(str(root), "global_step1", dest, "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["skipped_items"] == ["model"] and doc["copied_items"] == ["optimizer"]
    assert doc["skipped_bytes"] == model_stat.st_size
    assert doc["copied_bytes"] == doc["total_bytes"] - doc["skipped_bytes"]
    assert faultfs.written["model"] == model_written  # not one byte of it written again
    after = (folder / "global_step1" / "model").stat()
    assert (after.st_ino, after.st_mtime_ns) == (model_stat.st_ino, model_stat.st_mtime_ns)
    assert [c["tag"] for c in nm.list_checkpoints(dest)] == ["global_step1"]
    assert_same_files(folder, 1)


def test_verifies_what_the_destination_holds(
    root: Path, tmp_path: Path, faultfs: type[FaultFS]
) -> None:
    # catches: "verified" meaning only the bytes sent, hashed on the way, not those stored
    populate(root)
    dest = f"{faultfs.protocol[0]}://{tmp_path / 'dest'}"
    faultfs.corrupt_file = "model"
    code, out, err = copy(str(root), "global_step1", dest)
    assert code == 1 and out == ""
    assert err.splitlines()[-1].startswith(
        f"nebula: error: {dest}/global_step1/model: corrupt item"
    )
    assert "after writing it" in err
    assert nm.list_checkpoints(dest) == []
    faultfs.corrupt_file = None
    code, out, err = copy(str(root), "global_step1", dest, "--json")
    assert code == 0, err
    assert json.loads(out)["copied_items"] == ["model", "optimizer"]  # the bad one rewritten
    assert_same_files(tmp_path / "dest", 1)


def test_latest_copies_the_newest_from_the_memory_tier(root: Path, tmp_path: Path) -> None:
    populate(root)
    code, out, err = copy(str(root), "--latest", str(tmp_path / "dest"), "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert (doc["tag"], doc["source_tier"]) == ("global_step2", "memory")
    assert doc["destination"] == str(tmp_path / "dest") and doc["destination_tier"] is None
    assert_same_files(tmp_path / "dest", 2)


def test_tier_words_name_the_roots_own_tiers(
    root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # catches: 'persistent' or 'memory' taken as a folder name in the working directory
    workdir = tmp_path / "workdir"
    workdir.mkdir()
    monkeypatch.chdir(workdir)  # where such a bug would write
    populate(root)
    code, out, err = copy(str(root), "global_step2", "persistent", "--json")
    assert code == 0, err
    assert json.loads(out)["destination"] == str(root)
    assert_same_files(root, 2)
    code, out, err = copy(str(root), "global_step1", "memory", "--json")
    assert code == 0, err
    assert json.loads(out)["destination"] == nm.memory_tier_path(str(root))
    assert list(workdir.iterdir()) == []


def _modes_under(folder: Path) -> set[tuple[str, int]]:
    """("dir" or "file", permission bits) of `folder` and everything under it."""
    found = {("dir", folder.stat().st_mode & 0o777)}
    for path in folder.rglob("*"):
        found.add(("dir" if path.is_dir() else "file", path.stat().st_mode & 0o777))
    return found


@pytest.mark.parametrize("umask", [0o022, 0o000])
def test_private_copy_is_this_users_alone_whatever_the_umask(
    root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, umask: int
) -> None:
    # catches: NEBULA_PRIVATE=1 nebula copy writing the destination by the umask (755/644
    # under 022, 777/666 under 0): its Store was opened without `private`.
    populate(root)
    monkeypatch.setenv("NEBULA_PRIVATE", "1")
    old = os.umask(umask)
    try:
        code, _, err = copy(str(root), "global_step1", str(tmp_path / "new" / "dest"))
        (tmp_path / "existing").mkdir(0o777)
        os.chmod(tmp_path / "existing", 0o777)
        code2, _, err2 = copy(str(root), "global_step2", str(tmp_path / "existing"))
    finally:
        os.umask(old)
    assert code == 0 and code2 == 0, err + err2
    assert_same_files(tmp_path / "new" / "dest", 1)
    assert _modes_under(tmp_path / "new") == {("dir", 0o700), ("file", 0o600)}
    assert _modes_under(tmp_path / "existing") == {("dir", 0o700), ("file", 0o600)}


def test_committed_destination_refused_unless_overwrite(root: Path, tmp_path: Path) -> None:
    populate(root)
    dest = tmp_path / "dest"
    assert copy(str(root), "global_step1", str(dest))[0] == 0
    same = copy(str(root), "global_step1", str(dest), "--json")
    assert same[0] == 0 and json.loads(same[1])["unchanged"] is True  # identical: a no-op
    nm.Checkpoint("global_step1", overwrite=True).save("model", {"other": 1})  # a new version
    code, out, err = copy(str(root), "global_step1", str(dest))
    assert code == 1 and out == ""
    assert err.splitlines() == [
        f"nebula: error: {dest}: checkpoint 'global_step1' is already committed; copy with "
        f"overwrite=True (nebula copy --overwrite) to replace it"
    ]
    assert_same_files(dest, 1)
    code, out, err = copy(str(root), "global_step1", str(dest), "--overwrite")
    assert code == 0, err
    assert "Copied global_step1 from the memory tier" in out
    assert torch.load(dest / "global_step1" / "model", weights_only=True) == {"other": 1}


def test_busy_destination_refused(
    root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from nebulaml.protocol import cowriters

    # A live writer of the tag there (a job's persister, say): the copy says it waits for
    # it (issue #18), then, still busy after the wait, refuses.
    monkeypatch.setattr(cowriters, "BUSY_WAIT_S", 0.3)
    populate(root)
    folder = tmp_path / "dest" / "global_step1"
    folder.mkdir(parents=True)
    doc = {"host": socket.gethostname(), "pid": os.getppid(), "rank": 0, "started_at": "x"}
    (folder / ".writer-0.json").write_text(json.dumps(doc))
    code, out, err = copy(str(root), "global_step1", str(tmp_path / "dest"))
    assert code == 1 and out == ""
    waiting, refused = err.splitlines()
    assert f"is in use by pid {os.getppid()}" in waiting and "waiting for it" in waiting
    assert f"is being written by pid {os.getppid()}" in refused


ERRORS = [
    (
        ("global_step7", "{dest}"),
        3,
        "{root}: no checkpoint 'global_step7' found; "
        "did you mean 'global_step2' or 'global_step1'?",
    ),
    (("../x", "{dest}"), 2, "invalid tag '../x': must not contain a path separator"),
]


@pytest.mark.parametrize(("args", "code", "message"), ERRORS, ids=["missing-tag", "unsafe-tag"])
def test_errors(root: Path, tmp_path: Path, args: tuple[str, ...], code: int, message: str) -> None:
    populate(root)
    fill = {"root": str(root), "dest": str(tmp_path / "dest")}
    result = copy(str(root), *(a.format(**fill) for a in args))
    assert result[0] == code and result[1] == ""
    # no progress bar: one line
    assert result[2].splitlines() == ["nebula: error: " + message.format(**fill)]
    assert not (tmp_path / "dest").exists()


def test_missing_root_and_empty_root_are_not_found(tmp_path: Path) -> None:
    code, out, err = copy(str(tmp_path / "nope"), "global_step1", str(tmp_path / "d"))
    assert (code, out) == (3, "")
    assert err.strip() == f"nebula: error: {tmp_path / 'nope'}: no such checkpoint root"
    (tmp_path / "empty").mkdir()
    code, out, err = copy(str(tmp_path / "empty"), "--latest", str(tmp_path / "d"))
    assert (code, out) == (3, "")
    assert err.strip() == f"nebula: error: {tmp_path / 'empty'}: no committed checkpoint found"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("global_step1",), "give the destination root"),
        (("--latest",), "give the destination root"),
        (("global_step1", "d", "--latest"), "give TAG or --latest, not both"),
        ((), "give the checkpoint to copy, or --latest"),
    ],
    ids=["no-dest", "latest-no-dest", "tag-and-latest", "nothing"],
)
def test_usage_errors(root: Path, args: tuple[str, ...], message: str) -> None:
    populate(root)
    code, out, err = copy(str(root), *args)
    assert code == 2 and out == ""
    assert message in err


def test_as_a_real_command(root: Path, tmp_path: Path, memory_tier: Path) -> None:
    populate(root)
    nm.shutdown()  # the job ends: global_step2 persisted too
    env = dict(os.environ, NEBULA_MEMORY_TIER_PATH=str(memory_tier), COLUMNS="200")
    dest = tmp_path / "backup"
    out = warm.run([EXE, "copy", str(root), "global_step1", str(dest)], capture_output=True,
                         text=True, env=env, timeout=60)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"Copied global_step1 from the persistent tier {root} to {dest}")
    assert "verified and committed" in out.stdout
    assert out.stderr == ""  # off a terminal, progress lines only for a copy that takes a while
    assert_same_files(dest, 1)
    out = warm.run([EXE, "copy", str(root), "--latest", str(dest), "--json"],
                         capture_output=True, text=True, env=env, timeout=60)  # fmt: skip
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["tag"] == "global_step2" and doc["copied_bytes"] == doc["total_bytes"] > 360_000
    assert_same_files(dest, 2)
