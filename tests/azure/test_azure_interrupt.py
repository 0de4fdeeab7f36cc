"""Ctrl-C against Azure (issue #18, case 8): `nebula copy` to an az:// root SIGINTed in
the middle of the upload, or of the verification read that follows it, exits 130 with at
most one line on stderr, `nebula: interrupted`. Before, the interpreter's shutdown
printed up to 510 lines of asyncio's reports of the abandoned requests ("Task exception
was never retrieved", "Unclosed connection", "Task was destroyed but it is pending").
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import warm
from azurite import Azurite

import nebulaml as nm

SIZE_MB = 128
TIMEOUT_S = 120
CLI = "import sys; from nebula_cli.app import main; sys.argv[0] = 'nebula'; main()"


@pytest.fixture
def local_root(tmp_path: Path) -> Path:
    """A local root whose global_step1 is one item of SIZE_MB."""
    root = tmp_path / "local"
    nm.init(str(root), persistent_time_interval=0)
    nm.Checkpoint("global_step1").save("model", {"w": torch.zeros(SIZE_MB << 18)})
    nm.flush_persistence()
    nm.shutdown()
    return root


def _wait(predicate: Callable[[], bool], what: str, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while not predicate():
        if proc.poll() is not None:
            pytest.fail(f"the copy ended before {what}: {proc.communicate()}")
        if time.monotonic() > deadline:
            pytest.fail(f"{what} did not happen within {TIMEOUT_S} s")
        time.sleep(0.01)


@pytest.mark.slow
@pytest.mark.parametrize("phase", ["upload", "verify"])
def test_ctrl_c_during_a_copy_to_azure_is_one_line_and_130(
    azure_env: Azurite, az_url: str, local_root: Path, memory_tier: Path, phase: str
) -> None:
    from azure.storage.blob import ContainerClient

    container, prefix = az_url.removeprefix("az://").split("/", 1)
    blobs = ContainerClient.from_connection_string(azure_env.connection_string, container)

    def exists(name: str) -> bool:
        return blobs.get_blob_client(f"{prefix}/global_step1/{name}").exists()

    env = dict(os.environ, NEBULA_MEMORY_TIER_PATH=str(memory_tier), PYTHONUNBUFFERED="1")
    proc = warm.Popen(
        [sys.executable, "-c", CLI, "copy", str(local_root), "global_step1", az_url, "--quiet"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        # The copy's writer marker comes first, then the item's blocks (committed whole when
        # the item is written), then the item is read back and verified, then the manifest.
        if phase == "upload":
            _wait(lambda: exists(".writer-0.json"), "the upload's start", proc)
            time.sleep(0.3)
            assert not exists("model"), "the upload was over before the interrupt"
        else:
            _wait(lambda: exists("model"), "the verification's start", proc)
            time.sleep(0.3)  # its reads in flight
        proc.send_signal(signal.SIGINT)
        _out, err = proc.communicate(timeout=TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()
    assert not exists("manifest.json"), "the copy finished before the interrupt"
    lines = err.decode(errors="replace").splitlines()
    assert proc.returncode == 130, lines[-20:]
    assert lines in ([], ["nebula: interrupted"]), f"{len(lines)} lines: {lines[:20]}"
