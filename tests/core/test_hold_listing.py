"""A restart's job-hold check (protocol/holds.py) costs the same at any number of
checkpoints (#47): the root's hold files (`.nebula-job-*`) are listed by that prefix
(`Store.list_prefixed`), not with the root's every tag folder. Counted, not timed: on a
local disk the names whose type or size the check asked (each a system call or an entry
looked at), on S3 what the server sent back (through a counting relay in front of moto).
And the listing keeps what the hold protocol relies on: only regular files, no link
followed, a FIFO or a folder named like a hold still no hold."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import s3server
from wirecount import CountingRelay

from nebulaml.errors import StorageError
from nebulaml.format.names import JOB_PREFIX
from nebulaml.protocol import holds
from nebulaml.protocol.holds import RootLease, lease_name
from nebulaml.storage.store import Store


def _local_root(base: Path, tags: int) -> Store:
    """A root of `tags` tag folders (a file each) and one job's hold."""
    root = base / f"root-{tags}"
    for i in range(1, tags + 1):
        (root / f"global_step{i}").mkdir(parents=True)
        (root / f"global_step{i}" / "model").write_bytes(b"x")
    store = Store(str(root))
    RootLease.take(store, "job-a")
    return store


class _Entry:
    """A scandir entry that notes the name of each entry whose type or stat is asked."""

    def __init__(self, entry: os.DirEntry[str], looked: list[str]) -> None:
        self._entry, self._looked, self.name, self.path = entry, looked, entry.name, entry.path

    def __getattr__(self, attr: str) -> Any:
        if attr in ("is_file", "is_dir", "is_symlink", "stat", "inode"):
            self._looked.append(self.name)
        return getattr(self._entry, attr)


class _Scan:
    def __init__(self, scan: Any, looked: list[str]) -> None:
        self._scan, self._looked = scan, looked

    def __iter__(self) -> Iterator[_Entry]:
        return (_Entry(entry, self._looked) for entry in self._scan)

    def __enter__(self) -> _Scan:
        return self

    def __exit__(self, *exc: object) -> None:
        self._scan.close()


def _looked_at(store: Store, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names the hold check of `store` asked the type or the status of, one by one
    (an lstat, a stat, a scandir entry's is_file...), on a fresh handle."""
    looked: list[str] = []
    fresh = Store(store.url)
    scandir, stat, lstat = os.scandir, os.stat, os.lstat

    def name(path: Any) -> str:
        return os.path.basename(os.fspath(path)) if not isinstance(path, int) else str(path)

    def noting(call: Any) -> Any:
        def noted(path: Any, *args: Any, **kw: Any) -> Any:
            looked.append(name(path))
            return call(path, *args, **kw)

        return noted

    with monkeypatch.context() as patch:
        patch.setattr(os, "scandir", lambda path=".": _Scan(scandir(path), looked))
        patch.setattr(os, "stat", noting(stat))
        patch.setattr(os, "lstat", noting(lstat))
        found = holds._holds(fresh)
    assert [f.name for f in found] == [lease_name(1)]
    return looked


def test_a_local_hold_check_looks_at_the_holds_names_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Bug caught: the check listed the whole root (`list_files()`), an entry and its type
    per tag folder: 6-7 ms of a 37 ms restart at 10,000 tags. Now the root's names are
    filtered by the prefix before anything is asked of one."""
    at_50 = _looked_at(_local_root(tmp_path, 50), monkeypatch)
    at_2000 = _looked_at(_local_root(tmp_path, 2_000), monkeypatch)
    assert all(n.startswith(JOB_PREFIX) for n in at_50 + at_2000), sorted(set(at_2000))[:5]
    assert len(at_2000) == len(at_50), (at_50, at_2000)  # was 50+ and 2,000+


@pytest.fixture
def relay(s3_server: s3server.MotoServer) -> Iterator[CountingRelay]:
    server = CountingRelay(s3_server.port)
    yield server
    server.close()


def _s3_root(s3_server: s3server.MotoServer, tags: int) -> str:
    """An S3 root of `tags` tag folders (an object each) and one job's hold."""
    import s3fs

    url = f"s3://nebula-tests/holds-{uuid.uuid4().hex[:12]}"
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **s3_server.options())
    key = url.removeprefix("s3://")
    fs.pipe({f"{key}/global_step{i}/model": b"x" for i in range(1, tags + 1)})
    RootLease.take(Store(url, s3_server.options()), "job-a")
    return url


def _received(url: str, options: dict[str, Any], relay: CountingRelay) -> tuple[int, int]:
    """(requests, bytes the server sent back) of one hold check of `url`."""
    store = Store(url, options)
    requests, before = len(relay.heads), relay.received
    assert [f.name for f in holds._holds(store)] == [lease_name(1)]
    return len(relay.heads) - requests, relay.received - before


def test_an_s3_hold_check_costs_the_same_at_any_number_of_tags(
    s3_server: s3server.MotoServer, relay: CountingRelay
) -> None:
    """Bug caught: the check listed the root with a delimiter: every tag folder came back
    (a CommonPrefix each, a request per 1,000). Now one `ListObjectsV2` of the holds'
    prefix."""
    options = {**s3_server.options(), "endpoint_url": relay.endpoint}
    at_50 = _received(_s3_root(s3_server, 50), options, relay)
    at_2000 = _received(_s3_root(s3_server, 2_000), options, relay)
    assert at_2000[0] == at_50[0], (at_50, at_2000)  # was 1 listing request more
    assert at_2000[1] <= at_50[1] + 512, (at_50, at_2000)  # was 100+ KB more


def test_hostile_names_like_a_hold_are_no_hold_and_no_link_is_followed(tmp_path: Path) -> None:
    """A FIFO, a folder, a symbolic link (to a hold elsewhere, to a folder) and a file
    with odd digits, each named like a hold: the prefix listing gives regular files only
    (never opens the FIFO, never follows a link), as the whole listing did; the check
    finds the one real hold, and a take goes on from it."""
    root = tmp_path / "root"
    root.mkdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / lease_name(7)).write_text('{"job": "x", "host": "h", "pid": 1}')
    os.mkfifo(root / lease_name(9))
    (root / lease_name(8)).mkdir()
    (root / lease_name(7)).symlink_to(elsewhere / lease_name(7))
    (root / lease_name(6)).symlink_to(elsewhere)
    (root / ".nebula-job-\u00b2.json").write_text("{}")
    (root / "global_step1").mkdir()
    store = Store(str(root))
    RootLease.take(store, "job-a").release()  # none of them is a hold: generation 1
    lease = RootLease.take(store, "job-a")
    listed = store.list_prefixed(prefix=JOB_PREFIX)
    assert sorted(listed) == sorted([lease_name(1), ".nebula-job-\u00b2.json"])
    assert listed == {n: s for n, s in store.list_files().items() if n.startswith(JOB_PREFIX)}
    assert [f.name for f in holds._holds(store)] == [lease_name(1)]
    assert lease.name == lease_name(1)
    lease.release()
    assert (elsewhere / lease_name(7)).exists()  # nothing removed through the link
    assert store.list_prefixed("global_step1", prefix=JOB_PREFIX) == {}
    os.symlink(elsewhere, root / "linked")
    with pytest.raises(StorageError, match="symbolic link"):
        store.list_prefixed("linked", prefix=JOB_PREFIX)  # a folder reached through a link
    with pytest.raises(ValueError, match="no '/'"):
        store.list_prefixed(prefix="a/b")
