"""Two storage accounts never share a memory tier (issue #16).

`az://ckpt/exp` on account A and on account B are two roots: a job on A that crashed leaves
its checkpoint in A's memory tier, and `nebula flush` with B's credentials must neither
see it nor write it into B. One real Azurite serves both accounts (AZURITE_ACCOUNTS).
"""

from __future__ import annotations

import base64
import os
import signal
import sys
from pathlib import Path

import pytest
import warm
from azurite import Azurite

import nebulaml as nm
from nebulaml.protocol.tiers import open_tiers

KEYS = {name: base64.b64encode(name.encode() * 8).decode() for name in ("accta", "acctb")}
URL = "az://ckpt/exp"
CRASHING_JOB = """
import os, signal, sys, torch, nebulaml as nm
nm.init(sys.argv[1], persistent_time_interval=3600)
nm.Checkpoint("global_step1").save("model", {"w": torch.ones(64)})
nm.flush_persistence()  # persisted; global_step2 is an hour away
nm.Checkpoint("global_step2").save("model", {"w": torch.full((64,), 2.0)})
nm.wait_for_snapshot()  # its lazy copy taken (the default): a crash keeps it
os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.fixture
def two_accounts(
    azurite: Azurite, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> dict[str, str]:
    """A second Azurite serving accounts accta and acctb: their connection strings."""
    monkeypatch.setenv("AZURITE_ACCOUNTS", ";".join(f"{n}:{k}" for n, k in KEYS.items()))
    server = Azurite(tmp_path / "data", log_path=tmp_path / "azurite.log").start()
    monkeypatch.delenv("AZURITE_ACCOUNTS")
    strings = {
        name: (
            f"DefaultEndpointsProtocol=http;AccountName={name};AccountKey={key};"
            f"BlobEndpoint=http://127.0.0.1:{server.port}/{name};"
        )
        for name, key in KEYS.items()
    }
    from azure.storage.blob import BlobServiceClient

    for cs in strings.values():
        with BlobServiceClient.from_connection_string(cs) as client:
            client.create_container("ckpt")
    for var in ("AZURE_STORAGE_CONNECTION_STRING", "AZURE_STORAGE_ACCOUNT_NAME",
                "AZURE_STORAGE_ACCOUNT_KEY", "AZURE_STORAGE_SAS_TOKEN"):  # fmt: skip
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("NEBULA_STORAGE_RETRIES", "1")
    monkeypatch.setenv("NEBULA_STORAGE_RETRY_BASE_S", "0.05")
    yield strings
    server.stop()


def blobs(connection_string: str) -> list[str]:
    from azure.storage.blob import BlobServiceClient

    with BlobServiceClient.from_connection_string(connection_string) as client:
        return [b.name for b in client.get_container_client("ckpt").list_blobs()]


@pytest.mark.slow
def test_two_accounts_never_share_a_memory_tier(
    two_accounts: dict[str, str], memory_tier: Path
) -> None:
    a, b = two_accounts["accta"], two_accounts["acctb"]
    tier_a = open_tiers(URL, {"connection_string": a}).memory.root
    tier_b = open_tiers(URL, {"connection_string": b}).memory.root
    assert tier_a != tier_b

    env = dict(os.environ, AZURE_STORAGE_CONNECTION_STRING=a,
               NEBULA_MEMORY_TIER_PATH=str(memory_tier))  # fmt: skip
    job = warm.run([sys.executable, "-c", CRASHING_JOB, URL], env=env,
                         capture_output=True, text=True, timeout=300, check=False)  # fmt: skip
    assert job.returncode == -signal.SIGKILL, job.stderr
    assert blobs(b) == []

    # B's credentials: B's root does not exist, and nothing of A's is written into it.
    with nm.using_storage_options({"connection_string": b}):
        with pytest.raises(nm.RootNotFoundError):
            nm.persist_memory_tier(URL)
        assert nm.list_checkpoints(URL) == []
    assert blobs(b) == []

    # A's credentials: A's crashed job's checkpoint is there to flush.
    with nm.using_storage_options({"connection_string": a}):
        assert nm.persist_memory_tier(URL) == ["global_step2"]
        loaded = nm.get_checkpoint("global_step2", URL).load("model")
    assert float(loaded["w"][0]) == 2.0
    assert blobs(b) == []
