"""Progress of a copy to Azure tracks bytes at the service (issue #21). Before, a block
counted as copied when it was handed to the uploader: `nebula copy` to az:// reached
192.0 of 200.8 MiB within 0.3 s, then sat for seconds while the upload happened.

Each progress report is checked against the blocks Azurite holds at that moment: a
report never says more than the service has.
"""

from __future__ import annotations

from pathlib import Path

import torch
from azurite import Azurite

import nebulaml as nm
from nebulaml.format.names import MANIFEST_NAME

BLOCK = 256 << 10
ITEM_BYTES = 4 << 20


def test_copy_progress_never_counts_bytes_the_service_does_not_have(
    azure_env: Azurite, az_url: str, tmp_path: Path
) -> None:
    from azure.core.exceptions import ResourceNotFoundError
    from azure.storage.blob import ContainerClient

    local = tmp_path / "local"
    nm.init(str(local), persistent_time_interval=0)
    nm.Checkpoint("global_step1").save("model", {"w": torch.randn(ITEM_BYTES // 4)})
    nm.flush_persistence()
    nm.shutdown()
    (item,) = [p.name for p in (local / "global_step1").iterdir()
               if p.name != MANIFEST_NAME and not p.name.startswith(".")]  # fmt: skip
    container, prefix = az_url.removeprefix("az://").split("/", 1)
    blob = ContainerClient.from_connection_string(
        azure_env.connection_string, container
    ).get_blob_client(f"{prefix}/global_step1/{item}")

    def at_the_service() -> int:
        try:
            committed, uncommitted = blob.get_block_list("all")
        except ResourceNotFoundError:
            return 0
        return sum(block.size for block in [*committed, *uncommitted])

    reports: list[tuple[int, int, int]] = []

    def progress(done: int, total: int) -> None:
        reports.append((done, total, at_the_service()))

    with nm.using_storage_options({"nebula_block_bytes": BLOCK}):
        report = nm.copy_checkpoint(str(local), "global_step1", az_url, progress=progress)
    assert report["copied_items"] == ["model"]
    total = report["total_bytes"]
    over = [(done, there) for done, _t, there in reports if done > there]
    assert not over, f"progress ahead of the service (done, at the service): {over[:5]}"
    dones = [done for done, _t, _there in reports]
    assert dones == sorted(dones) and dones[-1] == total  # in order, to the end
    assert len({d for d in dones if 0 < d < total}) >= total // BLOCK - 1  # block by block
