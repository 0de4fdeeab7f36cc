"""Reliability campaigns: each one attacks a real root and returns its figures.

Every campaign takes a size (how many trials) so that the same code runs a short tier in
`make test` and a full tier in `make reliability` (tests/reliability/run.py prints the
table). The invariants (nothing wrong is ever loaded silently, no code runs, no hang) are
asserted by the tests; the figures count what happened.

Not for: unit tests of single functions (tests/core).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

import nebulaml as nm
from nebulaml.format.checksum import checksum_of
from nebulaml.format.manifest import seal


@dataclass
class Figures:
    """One campaign's counts; `failures` lists what broke an invariant (must stay empty)."""

    name: str
    counts: dict[str, int | float] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)

    def add(self, key: str, n: int | float = 1) -> None:
        self.counts[key] = self.counts.get(key, 0) + n


def median_max(figures: Figures, what: str, values: list[float]) -> None:
    """`what`'s median and max (s) among `figures`' counts, when there are values."""
    if values:
        figures.counts[f"{what} median (s)"] = round(statistics.median(values), 2)
        figures.counts[f"{what} max (s)"] = round(max(values), 2)


def utc_clock(when: float) -> str:
    """The UTC time of day of `when` (time.time()), to the microsecond, as logs print it."""
    return datetime.fromtimestamp(when, timezone.utc).strftime("%H:%M:%S.%f")


def keep_failed(folder: Path, dst: Path, failures: list[str], notes: dict[str, list[str]]) -> None:
    """A failed job's `folder` copied to `dst` for diagnosis (links kept as links), with
    `failures.txt` and each of `notes` (a file name: its lines); a copy that fails is
    one failure more."""
    try:
        shutil.copytree(folder, dst, symlinks=True, dirs_exist_ok=True)
        (dst / "failures.txt").write_text("\n".join(failures) + "\n")
        for name, lines in notes.items():
            (dst / name).write_text("\n".join(lines) + "\n")
    except OSError as exc:
        failures.append(f"{dst.name}: could not keep its folder in {dst}: {exc}")


def _state(seed: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(64, 64, generator=gen),
        "b": torch.randn(64, generator=gen),
        "step": seed,
        "nested": {"m": [torch.randn(16, generator=gen)]},
    }


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    return a == b


# corruption --------------------------------------------------------------------------------
def _mutate(path: Path, rng: random.Random) -> str:
    data = bytearray(path.read_bytes())
    kind = rng.choice(["flip", "truncate", "zero"])
    if kind == "flip" or len(data) < 2:
        pos = rng.randrange(len(data))
        data[pos] ^= 1 << rng.randrange(8)
    elif kind == "truncate":
        data = data[: rng.randrange(len(data))]
    else:
        start = rng.randrange(len(data))
        length = rng.randint(1, max(1, min(4096, len(data) - start)))
        zeroed = bytes(length)
        if data[start : start + length] == zeroed:
            data[start] ^= 0xFF  # already zero there: make it a real change
        else:
            data[start : start + length] = zeroed
    path.write_bytes(bytes(data))
    return kind


def corruption_campaign(work: Path, trials: int, seed: int = 0) -> Figures:
    """Flip bits, truncate and zero ranges in items and manifests of either tier; then load
    every item and run verify. Wrong data must never load silently; a corrupted copy must
    be reported by verify; load must fall back to the intact tier's copy."""
    figures = Figures("corruption")
    rng = random.Random(seed)
    pristine_root, pristine_mem = work / "pristine-root", work / "pristine-mem"
    os.environ["NEBULA_MEMORY_TIER_PATH"] = str(pristine_mem)
    nm.init(str(pristine_root), persistent_time_interval=0, keep_memory_tier=True)
    ckpt = nm.Checkpoint("global_step7", 2)
    ckpt.save("model", _state(1))
    ckpt.save("optimizer", _state(2))
    nm.flush_persistence()
    nm.shutdown()
    expected = {"model": _state(1), "optimizer": _state(2)}
    pristine_tier = Path(nm.memory_tier_path(str(pristine_root)))
    trial_root, trial_mem = work / "root", work / "mem"
    os.environ["NEBULA_MEMORY_TIER_PATH"] = str(trial_mem)
    trial_tier = Path(nm.memory_tier_path(str(trial_root)))
    for trial in range(trials):
        for src, dst in ((pristine_root, trial_root), (pristine_tier, trial_tier)):
            shutil.rmtree(dst, ignore_errors=True)
            shutil.copytree(src, dst)
        files = sorted(
            p
            for base in (trial_root, trial_mem)
            for p in base.rglob("*")
            if p.is_file() and p.parent.name == "global_step7" and not p.name.startswith(".")
        )
        target = rng.choice(files)
        tier = "persistent" if trial_root in target.parents else "memory"
        kind = _mutate(target, rng)
        figures.add(f"{kind}s")
        figures.add("manifest mutations" if target.name == "manifest.json" else "item mutations")
        # Load every item: the intact tier's copy, or a typed error; never wrong data.
        handle = nm.get_checkpoint("global_step7", persist_path=str(trial_root))
        for name, want in expected.items():
            try:
                if handle is None:
                    raise nm.CheckpointNotFoundError(str(trial_root), "global_step7")
                got = handle.load(name)
            except nm.NebulaError:
                figures.add("loads refused")
                continue
            if _same(got, want):
                figures.add("loads correct")
            else:
                figures.failures.append(f"trial {trial}: {kind} of {target} loaded wrong data")
        # Verify must name the mutated copy.
        results = nm.verify_checkpoints(str(trial_root))
        bad = [r for r in results if r["status"] != "ok" and r["tier"] == tier]
        if bad:
            figures.add("detected by verify")
        else:
            figures.failures.append(f"trial {trial}: verify missed {kind} of {target}")
    figures.counts["trials"] = trials
    figures.counts["detected %"] = round(
        100.0 * figures.counts.get("detected by verify", 0) / max(1, trials), 2
    )
    os.environ.pop("NEBULA_MEMORY_TIER_PATH", None)
    return figures


# hostile input --------------------------------------------------------------------------------
def _payloads(canary: Path) -> list[tuple[str, Callable[[], Any]]]:
    """Objects whose unpickling would run code (each would touch the canary)."""
    import builtins
    import importlib
    import subprocess

    class _Reduce:
        def __init__(self, fn: Any, args: tuple[Any, ...]) -> None:
            self.fn, self.args = fn, args

        def __reduce__(self) -> tuple[Any, ...]:
            return (self.fn, self.args)

    touch = f"open({str(canary)!r}, 'w').close()"
    cmd = f"touch {canary}"
    return [
        ("os.system", lambda: _Reduce(os.system, (cmd,))),
        ("eval", lambda: _Reduce(builtins.eval, (touch,))),
        ("exec", lambda: _Reduce(builtins.exec, (touch,))),
        ("subprocess.call", lambda: _Reduce(subprocess.call, (["touch", str(canary)],))),
        ("subprocess.Popen", lambda: _Reduce(subprocess.Popen, (["touch", str(canary)],))),
        ("Path.touch", lambda: _Reduce(Path.touch, (canary,))),
        ("os.popen", lambda: _Reduce(os.popen, (cmd,))),
        ("builtins.open", lambda: _Reduce(builtins.open, (str(canary), "w"))),
        ("importlib.import_module", lambda: _Reduce(importlib.import_module, ("antigravity",))),
        (
            "nested in optimizer state",
            lambda: {"state": {0: {"exp_avg": _Reduce(os.system, (cmd,))}}},
        ),
        ("inside a list of tensors", lambda: [torch.ones(2), _Reduce(builtins.eval, (touch,))]),
        ("as a dict key", lambda: {_Reduce(os.system, (cmd,)): 1}),
    ]


def hostile_pickle_campaign(work: Path, protocols: tuple[int, ...] = (2, 4, 5)) -> Figures:
    """Malicious pickles inside real committed checkpoints: loading never runs them."""
    import io
    import pickle

    figures = Figures("hostile pickles")
    canary = work / "canary"
    os.environ["NEBULA_MEMORY_TIER_PATH"] = str(work / "mem")
    root = work / "root"
    nm.init(str(root), persistent_time_interval=0)
    for index, (label, make) in enumerate(_payloads(canary)):
        for protocol in protocols:
            tag = f"global_step{index * 10 + protocol}"
            nm.Checkpoint(tag).save("item", {"ok": torch.ones(1)})
            nm.flush_persistence()
            buf = io.BytesIO()
            torch.save(make(), buf, pickle_protocol=protocol)
            data = buf.getvalue()
            # Rewrite the committed item on both tiers, with a manifest that matches it:
            # the attacker controls the whole checkpoint, checksums included.
            for base in (root, Path(nm.memory_tier_path(str(root)))):
                folder = base / tag
                if not folder.exists():
                    continue
                (folder / "item").write_bytes(data)
                manifest = json.loads((folder / "manifest.json").read_text())
                manifest["items"][0]["size_bytes"] = len(data)
                manifest["items"][0]["checksum"]["value"] = checksum_of(data)
                manifest["total_bytes"] = len(data)
                (folder / "manifest.json").write_bytes(seal(manifest))
            figures.add("payloads")
            try:
                nm.get_checkpoint(tag).load("item")
            except nm.UnsafeCheckpointError:
                figures.add("refused (UnsafeCheckpointError)")
            except nm.NebulaError as exc:
                figures.failures.append(f"{label} p{protocol}: untyped refusal {exc!r}")
            except pickle.UnpicklingError as exc:
                figures.failures.append(f"{label} p{protocol}: raw UnpicklingError {exc}")
            else:
                figures.failures.append(f"{label} p{protocol}: loaded without error")
            try:
                nm.describe_item(str(root), tag, "item")
                figures.add("inspected without running")
            except nm.NebulaError:
                figures.add("inspect refused")
            time.sleep(0.01)  # a payload run by a child process would have touched it by now
            if canary.exists():
                figures.failures.append(f"{label} p{protocol}: the canary was touched")
                canary.unlink()
    nm.shutdown()
    figures.counts["executed"] = len([f for f in figures.failures if "canary" in f])
    os.environ.pop("NEBULA_MEMORY_TIER_PATH", None)
    return figures


# crash ------------------------------------------------------------------------------------
CRASH_CHILD = """
import hashlib, os, signal, sys, torch
import nebulaml as nm

root, journal, kill_at, kill_step = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
lazy = sys.argv[5] == "lazy"
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)


def digest():
    h = hashlib.sha256()
    for sd in (model.state_dict(), opt.state_dict()["state"]):
        for key in sorted(sd, key=str):
            value = sd[key]
            for t in (value.values() if isinstance(value, dict) else [value]):
                if isinstance(t, torch.Tensor):
                    h.update(t.detach().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def die(point):
    if kill_at == point and step >= kill_step:
        os.kill(os.getpid(), signal.SIGKILL)


def acknowledge(acked_step, acked_digest):
    with open(journal, "a") as f:  # the ground truth: written only once the commit is done
        f.write(f"{acked_step} {acked_digest}\\n")
        f.flush()
        os.fsync(f.fileno())


nm.init(root, persistent_time_interval=0.3, num_of_version_in_retention=2, lazy_snapshot=lazy)
latest = nm.get_latest_checkpoint()
step = 0
if latest is not None:
    model.load_state_dict(latest.load("model"))
    opt.load_state_dict(latest.load("optimizer"))
    step = int(latest.tag.removeprefix("global_step"))
print("READY", step, flush=True)
gen = torch.Generator().manual_seed(step)
pending = None  # lazy: the checkpoint whose copy overlaps this step's forward and backward
while True:
    step += 1
    x = torch.randn(32, 256, generator=gen)
    model(x).pow(2).mean().backward()
    if pending is not None:
        nm.wait_for_snapshot()  # copied and committed (optimizer.step() waits for the copy)
        acknowledge(*pending)
        die("after_journal")
    opt.step()
    opt.zero_grad()
    saved_digest = digest()
    ckpt = nm.Checkpoint(f"global_step{step}", -2)
    ckpt.save("model", model.state_dict())
    die("after_item")
    ckpt.save("optimizer", opt.state_dict())
    die("before_manifest")
    ckpt.commit()
    die("after_manifest")
    if lazy:
        pending = (step, saved_digest)
    else:
        acknowledge(step, saved_digest)
        die("after_journal")
"""

KILL_POINTS = ("random", "after_item", "before_manifest", "after_manifest", "after_journal")


def _digest_of(model_sd: dict[str, Any], opt_sd: dict[str, Any]) -> str:
    import hashlib

    h = hashlib.sha256()
    for sd in (model_sd, opt_sd["state"]):
        for key in sorted(sd, key=str):
            value = sd[key]
            for t in value.values() if isinstance(value, dict) else [value]:
                if isinstance(t, torch.Tensor):
                    h.update(t.detach().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def crash_campaign(work: Path, kills: int, seed: int = 0, *, lazy: bool = False) -> Figures:
    """SIGKILL a training child again and again, at random times and at named points; after
    each kill the newest acknowledged checkpoint (the child's fsynced journal) must still be
    there and load with the digest the journal recorded. With `lazy`, the child saves with
    `lazy_snapshot` and acknowledges a checkpoint after the next step's forward and
    backward, once `wait_for_snapshot()` says it is committed."""
    import subprocess
    import sys

    import warm

    figures = Figures("crash (lazy)" if lazy else "crash")
    rng = random.Random(seed)
    work.mkdir(parents=True, exist_ok=True)
    script, journal, root = work / "child.py", work / "journal.txt", work / "root"
    script.write_text(CRASH_CHILD)
    # The parent reads the same node's memory tier as the children.
    os.environ["NEBULA_MEMORY_TIER_PATH"] = str(work / "mem")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for kill in range(kills):
        point = KILL_POINTS[kill % len(KILL_POINTS)]
        proc = warm.Popen(
            [sys.executable, "-W", "ignore", str(script), str(root), str(journal), point,
             str(rng.randint(1, 3)), "lazy" if lazy else "sync"],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert proc.stdout is not None
        ready = proc.stdout.readline()
        if not ready.startswith("READY"):
            proc.kill()
            figures.failures.append(f"kill {kill}: child did not start: {proc.stderr.read()}")
            continue
        if point == "random":
            time.sleep(rng.uniform(0.05, 1.5))
            proc.kill()
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            figures.failures.append(f"kill {kill}: the child did not die at {point}")
            continue
        figures.add("kills")
        figures.add(f"kills {point}")
        acked = (
            [line.split() for line in journal.read_text().splitlines()] if journal.exists() else []
        )
        acked = [a for a in acked if len(a) == 2]
        latest = nm.get_latest_checkpoint(str(root))
        if not acked:
            continue
        last_step, last_digest = int(acked[-1][0]), acked[-1][1]
        if latest is None or int(latest.tag.removeprefix("global_step")) < last_step:
            figures.add("acknowledged checkpoints lost")
            figures.failures.append(f"kill {kill}: step {last_step} acknowledged, latest {latest}")
            continue
        try:
            model_sd, opt_sd = latest.load("model"), latest.load("optimizer")
        except nm.NebulaError as exc:
            figures.add("latest failed to load")
            figures.failures.append(f"kill {kill}: latest {latest.tag} failed to load: {exc}")
            continue
        if latest.tag == f"global_step{last_step}" and _digest_of(model_sd, opt_sd) != last_digest:
            figures.failures.append(f"kill {kill}: {latest.tag} loads other state than acked")
        figures.add("recoveries checked")
    # Recovery: one more start cleans up and persists; then nothing may be left half-made.
    nm.init(str(root), persistent_time_interval=0)
    nm.flush_persistence()
    nm.shutdown()
    leftovers = nm.list_incomplete(str(root))
    figures.counts["leftovers after recovery"] = len(leftovers)
    if leftovers:
        figures.failures.append(f"leftovers after recovery: {leftovers}")
    figures.counts.setdefault("acknowledged checkpoints lost", 0)
    figures.counts.setdefault("latest failed to load", 0)
    os.environ.pop("NEBULA_MEMORY_TIER_PATH", None)
    return figures
