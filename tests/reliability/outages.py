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

Then a job's two other moments in an outage (issue #43), with Azurite stopped or
suspended in turn (`LIFE_KINDS`), store calls bounded at `CALL_TIMEOUT_S` and
`exit_timeout_s=EXIT_TIMEOUT_S` (children: outage_life_child.py):

- restart rounds: a trainer makes global_step1-3 durable, the store goes away, it saves
  and acknowledges 1-5 more (in RAM only) and is SIGKILLed; it is restarted with the store
  still away. The restart must resume the newest acknowledged checkpoint (or a newer one
  saved before the kill but not yet journalled), bit for bit, within `RESTART_BOUND_S`
  from its start (a new process) to the loaded state; it saves one more; the store comes
  back, it flushes and exits 0, and what it acknowledged is durable ("restart failures").
- exit rounds: a script makes global_step1 durable, the store goes away, it saves 1-3
  more and returns: it must end within `EXIT_BOUND_S` (exit_timeout_s + 5 s) of its
  script's end, with status 1 and stderr naming the newest checkpoint as not persisted;
  once the store is back, the next start on the node persists it ("exit failures").

Not for: the single scenarios with their exact assertions (tests/core/test_outage.py,
tests/azure/test_azure_outage.py, tests/azure/test_azure_outage_life.py).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import random
import signal
import statistics
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
# The restart and exit rounds (issue #43): Azurite stopped, or suspended ("hung").
LIFE_KINDS = ("stopped", "hung")
LIFE_CHILD = Path(__file__).resolve().parent / "outage_life_child.py"
CALL_TIMEOUT_S = 3  # NEBULA_STORAGE_CALL_TIMEOUT_S of the restart and exit rounds
EXIT_TIMEOUT_S = 8.0  # their exit_timeout_s
RESTART_BOUND_S = 10.0  # a restart resumes within it (from its start to the loaded state)
EXIT_BOUND_S = EXIT_TIMEOUT_S + 5  # a process ending in an outage ends within it
# What fails one restart or exit round (counted, the next round runs)
ROUND_ERRORS = (
    OSError,
    ValueError,
    KeyError,
    IndexError,
    subprocess.SubprocessError,
    nm.NebulaError,
)

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


def outage_campaign(
    work: Path, rounds: int = 30, seed: int = 27, steps: int = 30, restarts: int = 10,
    exits: int = 10,
) -> Figures:  # fmt: skip
    """`rounds` training runs, each with one outage of a random kind (`KINDS`, in turn);
    then `restarts` restart rounds and `exits` exit rounds (`LIFE_KINDS`, in turn)."""
    figures = Figures("outages")
    rng = random.Random(seed)
    work.mkdir(parents=True, exist_ok=True)
    timings: dict[str, list[float]] = {"restart": [], "restart: init to loaded": [], "exit": []}
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
        for what, count, play in (("restart", restarts, _restart_round),
                                  ("exit", exits, _exit_round)):  # fmt: skip
            for n in range(count):
                if not store.usable:
                    figures.add(f"{what} rounds skipped (no Azurite)")
                    continue
                kind = LIFE_KINDS[n % len(LIFE_KINDS)]
                play(work / f"{what}{n}", kind, n, store, rng, figures, timings)
    for key in ("acknowledged checkpoints lost", "training steps blocked > 1 s"):
        figures.counts.setdefault(key, 0)
    for what, count in (("restart", restarts), ("exit", exits)):
        if count:
            figures.counts.setdefault(f"{what} failures", 0)
    for what, took in timings.items():  # restart: from its start to the loaded state
        if took:
            figures.counts[f"{what} max (s)"] = round(max(took), 2)
            figures.counts[f"{what} p50 (s)"] = round(statistics.median(took), 2)
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


# Restarts and exits during an outage (issue #43) ----------------------------------------
def _life_env(work: Path, store: _Store) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("NEBULA_")}
    env.update(store.env())
    env.update(
        NEBULA_MEMORY_TIER_PATH=str(work / "memory-tier"),
        NEBULA_STORAGE_CALL_TIMEOUT_S=str(CALL_TIMEOUT_S),
        NEBULA_EXIT_TIMEOUT_S=str(EXIT_TIMEOUT_S),
        PYTHONUNBUFFERED="1",
        OMP_NUM_THREADS="1",
    )
    return env


def _life(
    how: str, root: str, journal: Path, env: dict[str, str], *extra: str
) -> subprocess.Popen[str]:
    """outage_life_child.py `how`, its stdin, stdout and stderr piped."""
    command = [sys.executable, "-W", "ignore", str(LIFE_CHILD), how, root, str(journal), *extra]
    pipe = subprocess.PIPE
    return warm.Popen(command, env=env, text=True, stdin=pipe, stdout=pipe, stderr=pipe)


def _line(proc: subprocess.Popen[str]) -> str:
    assert proc.stdout is not None
    return proc.stdout.readline().strip()


def _tell(proc: subprocess.Popen[str], line: str) -> None:
    assert proc.stdin is not None
    proc.stdin.write(line + "\n")
    proc.stdin.flush()


def _end(proc: subprocess.Popen[str]) -> str:
    """Kill `proc` if it still runs; its stderr."""
    if proc.poll() is None:
        proc.kill()
    try:
        return proc.communicate(timeout=30)[1][-1500:]
    except (subprocess.TimeoutExpired, ValueError):
        return ""


def _restart_round(
    work: Path, kind: str, n: int, store: _Store, rng: random.Random, figures: Figures,
    timings: dict[str, list[float]],
) -> None:  # fmt: skip
    """A trainer saves and makes durable global_step1-3; the store goes away; it saves
    (and acknowledges) a few more, in RAM only, and is SIGKILLed; it is restarted with the
    store still away and must resume the newest acknowledged checkpoint, bit for bit,
    within `RESTART_BOUND_S`; it saves one more; the store comes back, the restart
    flushes, and what it acknowledged is durable."""
    from outage_life_child import digest, state

    work.mkdir(parents=True)
    journal = work / "journal.jsonl"
    root = f"az://outages/{uuid.uuid4().hex[:10]}"
    env = _life_env(work, store)
    acks = rng.randint(1, 5)  # saves acknowledged in the outage before the kill
    figures.add("restart rounds")
    figures.add(f"restart rounds: {kind}")
    first = _life("save", root, journal, env)
    second = None
    failed = None
    try:
        if (got := _line(first)) != "DURABLE":
            failed = f"the first trainer said {got!r}: {_end(first)}"
            return
        store.down(kind)
        try:
            _tell(first, "go")
            _wait_for(f"save {3 + acks}", lambda: len(_journal(journal)) >= acks or first.poll())
            first.kill()
            first.wait(timeout=30)
            if first.returncode != -signal.SIGKILL:
                failed = f"the first trainer exited {first.returncode}: {_end(first)}"
                return
            acked = _journal(journal)[-1]
            acked_step = int(acked["step"])  # type: ignore[call-overload]
            started = time.monotonic()
            second = _life("resume", root, journal, env)
            line = _line(second)
            seconds = time.monotonic() - started
            try:
                resumed = json.loads(line)
            except ValueError:
                failed = f"the restart said {line!r}: {_end(second)}"
                return
            timings["restart"].append(seconds)
            timings["restart: init to loaded"].append(float(resumed["took_s"]))
            step = int(str(resumed["tag"]).removeprefix("global_step"))
            if step == acked_step and resumed["digest"] == acked["digest"]:
                figures.add("restarts resumed bit-exact")
            elif step > acked_step and resumed["digest"] == digest(state(step)):
                figures.add("restarts resumed bit-exact")  # one saved but not yet journalled
                figures.add("restarts resumed a newer one than acknowledged")
            else:
                failed = f"resumed {resumed} after global_step{acked_step} was acknowledged"
                return
            if seconds >= RESTART_BOUND_S:
                failed = f"the restart took {seconds:.1f} s to resume {resumed['tag']}"
            if (got := _line(second)) != "ACKED":
                failed = f"the restart said {got!r} after resuming: {_end(second)}"
                return
        finally:
            store.up(kind)
        _tell(second, "flush")
        out, err = second.communicate(timeout=180)
        if second.returncode != 0 or "FLUSHED True" not in out:
            failed = f"the restart exited {second.returncode}: {out[-300:]} {err[-1500:]}"
        _check_life(root, _journal(journal)[-1], env, f"restart ({kind})", figures)
    except ROUND_ERRORS as exc:
        failed = f"{exc!r}: {_end(first)} {_end(second) if second else ''}"
    finally:
        for proc in (first, second):
            if proc is not None:
                _end(proc)
        if failed:
            figures.add("restart failures")
            figures.failures.append(f"restart ({kind}): {failed}")


def _exit_round(
    work: Path, kind: str, n: int, store: _Store, rng: random.Random, figures: Figures,
    timings: dict[str, list[float]],
) -> None:  # fmt: skip
    """A script made global_step1 durable; the store goes away; it saves 1-3 more (2, 1,
    3 in turn, each with both kinds: a short tier saves 2) and ends (returns) with the
    newest unpersisted: it must end within `EXIT_BOUND_S`, with status 1 and a stderr
    line naming that checkpoint. Once the store is back, the next start on the node
    persists it."""
    work.mkdir(parents=True)
    journal = work / "journal.jsonl"
    root = f"az://outages/{uuid.uuid4().hex[:10]}"
    env = _life_env(work, store)
    figures.add("exit rounds")
    figures.add(f"exit rounds: {kind}")
    saves = (2, 1, 3)[n // len(LIFE_KINDS) % 3]
    figures.add(f"exit rounds saving {saves} in the outage")
    proc = _life("exit", root, journal, env, str(saves))
    failed = None
    try:
        if (got := _line(proc)) != "READY":
            failed = f"the script said {got!r}: {_end(proc)}"
            return
        store.down(kind)
        try:
            _tell(proc, "go")
            said = _line(proc)
            started = time.monotonic()
            if not said.startswith("SAVED "):
                failed = f"the script said {said!r}: {_end(proc)}"
                return
            tag = said.removeprefix("SAVED ")
            try:
                _out, err = proc.communicate(timeout=EXIT_BOUND_S + 60)
            except subprocess.TimeoutExpired:
                failed = f"still running {EXIT_BOUND_S + 60:.0f} s after its end"
                return
            seconds = time.monotonic() - started
            timings["exit"].append(seconds)
        finally:
            store.up(kind)
        named = f"'{tag}' was not persisted" in err
        if seconds >= EXIT_BOUND_S or proc.returncode != 1 or not named:
            failed = f"ended after {seconds:.1f} s, status {proc.returncode}: {err[-1500:]}"
        else:
            figures.add("exits with status 1 naming the checkpoint")
        recover = _life("recover", root, journal, env)
        out, err = recover.communicate(timeout=180)
        if recover.returncode != 0 or "FLUSHED True" not in out:
            failed = failed or f"the next start exited {recover.returncode}: {out} {err[-1500:]}"
        _check_life(root, _journal(journal)[-1], env, f"exit ({kind})", figures)
    except ROUND_ERRORS as exc:
        failed = f"{exc!r}: {_end(proc)}"
    finally:
        _end(proc)
        if failed:
            figures.add("exit failures")
            figures.failures.append(f"exit ({kind}): {failed}")


def _check_life(
    root: str, acked: dict[str, object], env: dict[str, str], what: str, figures: Figures
) -> None:
    """The newest acknowledged checkpoint is committed on the persistent tier, bit for bit."""
    from outage_life_child import digest

    tag = f"global_step{acked['step']}"
    figures.add("acknowledged checkpoints checked")
    with _environ(env):
        ckpt = nm.get_checkpoint(tag, root)
        tiers = [c["tiers"] for c in nm.list_checkpoints(root, hold=False) if c["tag"] == tag]
        got = digest(ckpt.load("model")) if ckpt is not None else None
    if not tiers or "persistent" not in tiers[0] or got != acked["digest"]:
        figures.add("acknowledged checkpoints lost")
        figures.failures.append(f"{what}: {tag} not durable or not as saved: {tiers} {got}")
