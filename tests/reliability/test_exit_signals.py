"""Exit with a persist pending: normal exit, an exception, SIGTERM and SIGINT.

The checkpoint the interval held back is persisted, or the process says it was not and
exits non-zero (tests/core/test_exit.py covers the second half). Never silence.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import warm

import nebulaml as nm

CHILD = """
import gc, sys, time, torch, nebulaml as nm
root, how = sys.argv[1], sys.argv[2]
numel = int(sys.argv[3]) if len(sys.argv) > 3 else 1000
nm.init(root, persistent_time_interval=3600)
nm.Checkpoint("global_step1").save("model", {"w": torch.full((1000,), 1.0)})
nm.flush_persistence()
nm.Checkpoint("global_step2").save("model", {"w": torch.full((numel,), 2.0)})  # held back
gc.collect()  # a KeyboardInterrupt raised in a collector's callback would be lost
print("READY", flush=True)
if how == "raise":
    raise RuntimeError("training crashed with an exception")
if how in ("sigterm", "sigint"):
    for _ in range(1200):  # the parent signals us here (handled within 0.1 s, as in
        time.sleep(0.1)  # a training loop, even if another thread took the signal)
"""

CASES = [
    ("return", None, 0),
    ("raise", None, 1),
    ("sigterm", signal.SIGTERM, 128 + signal.SIGTERM),
    ("sigint", signal.SIGINT, -signal.SIGINT),  # CPython re-raises an uncaught SIGINT
]


@pytest.mark.slow
@pytest.mark.parametrize(("how", "signum", "status"), CASES, ids=[c[0] for c in CASES])
def test_pending_checkpoint_is_persisted_on_every_kind_of_exit(
    tmp_path: Path, memory_tier: Path, how: str, signum: int | None, status: int
) -> None:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    root = tmp_path / "root"
    env = dict(os.environ, NEBULA_MEMORY_TIER_PATH=str(memory_tier), PYTHONUNBUFFERED="1")
    proc = warm.Popen(
        [sys.executable, str(script), str(root), how],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 60
        line = proc.stdout.readline()
        assert line.strip() == "READY" or time.monotonic() > deadline, line
        if signum is not None:
            proc.send_signal(signum)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == status, err
    assert (root / "global_step2" / "manifest.json").exists(), err
    loaded = torch.load(root / "global_step2" / "model", weights_only=True)
    assert torch.equal(loaded["w"], torch.full((1000,), 2.0))
    latest = nm.get_latest_checkpoint(str(root))
    assert latest is not None and latest.tag == "global_step2"


def test_an_application_sigterm_handler_is_left_alone(tmp_path: Path, memory_tier: Path) -> None:
    script = tmp_path / "child.py"
    script.write_text(
        "import signal, sys, nebulaml as nm\n"
        "handler = lambda *a: None\n"
        "signal.signal(signal.SIGTERM, handler)\n"
        "nm.init(sys.argv[1])\n"
        "print(signal.getsignal(signal.SIGTERM) is handler)\n"
    )
    env = dict(os.environ, NEBULA_MEMORY_TIER_PATH=str(memory_tier))
    out = warm.run([sys.executable, str(script), str(tmp_path / "root")], env=env,
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.returncode == 0 and out.stdout.strip() == "True", out.stderr


@pytest.mark.slow
@pytest.mark.parametrize("second", [signal.SIGTERM, signal.SIGINT], ids=["term", "int"])
def test_a_second_signal_during_the_exit_persist_does_not_lose_the_checkpoint(
    tmp_path: Path, memory_tier: Path, second: int
) -> None:
    # torchrun and Kubernetes signal again while the first SIGTERM's exit persists: the
    # persist (128 MiB to the local disk) goes on, and the status is still 143.
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    root = tmp_path / "root"
    numel = 32 << 20
    env = dict(os.environ, NEBULA_MEMORY_TIER_PATH=str(memory_tier), PYTHONUNBUFFERED="1")
    proc = warm.Popen(
        [sys.executable, str(script), str(root), "sigterm", str(numel)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "READY"
        proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 60
        while not (root / "global_step2").exists() and proc.poll() is None:
            assert time.monotonic() < deadline, "the exit persist never started"
            time.sleep(0.002)
        proc.send_signal(second)  # the persist is under way (or just done)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "not persisted" not in err, err
    loaded = torch.load(root / "global_step2" / "model", weights_only=True)
    assert torch.equal(loaded["w"], torch.full((numel,), 2.0))
    latest = nm.get_latest_checkpoint(str(root))
    assert latest is not None and latest.tag == "global_step2"
