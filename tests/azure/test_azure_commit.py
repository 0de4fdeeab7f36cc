"""The object-store commit protocol on Azure, seen from the wire.

Items first, then `manifest.json` created only if absent; deletion removes the manifest
first; two writers racing for one tag: exactly one commits, the other is told so.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
import torch
import warm
from azurite import Azurite
from faultproxy import FaultProxy

import nebulaml as nm
from nebulaml.protocol.catalog import list_committed
from nebulaml.protocol.commit import begin_tag, commit_rank, write_item
from nebulaml.protocol.delete import delete_checkpoint
from nebulaml.storage.store import Store

RACER = """
import json, sys, time
from nebulaml.storage.store import Store
import nebulaml as nm
url, options, who, start_at = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3], float(sys.argv[4])
store = Store(url, options)
store.exists("global_step7")  # connected before the start line
time.sleep(max(0.0, start_at - time.time()))
try:
    store.publish(("global_step7", "manifest.json"), json.dumps({"writer": who}).encode())
    print("COMMITTED")
except nm.CommitConflictError as exc:
    print("CONFLICT", exc)
"""


@pytest.fixture
def proxy(azure_env: Azurite) -> Iterator[FaultProxy]:
    server = FaultProxy(azure_env.port)
    yield server
    server.close()


def _through(proxy: FaultProxy) -> dict[str, object]:
    return {
        "connection_string": proxy.connection_string,
        "nebula_block_bytes": 64 << 10,
    }


def test_two_processes_racing_for_a_tag_one_commits(az_url: str, azure_env: Azurite) -> None:
    # Catches: a manifest written with overwrite (both "commit", the last one wins
    # silently), or a check-then-write create that lets both through.
    options = {"connection_string": azure_env.connection_string}
    Store(az_url, options).make_dir()
    start_at = time.time() + 3.0  # both are connected and waiting by then
    racers = [
        warm.Popen(
            [sys.executable, "-c", RACER, az_url, json.dumps(options), who, str(start_at)],
            stdout=subprocess.PIPE,
            text=True,
        )
        for who in ("a", "b")
    ]
    outputs = [r.communicate(timeout=120)[0].strip() for r in racers]
    assert all(r.returncode == 0 for r in racers), outputs
    assert sorted(o.split()[0] for o in outputs) == ["COMMITTED", "CONFLICT"], outputs
    loser = next(o for o in outputs if o.startswith("CONFLICT"))
    assert f"{az_url}: checkpoint 'global_step7' was committed by another writer first" in loser
    winner = "a" if outputs[0].startswith("COMMITTED") else "b"
    assert json.loads(Store(az_url, options).read_bytes("global_step7", "manifest.json")) == {
        "writer": winner
    }


def test_items_go_up_first_and_the_manifest_last_created_only_if_absent(
    az_url: str, proxy: FaultProxy
) -> None:
    # Catches: the manifest uploaded before (or while) the items are, so that a reader
    # between the two sees a committed checkpoint whose items are missing or partial;
    # and a manifest upload that may overwrite.
    nm.init(az_url, persistent_time_interval=3600, storage_options=_through(proxy))
    nm.Checkpoint("global_step1").save("model", {"w": torch.ones(100_000)})
    proxy.clear()
    nm.flush_persistence()
    puts = [path for method, path, _ in proxy.outcomes() if method == "PUT"]
    manifest = [i for i, p in enumerate(puts) if p.split("?")[0].endswith("/manifest.json")]
    items = [i for i, p in enumerate(puts) if "/global_step1/model" in p]
    assert len(manifest) == 1 and len(items) > 2  # blocks, then the block list
    assert max(items) < manifest[0]
    assert "comp=blocklist" in puts[max(items)]
    with pytest.raises(nm.CommitConflictError):  # the service refuses a second manifest
        Store(az_url, _through(proxy)).publish(("global_step1", "manifest.json"), b"{}")


def test_deletion_removes_the_manifest_first(az_url: str, proxy: FaultProxy) -> None:
    # Catches: items deleted before the manifest: a reader in between would see a
    # "committed" checkpoint with items missing.
    store = Store(az_url, _through(proxy))
    nm.init(az_url, persistent_time_interval=3600, storage_options=_through(proxy))
    nm.Checkpoint("global_step1").save("model", {"w": torch.ones(1000)})
    nm.flush_persistence()
    nm.shutdown()
    proxy.clear()
    delete_checkpoint(store, "global_step1")
    deletes = [path for method, path, _ in proxy.outcomes() if method == "DELETE"]
    assert deletes and deletes[0].split("?")[0].endswith("/global_step1/manifest.json")
    assert store.list_files("global_step1") == {}
    assert nm.list_checkpoints(az_url) == [] or all(
        "persistent" not in c["tiers"] for c in nm.list_checkpoints(az_url)
    )


def test_listing_a_root_costs_a_request_per_page_not_per_checkpoint(
    az_url: str, proxy: FaultProxy
) -> None:
    # Catches: a listing that asks the service for each tag folder in turn (a 1,000-tag
    # root took 17 s to list and nm.init 69 s), and a listing that reads a manifest
    # again although the root's listing says it has not changed.
    store = Store(az_url, _through(proxy))
    tags = [f"global_step{n}" for n in range(1, 31)]
    for tag in tags:
        begin_tag(store, tag, rank=0, overwrite=False)
        items = [write_item(store, tag, "model", {"w": torch.ones(2)}, rank=0)]
        commit_rank(store, tag, rank=0, world_size=1, items=items, created_at="t")

    def requests() -> tuple[int, int]:
        log = [(m, p) for m, p, _ in proxy.outcomes() if m == "GET"]
        lists = sum(1 for _, p in log if "comp=list" in p)
        return lists, len(log) - lists

    first = list_committed(store)
    proxy.clear()
    again = list_committed(store)
    assert [i.tag for i in again] == [i.tag for i in first] == tags
    lists, reads = requests()
    assert lists <= 2 and reads == 0, proxy.outcomes()
