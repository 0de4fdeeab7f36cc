"""Read leases: a checkpoint being read is never deleted, by any deleter, in any order.

The invariant comes first: a reader holding a lease keeps `delete_checkpoint`, prune,
retention and memory-tier eviction off the tag. Then the orders that matter (a deleter
that claims between the reader's lease and its re-check; a reader that comes after the
deleter decided), driven by stores that run a step of the other side at a chosen call;
then the leases that must not count (dead processes, another host's past its TTL).
"""

from __future__ import annotations

import contextlib
import json
import re
import socket
import sys
import threading
import uuid
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
import torch
import warm
from typer.testing import CliRunner

import nebulaml as nm
from nebula_cli.app import app
from nebulaml.checkpoint import Checkpoint
from nebulaml.protocol.catalog import list_committed, read_committed
from nebulaml.protocol.commit import begin_tag, commit_rank, write_item
from nebulaml.protocol.delete import delete_checkpoint
from nebulaml.protocol.leases import (
    HOLD_TTL_S,
    LEASE_TTL_S,
    delete_claim,
    is_lease_file,
    live_leases,
    parse_lease,
    read_lease,
)
from nebulaml.protocol.tiers import TierSet
from nebulaml.storage.store import Store

TAG = "global_step1"


def commit(store: Store, tag: str, value: float) -> None:
    """`tag` committed on `store` with one item, model = {"w": 4 x value}."""
    begin_tag(store, tag, rank=0, overwrite=False)
    items = [write_item(store, tag, "model", {"w": torch.full((4,), value)}, rank=0)]
    commit_rank(store, tag, rank=0, world_size=1, items=items, created_at="t")


def leases_in(folder: Path) -> list[str]:
    return (
        sorted(p.name for p in folder.iterdir() if is_lease_file(p.name)) if folder.exists() else []
    )


def lease_file(folder: Path, kind: str, pid: int, host: str, taken_at: datetime) -> Path:
    """A lease as another process would have left it (the name is the documented format)."""
    stamp = taken_at.strftime("%Y%m%dT%H%M%S%fZ")
    path = folder / f".lease-{kind}-{stamp}-{pid}-0123abcd-{host}.json"
    path.write_text(json.dumps({"kind": kind, "pid": pid, "host": host}))
    return path


def this_host() -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", socket.gethostname())[:64]


def dead_pid() -> int:
    out = warm.run([sys.executable, "-c", "import os; print(os.getpid())"],
                         capture_output=True, text=True, check=True, timeout=60)  # fmt: skip
    return int(out.stdout)


class HookedStore(Store):
    """A real local store that runs `before_list(n)` / `after_list(n)` around its n-th
    listing (n from 1): the other side of the protocol, run at a chosen point."""

    def __init__(
        self,
        url: str,
        before_list: Callable[[int], None] | None = None,
        after_list: Callable[[int], None] | None = None,
    ) -> None:
        super().__init__(url)
        self.before_list, self.after_list = before_list, after_list
        self.listings = 0

    def list_files(self, *parts: str) -> dict[str, int]:
        self.listings += 1
        if self.before_list is not None:
            self.before_list(self.listings)
        files = super().list_files(*parts)
        if self.after_list is not None:
            self.after_list(self.listings)
        return files


# the invariant -------------------------------------------------------------------------------
def test_a_checkpoint_being_read_is_not_deleted(tmp_path: Path) -> None:
    store = Store(tmp_path / "root")
    commit(store, TAG, 1.0)
    with read_lease(store, TAG) as readable:
        assert readable
        assert len(leases_in(tmp_path / "root" / TAG)) == 1
        assert delete_checkpoint(store, TAG) is False
        assert read_committed(store, TAG) is not None
        # The deleter backed off without a trace: its claim went, no writer marker stayed.
        hidden = sorted(p.name for p in (tmp_path / "root" / TAG).iterdir() if p.name[0] == ".")
        assert hidden == [".lease-read" + hidden[0].removeprefix(".lease-read"), ".rank-0.json"]
    assert leases_in(tmp_path / "root" / TAG) == []
    assert delete_checkpoint(store, TAG) is True
    assert not (tmp_path / "root" / TAG).exists()


@pytest.fixture(params=["local", "memory"])
def any_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A root on the local disk, or in fsspec's memory store (an object store: no folders)."""
    if request.param == "local":
        return str(tmp_path / "root")
    return f"memory://leases-{uuid.uuid4().hex[:12]}"  # the memory store is global


def test_the_protocol_on_each_backend(any_url: str) -> None:
    store = Store(any_url)
    commit(store, TAG, 1.0)
    commit(store, "global_step2", 2.0)
    with read_lease(store, TAG) as readable:
        assert readable
        assert [lease.kind for lease in live_leases(store, TAG)] == ["read"]
        assert delete_checkpoint(store, TAG) is False
        # A deleter that claims between a reader's lease and its check backs off too.
        hooked = HookedStore(any_url, before_list=lambda n: outcome.append(
            delete_checkpoint(Store(any_url), "global_step2")) if n == 1 else None)  # fmt: skip
        outcome: list[bool] = []
        with read_lease(hooked, "global_step2") as second:
            assert outcome == [False] and second
    assert [name for name in store.list_files(TAG) if is_lease_file(name)] == []
    assert delete_checkpoint(store, TAG) is True
    assert read_committed(store, TAG) is None
    with read_lease(store, TAG) as readable:
        assert readable is False
    assert TAG not in store.list_dirs()  # no lease left a folder behind


def test_no_lease_on_a_tag_that_is_not_there(tmp_path: Path) -> None:
    store = Store(tmp_path / "root")
    with read_lease(store, TAG) as readable:
        assert readable is False
    assert not (tmp_path / "root" / TAG).exists()  # the lease created no folder


def test_prune_keeps_a_checkpoint_being_read_and_says_so(root: Path) -> None:
    store = Store(root)
    for step in (1, 2, 3):
        commit(store, f"global_step{step}", float(step))
    with read_lease(store, "global_step1") as readable:
        assert readable
        result = CliRunner().invoke(app, ["prune", str(root), "--keep", "1", "--yes", "--json"])
    assert result.exit_code == 1, result.stderr  # a delete of the plan refused: not all done
    doc = json.loads(result.stdout)
    assert doc["deleted"] == ["global_step2"]
    assert doc["skipped"] == [{"tag": "global_step1", "reason": "being read"}]
    assert [c.tag for c in list_committed(store)] == ["global_step1", "global_step3"]
    plain = CliRunner().invoke(app, ["prune", str(root), "--keep", "1", "--yes"])
    assert plain.exit_code == 0 and "Deleted 1 of 1: global_step1" in plain.stdout


def test_prune_api_reports_a_tag_being_read(root: Path) -> None:
    store = Store(root)
    for step in (1, 2):
        commit(store, f"global_step{step}", float(step))
    plan = nm.plan_prune(nm.list_prune_candidates(str(root)), 1)
    with read_lease(store, "global_step1"):
        result = nm.execute_prune(str(root), plan)
    assert result.deleted == ()
    assert [(s.tag, s.reason) for s in result.skipped] == [("global_step1", "being read")]


def test_retention_and_eviction_keep_a_checkpoint_being_read(root: Path) -> None:
    nm.init(str(root), persistent_time_interval=0, num_of_version_in_retention=1)
    persistent, memory = Store(root), Store(nm.memory_tier_path(str(root)))

    def save(step: int) -> None:
        nm.Checkpoint(f"global_step{step}").save("model", {"w": torch.full((64,), float(step))})
        nm.flush_persistence()

    save(1)
    assert read_committed(memory, TAG) is not None
    with read_lease(persistent, TAG) as on_disk, read_lease(memory, TAG) as in_memory:
        assert on_disk and in_memory
        save(2)  # retention (keep 1) and eviction both want global_step1 gone now
        assert read_committed(persistent, TAG) is not None
        assert read_committed(memory, TAG) is not None
        assert torch.equal(nm.get_checkpoint(TAG).load("model")["w"], torch.full((64,), 1.0))
    save(3)  # the next round deletes it
    assert [c.tag for c in list_committed(persistent)] == ["global_step3"]
    assert TAG not in [c.tag for c in list_committed(memory)]
    nm.shutdown()


def test_an_overwrite_of_a_checkpoint_being_read_is_refused(tmp_path: Path) -> None:
    store = Store(tmp_path / "root")
    commit(store, TAG, 1.0)
    with read_lease(store, TAG), pytest.raises(nm.CheckpointBusyError, match="being read by pid"):
        begin_tag(store, TAG, rank=0, overwrite=True)
    assert read_committed(store, TAG) is not None


# the read paths hold a lease -----------------------------------------------------------------
def test_load_holds_a_lease_while_it_reads(tmp_path: Path) -> None:
    url = str(tmp_path / "root")
    commit(Store(url), TAG, 7.0)
    attempts: list[bool] = []

    class DeletingStore(Store):
        """Tries to delete the tag (through another Store) whenever load reads a file of it,
        however it reads it (the manifest, the item as bytes or read whole)."""

        def read_bytes(self, *parts: str) -> bytes:
            attempts.append(delete_checkpoint(Store(url), TAG))
            return super().read_bytes(*parts)

        def read_local(self, *parts: str, algo: str | None = None) -> Any:
            attempts.append(delete_checkpoint(Store(url), TAG))
            return super().read_local(*parts, algo=algo)  # type: ignore[misc]

    handle = Checkpoint._committed_handle(TAG, TierSet(memory=DeletingStore(url), persistent=None))
    assert torch.equal(handle.load("model")["w"], torch.full((4,), 7.0))
    assert len(attempts) >= 2 and not any(attempts)  # the manifest and the item
    assert leases_in(tmp_path / "root" / TAG) == []


def test_copy_and_verify_hold_a_lease_while_they_read(root: Path) -> None:
    nm.init(str(root), persistent_time_interval=0, keep_memory_tier=True)
    nm.Checkpoint(TAG).save("model", {"w": torch.ones(1 << 16)})
    nm.flush_persistence()
    nm.shutdown()
    memory, persistent = Store(nm.memory_tier_path(str(root))), Store(root)
    attempts: list[bool] = []

    def deleting(store: Store) -> Callable[[int, int], None]:
        def progress(done: int, total: int) -> None:
            if done > 0:  # the first call comes before any read (outside the lease)
                attempts.append(delete_checkpoint(store, TAG))

        return progress

    # The copy reads the fastest tier: the memory tier's copy.
    result = nm.copy_checkpoint(
        str(root), TAG, str(root.parent / "copy"), progress=deleting(memory)
    )
    assert result["source_tier"] == "memory"
    assert attempts and not any(attempts)
    assert read_committed(memory, TAG) is not None
    # Verify reads every copy; with the memory copy gone, only the persistent one.
    assert delete_checkpoint(memory, TAG) is True
    attempts.clear()
    results = nm.verify_checkpoints(str(root), TAG, progress=deleting(persistent))
    assert [(r["tier"], r["status"]) for r in results] == [("persistent", "ok")]
    assert attempts and not any(attempts)


# interleavings -------------------------------------------------------------------------------
def test_a_deleter_that_claims_between_lease_and_recheck_backs_off(tmp_path: Path) -> None:
    """r1 (lease), then the whole delete attempt, then r2 (the reader's listing)."""
    url = str(tmp_path / "root")
    commit(Store(url), TAG, 3.0)
    outcome: list[bool] = []

    def deleter(n: int) -> None:
        if n == 1:  # the reader's first listing: its lease is published, nothing checked
            outcome.append(delete_checkpoint(Store(url), TAG))

    reader = HookedStore(url, before_list=deleter)
    with read_lease(reader, TAG) as readable:
        assert outcome == [False]  # the deleter saw the lease
        assert readable  # and the reader saw no claim: the deleter had removed it
        assert read_committed(reader, TAG) is not None
    assert delete_checkpoint(Store(url), TAG) is True


def test_a_reader_after_the_deleter_decided_reads_nothing(tmp_path: Path) -> None:
    """d1 d2 (claim, no lease seen), then r1 r2: the reader sees the claim and waits;
    the deleter removes the manifest; the reader gives up."""
    url = str(tmp_path / "root")
    commit(Store(url), TAG, 3.0)
    checked, go, reader_saw_claim = threading.Event(), threading.Event(), threading.Event()
    deleted: list[bool] = []

    def pause_after_check(n: int) -> None:
        if n == 2:  # delete_checkpoint lists, claims, then lists for leases (call 2)
            checked.set()
            assert go.wait(30)

    def delete() -> None:
        deleted.append(delete_checkpoint(HookedStore(url, after_list=pause_after_check), TAG))

    thread = threading.Thread(target=delete)
    thread.start()
    assert checked.wait(30)
    reader = HookedStore(url, after_list=lambda n: reader_saw_claim.set() if n == 1 else None)
    outcome: list[bool] = []

    def read() -> None:
        with read_lease(reader, TAG) as readable:
            outcome.append(readable)

    reading = threading.Thread(target=read)
    reading.start()
    try:
        assert reader_saw_claim.wait(30)
        assert outcome == []  # it waits for the deleter's decision, it does not read
    finally:
        go.set()
        thread.join(30)
        reading.join(30)
    assert deleted == [True] and outcome == [False]
    assert not (tmp_path / "root" / TAG).exists()


def test_a_leftover_committed_after_the_deleters_listing_stays(tmp_path: Path) -> None:
    """A deleter lists a folder being written (no manifest: a leftover to it); its writer
    then commits and a reader takes a lease, before the deleter claims: the deleter must
    not delete what is now a committed checkpoint being read (the uncommitted path
    publishes no delete claim for the reader to see)."""
    url = str(tmp_path / "root")
    writer = Store(url)
    begin_tag(writer, TAG, rank=0, overwrite=False)
    items = [write_item(writer, TAG, "model", {"w": torch.full((4,), 5.0)}, rank=0)]
    with contextlib.ExitStack() as reading:

        def commit_and_read(n: int) -> None:
            if n == 1:  # the deleter has listed the folder
                commit_rank(writer, TAG, rank=0, world_size=1, items=items, created_at="t")
                assert reading.enter_context(read_lease(writer, TAG))

        assert delete_checkpoint(HookedStore(url, after_list=commit_and_read), TAG) is False
        assert read_committed(writer, TAG) is not None  # manifest and item, whole
        # The deleter left no claim of its own: only the reader's lease and the rank marker.
        hidden = sorted(p.name for p in (tmp_path / "root" / TAG).iterdir() if p.name[0] == ".")
        assert [name.split("-")[0] for name in hidden] == [".lease", ".rank"], hidden
    assert delete_checkpoint(Store(url), TAG) is True


def test_a_reader_waits_out_a_deleter_that_backs_off(tmp_path: Path) -> None:
    """A deleter claims while a first reader holds a lease; a second reader that comes
    meanwhile sees the claim, waits, and reads once the deleter has backed off."""
    url = str(tmp_path / "root")
    commit(Store(url), TAG, 3.0)
    store = Store(url)
    with read_lease(store, TAG) as first, delete_claim(store, TAG) as readers:
        assert first and len(readers) == 1
        outcome: list[bool] = []

        def read() -> None:
            with read_lease(store, TAG) as readable:
                outcome.append(readable)

        second = threading.Thread(target=read)
        second.start()
        second.join(0.2)
        assert outcome == []  # still waiting: the claim is live
    second.join(30)
    assert outcome == [True]


# leases that do not count --------------------------------------------------------------------
def test_a_dead_readers_lease_does_not_block_and_is_cleaned(tmp_path: Path) -> None:
    store = Store(tmp_path / "root")
    commit(store, TAG, 1.0)
    folder = tmp_path / "root" / TAG
    stale = lease_file(folder, "read", dead_pid(), this_host(), datetime.now(timezone.utc))
    assert live_leases(store, TAG) == []
    assert not stale.exists()  # cleaned by whoever listed it
    lease_file(folder, "read", dead_pid(), this_host(), datetime.now(timezone.utc))
    assert delete_checkpoint(store, TAG) is True
    assert not folder.exists()


def test_a_dead_deleters_claim_does_not_keep_readers_out(tmp_path: Path) -> None:
    store = Store(tmp_path / "root")
    commit(store, TAG, 1.0)
    folder = tmp_path / "root" / TAG
    claim = lease_file(folder, "delete", dead_pid(), this_host(), datetime.now(timezone.utc))
    with read_lease(store, TAG, wait_s=30) as readable:
        assert readable
    assert not claim.exists()


def test_another_hosts_lease_counts_until_its_ttl(tmp_path: Path) -> None:
    store = Store(tmp_path / "root")
    commit(store, TAG, 1.0)
    folder = tmp_path / "root" / TAG
    now = datetime.now(timezone.utc)
    old = lease_file(folder, "read", 1, "other-node", now - timedelta(seconds=LEASE_TTL_S + 60))
    fresh = lease_file(folder, "read", 1, "other-node", now - timedelta(seconds=60))
    assert [lease.describe() for lease in live_leases(store, TAG)] == ["pid 1 on other-node"]
    assert not old.exists()
    assert delete_checkpoint(store, TAG) is False
    fresh.unlink()
    assert delete_checkpoint(store, TAG) is True


@pytest.mark.parametrize(
    ("kind", "ahead_s", "counts"),
    [
        ("read", 60.0, True),  # a clock a minute ahead: as old as a minute, within the TTL
        ("read", LEASE_TTL_S + 60, False),  # further ahead than the TTL: as old, so stale
        ("read", 100 * 365 * 86400.0, False),  # forged a century ahead: not fresh for ever
        ("hold", 30.0, True),
        ("hold", HOLD_TTL_S + 5, False),  # a handle's hold, with its own TTL
    ],
)
def test_a_lease_dated_in_the_future_counts_as_old_as_it_is_ahead(
    tmp_path: Path, kind: str, ahead_s: float, counts: bool
) -> None:
    # Catches: a lease's age taken without abs() (protocol/leases.py lease_alive): a lease
    # from a clock that runs ahead, or a forged name, had a negative age and kept the tag
    # from every deleter for ever.
    store = Store(tmp_path / "root")
    commit(store, TAG, 1.0)
    folder = tmp_path / "root" / TAG
    ahead = datetime.now(timezone.utc) + timedelta(seconds=ahead_s)
    lease = lease_file(folder, kind, 1, "other-node", ahead)
    assert [x.describe() for x in live_leases(store, TAG)] == (
        ["pid 1 on other-node"] if counts else []
    )
    assert lease.exists() is counts  # one that does not count is removed by whoever lists it
    assert delete_checkpoint(store, TAG) is not counts


def test_a_store_that_refuses_the_lease_is_read_without_one(tmp_path: Path) -> None:
    """A full disk (or a read-only root) must not keep the last checkpoint from loading."""
    url = str(tmp_path / "root")
    commit(Store(url), TAG, 5.0)

    class FullStore(Store):
        def write_bytes(self, parts: tuple[str, ...], data: bytes, **_: object) -> None:
            raise nm.StorageFullError(28, f"{parts[-1]}: storage is full")

    handle = Checkpoint._committed_handle(TAG, TierSet(memory=FullStore(url), persistent=None))
    assert torch.equal(handle.load("model")["w"], torch.full((4,), 5.0))


@pytest.mark.parametrize(
    "name",
    [
        ".lease-read-20250101T000000000000Z-12-abcd-node.jsn",
        ".lease-write-20250101T000000000000Z-12-abcd-node.json",
        ".lease-read-2025-12-abcd-node.json",
        ".lease-read-20250101T000000000000Z-x1-abcd-node.json",
        ".lease-read-20250101T000000000000Z-12-abcd-.json",
        ".writer-0.json",
    ],
)
def test_names_that_are_not_leases(name: str) -> None:
    assert parse_lease(name) is None


def test_a_lease_name_says_who_and_when() -> None:
    lease = parse_lease(".lease-delete-20250102T030405000006Z-4242-ab12cd34-node-7.a.json")
    assert lease is not None
    assert (lease.kind, lease.pid, lease.host) == ("delete", 4242, "node-7.a")
    assert lease.taken_at == datetime(2025, 1, 2, 3, 4, 5, 6, tzinfo=timezone.utc)


def test_a_zombie_is_not_a_live_process() -> None:
    """Found by the elastic campaign: a SIGKILLed rank torchrun had not reaped yet still
    counted as the live writer of its tag, and the survivor's exit persist was refused
    ("being written by pid ...")."""
    import time as time_

    from nebulaml.protocol.leases import process_alive

    child = warm.Popen(["sleep", "0.05"])
    try:
        deadline = time_.monotonic() + 10
        while process_alive(child.pid):
            assert time_.monotonic() < deadline, "a zombie counted as alive"
            time_.sleep(0.02)
    finally:
        child.wait()
