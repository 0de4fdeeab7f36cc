"""The shipped backend contract (`nebulaml.testing`) run against every backend nebula
registers: a local disk, fsspec's memory:// (the fallback for a protocol nothing
registers), Azure (a real Azurite) and S3 (a real moto server). The plugin registered
through the entry point runs it too (tests/plugins/test_plugin_backend.py)."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import fsspec
import pytest
import s3server

from nebulaml.storage.store import Store
from nebulaml.testing import BackendContract, check_create_only_publish


class TestLocalContract(BackendContract):
    @pytest.fixture(autouse=True)
    def _folder(self, tmp_path: Path) -> None:
        self.base = tmp_path

    def new_root(self) -> str:
        return str(self.base / uuid.uuid4().hex[:8])


class TestFsspecMemoryContract(BackendContract):
    def new_root(self) -> str:
        return f"memory://contract-{uuid.uuid4().hex[:12]}/root"

    def remove_root(self, url: str) -> None:
        fs = fsspec.filesystem("memory")
        path = url.split("://", 1)[1].split("/", 1)[0]
        if fs.exists(f"/{path}"):
            fs.rm(f"/{path}", recursive=True)


@pytest.mark.usefixtures("azure_env")
class TestAzureContract(BackendContract):
    def new_root(self) -> str:
        return f"az://nebula-tests/contract-{uuid.uuid4().hex[:12]}"


class TestS3Contract(BackendContract):
    @pytest.fixture(autouse=True)
    def _server(self, s3_server: s3server.MotoServer) -> None:
        self.storage_options: dict[str, Any] = s3_server.options()

    def new_root(self) -> str:
        return f"s3://nebula-tests/contract-{uuid.uuid4().hex[:12]}"

    def test_the_server_refuses_a_second_create_itself(self) -> None:
        # The create-only publish is the server's (If-None-Match: *), not a look first:
        # a PutObject of a taken name with the header is refused by moto with 412.
        import s3fs

        store = self.open()
        check_create_only_publish(store)
        fs = s3fs.S3FileSystem(skip_instance_cache=True, **self.storage_options)
        key = store.path("tag1", "manifest.json").split("/", 1)[1]
        with pytest.raises(FileExistsError):
            fs.call_s3("put_object", Bucket="nebula-tests", Key=key, Body=b"x", IfNoneMatch="*")

    def test_s3_declares_what_it_does(self) -> None:
        caps = Store(self.new_root(), self.storage_options).capabilities
        assert caps.atomic_create and caps.object_appends and caps.range_copy
        assert not (caps.clones or caps.local_path)
