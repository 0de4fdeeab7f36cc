"""The shipped backend contract (`nebulaml.testing`) run against the gs:// backend on a real
gcp-storage-emulator (tests/gcsserver.py), for what the emulator implements.

The emulator ignores preconditions: an upload with `ifGenerationMatch=0` replaces an
object as a plain one does. The contract's two create-only checks therefore fail there,
and this module records that rather than pretending to test create-only: each runs the
check, expects the failure the emulator causes, and shows from the server's log that the
backend did send the condition (test_gcs.py checks the request without a server, and that
init refuses such a root unless it runs in single-writer mode). Should the emulator one
day honour the condition, these tests fail, and the contract's checks can come back.
"""

from __future__ import annotations

import uuid
from typing import Any

import gcsserver
import pytest

from nebulaml.storage.gcs import GCSBackend
from nebulaml.storage.store import Store
from nebulaml.testing import (
    BackendContract,
    check_create_only_publish,
    check_racing_publishers,
)


class TestGCSContract(BackendContract):
    @pytest.fixture(autouse=True)
    def _server(self, gcs_server: gcsserver.GCSEmulator) -> None:
        self.server = gcs_server
        self.storage_options: dict[str, Any] = gcs_server.options()

    def new_root(self) -> str:
        return f"gs://nebula-tests/contract-{uuid.uuid4().hex[:12]}"

    def _creates(self, since: int, store: Store) -> list[str]:
        """The uploads to `store`'s root the server logged after byte `since`."""
        key = store.url.split("/", 3)[3]
        return [r for r in self.server.requests(since)
                if r.startswith("POST /upload/") and f"name={key}/" in r]  # fmt: skip

    def test_create_only_publish(self) -> None:
        # The emulator's limit, recorded: the second create-only publish of one name goes
        # through (on GCS the server refuses it with 412), although it carried the
        # condition.
        store = self.open()
        since = self.server.log_size()
        with pytest.raises(AssertionError, match="a second create-only publish"):
            check_create_only_publish(store)
        creates = self._creates(since, store)
        assert len(creates) == 2, creates
        assert all("ifGenerationMatch=0" in r for r in creates), creates

    def test_racing_publishers(self) -> None:
        # The same limit with four writers at once: all four "win" on the emulator.
        store = self.open()
        since = self.server.log_size()
        with pytest.raises(AssertionError, match="4 of 4 racing create-only publishes won"):
            check_racing_publishers(store)
        creates = self._creates(since, store)
        assert len(creates) == 4 and all("ifGenerationMatch=0" in r for r in creates), creates

    def test_gcs_declares_what_it_does(self) -> None:
        caps = Store(self.new_root(), self.storage_options).capabilities
        assert caps.atomic_create and caps.object_appends
        assert not (caps.range_copy or caps.clones or caps.local_path)

    def test_gs_and_gcs_name_one_root(self) -> None:
        # Catches: gcs:// left to fsspec's fallback (gcsfs's `xb`, its listing cache), or
        # the two spellings taken for two roots (each probed, held, listed apart).
        name = f"contract-{uuid.uuid4().hex[:12]}"
        gs = Store(f"gs://nebula-tests/{name}", self.storage_options)
        gcs = Store(f"gcs://nebula-tests/{name}", self.storage_options)
        assert isinstance(gs._backend, GCSBackend) and isinstance(gcs._backend, GCSBackend)
        assert gs.location == gcs.location and gs.url == gcs.url == f"gs://nebula-tests/{name}"
        gs.write_bytes(("t", "a"), b"12")
        assert gcs.list_files("t") == {"a": 2}
