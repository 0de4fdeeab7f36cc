"""A restart on Azure lists each tier's commit index once, by name only (#47): the
names-only listing answers as the full one does, init's listing is handed to the job's
get_latest_checkpoint, and a commit of this process is never hidden by it."""

from __future__ import annotations

import uuid

import pytest
import torch
from azurite import Azurite

import nebulaml as nm
from nebulaml.format.names import INDEX_DIR
from nebulaml.protocol import commit_index
from nebulaml.storage.store import Store

CONTAINER = "nebula-tests"  # the session's Azurite's (conftest.py)


def _root(azurite: Azurite) -> tuple[str, dict[str, str]]:
    return (
        f"az://{CONTAINER}/restart-{uuid.uuid4().hex[:8]}",
        {"connection_string": azurite.connection_string},
    )


def test_the_names_only_listing_is_the_folders_files(azurite: Azurite) -> None:
    url, options = _root(azurite)
    store = Store(url, options)
    for name in ("b", "a", "c"):
        store.write_bytes(("folder", name), b"x" * len(name))
    store.write_bytes(("folder", "sub", "deeper"), b"y")  # a file of a subfolder: not listed
    names = sorted(store.list_file_names("folder"))
    assert names == sorted(store.list_files("folder")) == ["a", "b", "c"]
    assert store.list_file_names("missing") == []


def test_init_lists_once_and_latest_lists_again(
    azurite: Azurite, monkeypatch: pytest.MonkeyPatch
) -> None:
    url, options = _root(azurite)
    nm.init(url, storage_options=options, persistent_time_interval=0)
    for step in (1, 2):
        nm.Checkpoint(f"global_step{step}").save("m", {"w": torch.tensor([step])})
    nm.flush_persistence()
    nm.shutdown()
    listed: list[str] = []
    names = Store.list_file_names

    def counting(self: Store, *parts: str) -> list[str]:
        if not self.is_local and parts == (INDEX_DIR,):
            listed.append(self.url)
        return names(self, *parts)

    commit_index._listings.clear()
    monkeypatch.setattr(Store, "list_file_names", counting)
    try:
        nm.init(url, storage_options=options, persistent_time_interval=0)
        latest = nm.get_latest_checkpoint()
        assert latest is not None and latest.tag == "global_step2"
        latest.release()
        # Init's questions share one listing; get_latest_checkpoint lists again: another
        # rank may have committed meanwhile (a peer recovery's checkpoint, committed by
        # the lowest rank during init, was missed by a listing handed on from init).
        assert len(listed) == 2, listed
        # This process's own commit drops what it listed: the next question lists again.
        nm.Checkpoint("global_step3").save("m", {"w": torch.tensor([3])})
        nm.flush_persistence()
        latest = nm.get_latest_checkpoint()
        assert latest is not None and latest.tag == "global_step3"
        assert torch.equal(latest.load("m")["w"], torch.tensor([3]))
        latest.release()
    finally:
        nm.shutdown()
