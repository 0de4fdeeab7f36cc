"""Azurite SIGKILLed in the middle of a persist, and restarted on the same data and port.

The checkpoint being persisted ends committed and intact (the retries outlasted the
restart), or not committed at all; either way the previous checkpoint still loads and
the training process goes on and exits 0. The test prints which outcome it saw.
"""

from __future__ import annotations

import io
import os
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
from nebulaml.storage.store import Store

CHILD = Path(__file__).resolve().parent / "children" / "persist_child.py"
SIZE_MB = 64
KILL_AFTER_BYTES = 8 << 20  # of item blocks in Azurite's data folder
TIMEOUT_S = 120


def _folder_bytes(folder: Path) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(folder):
        for name in files:
            try:
                total += os.stat(os.path.join(dirpath, name)).st_size
            except FileNotFoundError:
                continue
    return total


def _wait(
    predicate: Callable[[], bool], what: str, timeout_s: float = TIMEOUT_S, poll_s: float = 0.02
) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(poll_s)
    raise TimeoutError(f"{what} did not happen within {timeout_s} s")


class _Lines:
    """The child's stdout, read line by line with a bounded wait."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc, self.seen = proc, []

    def expect(self, prefix: str) -> str:
        deadline = time.monotonic() + TIMEOUT_S
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline() if self.proc.stdout else ""
            if not line:
                raise AssertionError(f"child ended before {prefix!r}; saw {self.seen}")
            self.seen.append(line.rstrip("\n"))
            if line.startswith(prefix):
                return line.rstrip("\n")
        raise TimeoutError(f"no {prefix!r} from the child within {TIMEOUT_S} s")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_azurite_killed_mid_persist_and_restarted(
    azurite: Azurite, tmp_path: Path, memory_tier: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Catches: a persist that commits a manifest over items Azurite lost (a torn
    # checkpoint that ls would show), a retry loop that gives up before a restart or
    # never gives up, an error that kills the training process, and a previous checkpoint
    # damaged by the failed persist.
    # `azurite` (the session's server) only says Azurite is installed: this test kills
    # and restarts one of its own, on its own data folder.
    server = Azurite(tmp_path / "azurite", log_path=tmp_path / "azurite.log").start()
    container = "killtest"
    server.create_container(container)
    url = f"az://{container}/run"
    env = dict(os.environ, NEBULA_MEMORY_TIER_PATH=str(memory_tier), PYTHONUNBUFFERED="1")
    for var in ("AZURE_STORAGE_CONNECTION_STRING", "NEBULA_STORAGE_RETRIES"):
        env.pop(var, None)
    with open(tmp_path / "child.stderr", "w") as stderr:
        proc = warm.Popen(
            [sys.executable, str(CHILD), url, server.connection_string, str(SIZE_MB)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            env=env,
        )
    lines = _Lines(proc)
    try:
        lines.expect("COMMITTED global_step1")
        # Azurite keeps its index in memory and saves it every few seconds: wait until
        # the committed step 1 is on disk, or the kill would take it along (Azurite's
        # durability, not ours).
        db = tmp_path / "azurite" / "__azurite_db_blob__.json"
        _wait(lambda: db.exists() and b"global_step1/manifest.json" in db.read_bytes(),
              "Azurite saving its index", poll_s=0.1)  # fmt: skip
        blocks = tmp_path / "azurite" / "__blobstorage__"
        before = _folder_bytes(blocks)
        assert proc.stdin is not None
        proc.stdin.write("go\n")
        proc.stdin.flush()
        lines.expect("PERSISTING global_step2")
        _wait(lambda: _folder_bytes(blocks) - before >= KILL_AFTER_BYTES, "the upload")
        uploaded = _folder_bytes(blocks) - before
        server.kill()
        server.restart()
        outcome_line = lines.expect("PERSIST")
        lines.expect("TRAINING_CONTINUED")
        lines.expect("EXIT 0")
        assert proc.wait(timeout=TIMEOUT_S) == 0, (tmp_path / "child.stderr").read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()

    options = {"connection_string": server.connection_string}
    try:
        with nm.using_storage_options(options):
            persisted = {c["tag"] for c in nm.list_checkpoints(url) if "persistent" in c["tiers"]}
            assert "global_step1" in persisted
            step1 = nm.get_checkpoint("global_step1", persist_path=url)
            assert step1 is not None
            expected1 = torch.randn((1 << 20) // 4, generator=torch.Generator().manual_seed(1001))
            with step1:  # its hold released before Azurite goes
                assert torch.equal(step1.load("model")["w"], expected1)
            if "global_step2" in persisted:
                outcome = "committed and intact after retries"
                step2 = nm.get_checkpoint("global_step2", persist_path=url)
                assert step2 is not None
                step2.release()  # read below from the store itself
                # Read the persistent copy itself (the memory tier also holds one).
                data = Store(url).read_bytes("global_step2", "model")
                loaded = torch.load(io.BytesIO(data), weights_only=True)
                expected2 = torch.randn(
                    (SIZE_MB << 20) // 4, generator=torch.Generator().manual_seed(1002)
                )
                assert torch.equal(loaded["w"], expected2)
                # The flush saw it land; or it said the try failed (Azurite lost the
                # staged blocks: HTTP 400) and the exit's last try landed it.
                said_failed = outcome_line.startswith("PERSIST_ERROR")
                assert outcome_line.startswith("PERSISTED") or said_failed, lines.seen
                assert not any(x.startswith("SHUTDOWN_ERROR") for x in lines.seen), lines.seen
                if said_failed:
                    outcome = "committed and intact by the exit's retry after a failed flush"
            else:
                outcome = "not committed (the persist failed; the previous checkpoint loads)"
                assert outcome_line.startswith("PERSIST_ERROR")
                assert any(x.startswith("SHUTDOWN_ERROR") for x in lines.seen), lines.seen
                assert "global_step2" not in persisted
    finally:
        server.stop()
    with capsys.disabled():
        print(
            f"\nkill/restart: Azurite SIGKILLed after {uploaded / 1e6:.1f} MB of "
            f"{SIZE_MB} MiB were uploaded, restarted on port {server.port}: global_step2 "
            f"{outcome}; child said: {outcome_line[:300]}"
        )
