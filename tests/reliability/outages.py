"""The outage campaign (issue #27): the persistent tier goes away while a job trains, again
and again, and the training loop never notices.

Each round starts a trainer (a child process that saves a small model after every step,
one step every 0.1 s, and journals each save once it returned, fsynced, with how long it
took and a digest of what it saved: the ground truth of what was acknowledged). While it
trains, the persistent tier goes away in one of three ways, at a random step, for a random
number of steps:

- `disk`:    the root is on a small tmpfs, filled to its last byte, then freed;
- `stopped`: the root is on Azurite, stopped cleanly (its data survives), then started
             again on the same port;
- `hung`:    Azurite suspended with SIGSTOP (requests hang rather than fail), then resumed.

Once the trainer's steps are done and the tier is back, it calls `flush_persistence()`.

Invariants (any break is a failure):
- no save blocks training for more than `BLOCK_S` ("training steps blocked > 1 s"), and
  none raises: the trainer runs every step and exits 0;
- no acknowledged checkpoint is lost: the flush succeeds, and the newest acknowledged
  checkpoint is committed on the persistent tier and loads with the digest journalled for
  it ("acknowledged checkpoints lost").

Not for: the single scenarios with their exact assertions (tests/core/test_outage.py,
tests/azure/test_azure_outage.py).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import torch
import warm
from campaigns import Figures

import nebulaml as nm

BLOCK_S = 1.0  # a save that takes longer blocked training
KINDS = ("disk", "stopped", "hung")
DISK_MB = 24

TRAINER = """
import hashlib, json, os, sys, time, torch
import nebulaml as nm

root, journal, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
torch.manual_seed(0)
model = torch.nn.Linear(256, 256)  # 257 KiB of state
nm.init(root, persistent_time_interval=0, num_of_version_in_retention=2, exit_timeout_s=120)
with open(journal, "a") as out:
    for step in range(1, steps + 1):
        with torch.no_grad():
            model.weight.add_(0.01)
        t0 = time.perf_counter()
        nm.Checkpoint(f"global_step{step}").save("model", model.state_dict())
        took = time.perf_counter() - t0
        digest = hashlib.sha256(model.weight.detach().numpy().tobytes()).hexdigest()[:16]
        out.write(json.dumps({"step": step, "took": took, "digest": digest}) + "\\n")
        out.flush()
        os.fsync(out.fileno())
        time.sleep(0.1)
print("SAVED", flush=True)
if sys.stdin.readline().strip() != "flush":
    sys.exit(2)
print("FLUSHED", nm.flush_persistence(timeout_s=120, raise_on_error=False), flush=True)
nm.shutdown(timeout_s=120)
"""


def _journal(path: Path) -> list[dict[str, object]]:
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in lines if line.endswith("}")]


def _wait_for(what: str, check: object, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} within {timeout_s} s")
        time.sleep(0.02)


class _Disk:
    """A small tmpfs whose last byte can be taken and given back."""

    def __init__(self, where: Path) -> None:
        self.where = where
        where.mkdir(parents=True, exist_ok=True)
        mount = ["mount", "-t", "tmpfs", "-o", f"size={DISK_MB << 20}", "tmpfs", str(where)]
        done = warm.run(mount, capture_output=True, text=True, check=False)
        self.mounted = done.returncode == 0
        self.why = done.stderr.strip()
        self.filler = where / "filler"

    def down(self) -> None:
        """Take every free byte. The trainer writes meanwhile: the disk may fill before
        the filler has what was free when it looked (ENOSPC: full, as wanted)."""
        st = os.statvfs(self.where)
        with open(self.filler, "wb", buffering=0) as f:  # nothing left to flush at close
            try:
                f.write(b"\0" * (st.f_bavail * st.f_frsize))
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise

    def up(self) -> None:
        self.filler.unlink(missing_ok=True)

    def close(self) -> None:
        if self.mounted:
            warm.run(["umount", "-l", str(self.where)], check=False)


class _Store:
    """An Azurite of the campaign's own, with a container for its rounds."""

    def __init__(self, where: Path) -> None:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from azurite import Azurite, binary

        self.server = Azurite(where / "azurite", log_path=where / "azurite.log")
        self.usable = binary() is not None
        if self.usable:
            self.server.start()
            self.server.create_container("outages")

    def env(self) -> dict[str, str]:
        return {
            "AZURE_STORAGE_CONNECTION_STRING": self.server.connection_string,
            "NEBULA_STORAGE_RETRIES": "3",
            "NEBULA_STORAGE_RETRY_BASE_S": "0.05",
            "NEBULA_STORAGE_RETRY_MAX_S": "0.2",
        }

    def down(self, kind: str) -> None:
        proc = self.server.proc
        assert proc is not None
        if kind == "stopped":
            self.server.stop()
        else:
            os.killpg(proc.pid, signal.SIGSTOP)

    def up(self, kind: str) -> None:
        if kind == "stopped":
            self.server.restart()
        elif self.server.proc is not None:
            os.killpg(self.server.proc.pid, signal.SIGCONT)

    def close(self) -> None:
        if self.usable:
            with contextlib.suppress(Exception):
                self.up("hung")
            self.server.stop()


@contextlib.contextmanager
def _tiers(work: Path) -> Iterator[tuple[_Disk, _Store]]:
    disk, store = _Disk(work / "disk"), _Store(work)
    try:
        yield disk, store
    finally:
        disk.close()
        store.close()


def outage_campaign(work: Path, rounds: int = 30, seed: int = 27, steps: int = 30) -> Figures:
    """`rounds` training runs, each with one outage of a random kind (`KINDS`, in turn)."""
    figures = Figures("outages")
    rng = random.Random(seed)
    work.mkdir(parents=True, exist_ok=True)
    with _tiers(work) as (disk, store):
        for n in range(rounds):
            kind = KINDS[n % len(KINDS)]
            if kind == "disk" and not disk.mounted:
                figures.add("rounds skipped (no tmpfs)")
                continue
            if kind != "disk" and not store.usable:
                figures.add("rounds skipped (no Azurite)")
                continue
            _round(work / f"round{n}", kind, disk, store, rng, steps, figures)
    for key in ("acknowledged checkpoints lost", "training steps blocked > 1 s"):
        figures.counts.setdefault(key, 0)
    return figures


def _round(
    work: Path, kind: str, disk: _Disk, store: _Store, rng: random.Random, steps: int,
    figures: Figures,
) -> None:  # fmt: skip
    work.mkdir(parents=True)
    journal = work / "journal.jsonl"
    name = uuid.uuid4().hex[:10]
    env = {k: v for k, v in os.environ.items() if not k.startswith("NEBULA_")}
    env["NEBULA_MEMORY_TIER_PATH"] = str(work / "memory-tier")
    if kind == "disk":
        root = str(disk.where / name)
    else:
        root = f"az://outages/{name}"
        env.update(store.env())
    begin = rng.randint(3, steps // 3)
    end = min(steps - 2, begin + rng.randint(5, steps // 2))
    child = warm.Popen(
        [sys.executable, "-c", TRAINER, root, str(journal), str(steps)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    try:
        _wait_for(f"save {begin}", lambda: len(_journal(journal)) >= begin)
        disk.down() if kind == "disk" else store.down(kind)
        try:
            _wait_for(f"save {end}", lambda: len(_journal(journal)) >= end or child.poll())
        finally:
            disk.up() if kind == "disk" else store.up(kind)
        figures.add(f"outages: {kind}")
        assert child.stdin is not None
        out, err = child.communicate("flush\n", timeout=300)
    except BaseException:
        child.kill()
        child.communicate()
        raise
    saves = _journal(journal)
    figures.add("rounds")
    figures.add("saves", len(saves))
    figures.add("saves during outages", max(0, min(len(saves), end) - begin))
    blocked = [s for s in saves if float(s["took"]) > BLOCK_S]  # type: ignore[arg-type]
    figures.add("training steps blocked > 1 s", len(blocked))
    for key, part in (("slowest save (s)", saves), ("slowest save in an outage (s)",
                                                     saves[begin:end])):  # fmt: skip
        figures.counts[key] = max(
            [float(figures.counts.get(key, 0))] + [round(float(s["took"]), 3) for s in part]  # type: ignore[arg-type]
        )
    if child.returncode != 0 or len(saves) != steps or "FLUSHED True" not in out:
        figures.failures.append(
            f"{kind}: trainer exited {child.returncode} after {len(saves)} of {steps} saves; "
            f"{out[-300:]} {err[-1500:]}"
        )
    if blocked:
        figures.failures.append(f"{kind}: saves blocked training: {blocked}")
    _check_newest(root, saves, env, kind, figures)


def _check_newest(
    root: str, saves: list[dict[str, object]], env: dict[str, str], kind: str, figures: Figures
) -> None:
    """The newest acknowledged checkpoint is committed on the persistent tier and holds
    what the trainer journalled for it."""
    if not saves:
        return
    newest = saves[-1]
    tag = f"global_step{newest['step']}"
    figures.add("acknowledged checkpoints checked")
    with _environ(env):
        ckpt = nm.get_checkpoint(tag, root)
        tiers = [c["tiers"] for c in nm.list_checkpoints(root, hold=False) if c["tag"] == tag]
        state = ckpt.load("model") if ckpt is not None else None
    digest = None
    if state is not None:
        weight = state["weight"]
        assert isinstance(weight, torch.Tensor)
        digest = hashlib.sha256(weight.numpy().tobytes()).hexdigest()[:16]
    if not tiers or "persistent" not in tiers[0] or digest != newest["digest"]:
        figures.add("acknowledged checkpoints lost")
        figures.failures.append(f"{kind}: {tag} not durable or not as saved: {tiers} {digest}")


@contextlib.contextmanager
def _environ(env: dict[str, str]) -> Iterator[None]:
    """The trainer's storage settings, for the reads of the check."""
    keys = [k for k in env if k.startswith(("AZURE_", "NEBULA_"))]
    before = {k: os.environ.get(k) for k in keys}
    os.environ.update({k: env[k] for k in keys})
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
