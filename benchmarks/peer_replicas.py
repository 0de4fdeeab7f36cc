"""Peer replicas (issue #44): what `nm.init(..., peer_replicas=1)` costs and what it buys,
measured side by side in one run on 2 simulated nodes.

    python benchmarks/peer_replicas.py [--state-mb 100] [--runs 3] [--saves 8]
        [--interval 3600] [--recoveries 2] [--no-azure] [--no-all-changed]
        [--parts loop recovery] [--work DIR] [--json PATH]
    make bench-peers        (and the end of `make bench`)

A simulated node is one process (`LOCAL_WORLD_SIZE=1`, `GROUP_RANK`), with its own
memory tier (`NEBULA_MEMORY_TIER_PATH`, a folder of /dev/shm); the two meet over gloo on
127.0.0.1 at a store this process serves, as the tests do (tests/dist/dist_launch.py),
one thread of torch each (`OMP_NUM_THREADS=1`). Each rank trains its own LoRA fine-tune
(lora_model.py: `--state-mb` of `model` + Adam state, ~95% of it a frozen base) and saves
`model_rank<r>` and `optimizer_rank<r>` into `Checkpoint(tag, 2)`, as a data-parallel
job's ranks save their parts of one tag; the persistent tier is a folder of the work
folder. Four parts:

**1. Stall.** The same training loop, as a fresh job of 2 ranks per run, with
`peer_replicas=0` and `=1` in alternated runs (`--runs` of each; the order swapped every
other run), `persistent_time_interval` `--interval` (3600 s: the regime replicas are for;
the first commit persists at once, the later ones stay in the memory tiers). A run makes
`COLD_SAVES` cold saves and `WARMUP_SAVES` warm-up saves (both reported apart), then
`--saves` timed ones, each after a training step; the stall is the two `save` calls (the
second commits, and with replicas hands the tag to the sender thread). Before each save
the harness waits, outside the stall, until the previous checkpoint's replica is answered
(reported: a step that outlasts the replication never waits), then the ranks meet (two
barriers on the program's group: the wire's window, below) and save together: each
timed save runs while the partner's replica of the same checkpoint may arrive, as in a
job whose nodes save at the same step. The all-changed control (lora_model.py: every
byte of the base changes at every step, so every part goes whole) runs the same way
unless `--no-all-changed`. Medians and p90 over the timed saves of both ranks (`all`),
of rank 0 (`leader`: the lowest rank writing the tag, which commits it on the persistent
tier) and of rank 1 (`follower`), each with its ratio replicas / none (target <= 1.05).
The two ranks differ: a follower keeps each of its parts until it sees its leader
persist that tag or a newer one (runtime/persist_schedule.py's candidates), so within a
persist interval its memory tier keeps every checkpoint and each save copies the whole
state into fresh pages. So each save's `copied_bytes` (the history's memory rows) says
whether it copied the changed bytes into a buffer that held the previous copy or every
byte, and the stall of the former is shown apart. Where the time goes: the training
thread's CPU time in each save (`time.thread_time`) and how long it waited runnable for a
CPU (its schedstat), the time from the commit's hand-off to replication to the save's
return, how long each of replication's threads (nebula's sender and receivers, gloo's
transport loop) ran meanwhile (their schedstat), and each thread's CPU per save over the
run. The table shows the leader and the follower; `all` (both ranks) is in the JSON.

**2. Bytes on the wire.** Per checkpoint, during the runs with replicas: the sender's
count (`Replication.status().bytes_sent`: its frames' heads, announcement and payload),
and the bytes the receiving process's kernel counted on the TCP connections of nebula's
process group (`TCP_INFO`'s `tcpi_bytes_received` of each socket the process opened in
`nm.init`: the payload that landed there, gloo's own framing included, TCP/IP headers
not; the receiver's answers to the sender's replica of the same step cross the same
connection, a few hundred bytes). A checkpoint's window: from the counters read before
its save to those read before the next one, each read between two barriers once both
ranks' replicas of the previous checkpoint were answered (nothing of them in flight).
Each is divided by the bytes a step changes, counted from the state (the adapter and
Adam's state: `LoraState.changed_bytes`; the all-changed control: the whole state).
Target for the LoRA workload: <= 1.05x. The first replica after a start goes whole (the
partner holds no base yet): reported apart.

**3. Recovery.** A job saves `global_step1..3` and dies (every rank SIGKILLed after its
last checkpoint is safe), node 1's memory tier is deleted (the node is lost and a fresh
one takes its place), and the job restarts on both nodes. Timed on every rank from
`nm.init` to `get_latest_checkpoint()` and both loads done (the loads checked bit for
bit against what was saved, outside the timing):

  from the partner   the first job ran with `peer_replicas=1` and
                     `persistent_time_interval=3600` (global_step1 persisted and waited
                     for; global_step3 only in the memory tiers and the partner's
                     replica); the restart's `nm.init(...,
                     peer_replicas=1)` opens nebula's group, agrees on global_step3,
                     receives node 1's part from node 0's replica, and persists
                     global_step3 (runtime/peer_recovery.py: a node's memory tier holds
                     parts, never a manifest, so a job of several nodes loads what its
                     persistent tier holds); then the loads read the persistent tier
  from the persistent tier
                     the first job ran with `peer_replicas=0` and
                     `persistent_time_interval=0` (global_step3 persisted, waited for);
                     the restart's plain `nm.init` and the loads from the persistent tier

The same bytes in both (the same states, saved the same way). The persistent tier is a
folder of the work folder (its files evicted from the page cache before the restart) and,
unless `--no-azure`, an Azurite this script starts (the one that stages blocks from a
URL, as Azure does, when installed: `make azurite`). Each phase of the restart is timed
by wrapping nebula's functions (no behaviour changes): opening the ring
(`peers.open_ring`), the agreement (`recover_from_peers` less what follows), receiving
the part (`peer_recovery._move`), persisting it (`peer_recovery._make_durable`: each
writer's persist and the lowest rank's commit, then every rank waits), the rest of
`init`, `get_latest_checkpoint`, the loads. `--recoveries` repeats of each (tier, source),
the sources alternated. The history's rows of the resumed checkpoint's persist say what
it wrote and what it took from the previous version.

**4. Footprint.** After each stall run's last save (its replica answered), the bytes
each node's memory-tier folder holds (allocated, `st_blocks`; hard links once), with
replicas and without, and their replicas folder alone; per byte of the rank's state; and
the most seen between saves (read after each replica was answered).

Prints the tables; writes every figure and sample to `benchmarks/results/peer-replicas.json`
(or `--json`). Not a test.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
RESULTS = HERE / "results"
COLD_SAVES = 2
# Saves after the cold ones and before the timed ones: the first commit is persisted at
# once (the interval counts from it), and while that persist holds its buffers the next
# saves fill fresh memory; reported apart, as the cold saves are.
WARMUP_SAVES = 2
MB = 1e6
STALL_TARGET = 1.05  # median save() stall with replicas / without
WIRE_TARGET = 1.05  # bytes on the wire per checkpoint / changed bytes (LoRA)
JOB_TIMEOUT_S = 600
ANSWER_TIMEOUT_S = 120.0  # how long the harness waits for a replica's answer
AZURE_CONTAINER = "bench"
CONNECTION_ENV = "AZURE_STORAGE_CONNECTION_STRING"
RECOVERY_STEPS = 3
TCPI_BYTES_RECEIVED = 128  # offset of tcpi_bytes_received in struct tcp_info (Linux >= 4.1)


def progress(message: str) -> None:
    sys.stderr.write(f"[peers {time.perf_counter() - _T0:6.1f} s] {message}\n")
    sys.stderr.flush()


_T0 = time.perf_counter()


# ======================================================================================
# the children: one rank of a simulated node
# ======================================================================================
def _own_tcp_sockets() -> dict[int, int]:
    """This process's TCP sockets: {inode: fd}."""
    found: dict[int, int] = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if target.startswith("socket:["):
            fd = int(name)
            try:
                sock = socket.socket(fileno=os.dup(fd))
            except OSError:
                continue
            try:
                if sock.type == socket.SOCK_STREAM and sock.family in (
                    socket.AF_INET,
                    socket.AF_INET6,
                ):
                    found[int(target[8:-1])] = fd
            finally:
                sock.close()
    return found


def _bytes_received(fds: dict[int, int]) -> int:
    """The kernel's count of payload bytes received on the sockets `fds` ({inode: fd}):
    the sum of their `tcpi_bytes_received`."""
    total = 0
    for fd in fds.values():
        try:
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
        except OSError:
            continue
        finally:
            sock.close()
        if len(info) >= TCPI_BYTES_RECEIVED + 8:
            total += struct.unpack_from("Q", info, TCPI_BYTES_RECEIVED)[0]
    return total


def folder_bytes(path: Path) -> int:
    """Allocated bytes of the files under `path` (st_blocks; a hard link counted once)."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for folder, _dirs, names in os.walk(path):
        for name in names:
            try:
                st = os.lstat(os.path.join(folder, name))
            except FileNotFoundError:
                continue
            key = (st.st_dev, st.st_ino)
            if key not in seen:
                seen.add(key)
                total += st.st_blocks * 512
    return total


def _thread_cpu() -> dict[str, float]:
    """CPU seconds (user + system) of this process's threads so far, by name: a Python
    thread's (its numbered copies summed: "nebula-replica-receive-1" as
    "nebula-replica-receive"), else the kernel's in brackets (gloo's and torch's own)."""
    import threading

    tick = os.sysconf("SC_CLK_TCK")
    names = {t.native_id: t.name for t in threading.enumerate()}
    out: dict[str, float] = {}
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/stat") as f:
                head, rest = f.read().rsplit(")", 1)
        except OSError:
            continue
        fields = rest.split()
        python = names.get(int(task))
        name = python.rstrip("-0123456789") if python else f"[{head.split('(', 1)[1]}]"
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


def _replication_tasks() -> dict[int, str]:
    """This process's threads that replication keeps busy: {tid: name} of nebula's
    sender and receivers and gloo's own transport loop."""
    import threading

    tasks = {
        t.native_id: t.name
        for t in threading.enumerate()
        if t.name.startswith("nebula-replica") and t.native_id is not None
    }
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                comm = f.read().strip()
        except OSError:
            continue
        if comm.startswith("gloo"):
            tasks[int(task)] = f"[{comm}]"
    return tasks


def _on_cpu_ns(tasks: dict[int, str]) -> dict[int, int]:
    """Nanoseconds each of `tasks` has run on a CPU so far (schedstat)."""
    out = {}
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                out[tid] = int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            out[tid] = 0
    return out


def _schedstat(tid: int) -> tuple[int, int]:
    """Nanoseconds thread `tid` has run on a CPU, and waited runnable for one."""
    try:
        with open(f"/proc/self/task/{tid}/schedstat") as f:
            fields = f.read().split()
        return int(fields[0]), int(fields[1])
    except (OSError, ValueError, IndexError):
        return 0, 0


def _large_files(path: Path) -> dict[str, int]:
    """The files of 1 MB or more under `path` and their allocated bytes (what the
    footprint is made of)."""
    out: dict[str, int] = {}
    for folder, _dirs, names in os.walk(path):
        for name in names:
            full = os.path.join(folder, name)
            try:
                st = os.lstat(full)
            except FileNotFoundError:
                continue
            if st.st_blocks * 512 >= MB:
                out[os.path.relpath(full, path)] = st.st_blocks * 512
    return out


def _state_digests(obj: Any) -> dict[str, str]:
    """A digest of each tensor of a state dict (by its path in the dict)."""
    import torch

    out: dict[str, str] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, torch.Tensor):
            data = value.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
            out[prefix] = hashlib.blake2b(data.tobytes(), digest_size=16).hexdigest()
        elif isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}/{k}", v)
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                walk(f"{prefix}/{i}", v)

    walk("", obj)
    return out


class _Child:
    """One rank: its configuration (the driver's JSON), its state, its output."""

    def __init__(self, config: dict[str, Any], port: str) -> None:
        import torch.distributed as dist

        sys.path.insert(0, str(HERE))
        self.config = config
        self.rank = int(os.environ["RANK"])
        self.memory = Path(os.environ["NEBULA_MEMORY_TIER_PATH"])
        self.out = Path(config["out"])
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=self.rank, world_size=2
        )
        self.dist = dist

    def state(self) -> Any:
        from lora_model import LoraShape, LoraState

        shape = LoraShape.for_state_bytes(int(self.config["state_bytes"]))
        return LoraState(shape, all_changed=bool(self.config["all_changed"]), seed=self.rank)

    def init_kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = {
            "persistent_time_interval": self.config["interval"],
            "num_of_version_in_retention": 2,
            "peer_replicas": self.config["replicas"],
            "rank_timeout_s": 60,
        }
        if self.config.get("azure"):
            kwargs["storage_options"] = {"connection_string": os.environ[CONNECTION_ENV]}
        return kwargs

    def save(self, state: Any, tag: str) -> float:
        import nebulaml as nm

        t0 = time.perf_counter()
        ckpt = nm.Checkpoint(tag, 2)
        ckpt.save(f"model_rank{self.rank}", state.model.state_dict())
        ckpt.save(f"optimizer_rank{self.rank}", state.optimizer.state_dict())
        return time.perf_counter() - t0

    def write(self, result: dict[str, Any]) -> None:
        path = self.out / f"{self.config['scenario']}-rank{self.rank}.json"
        path.write_text(json.dumps(result, indent=1) + "\n")

    # --- 1, 2, 4: the loop ----------------------------------------------------------
    def loop(self) -> None:
        import threading

        import nebulaml as nm
        from nebulaml.format.names import REPLICAS_DIR
        from nebulaml.runtime import session

        handed: list[float] = []  # when each commit handed its tag to replication
        inner = session.Session.replicate

        def replicate(live_session: session.Session, tag: str) -> None:
            inner(live_session, tag)
            handed.append(time.perf_counter())

        session.Session.replicate = replicate  # type: ignore[method-assign,assignment]
        state = self.state()
        state_bytes = state.state_bytes
        changed = state_bytes if state.all_changed else state.changed_bytes
        step_s = state.time_step(3)
        before = _own_tcp_sockets()
        nm.init(self.config["root"], **self.init_kwargs())
        ring = {i: fd for i, fd in _own_tcp_sockets().items() if i not in before}
        live = session.live()
        assert live is not None
        replication = live.replication
        if self.config["replicas"]:
            assert replication is not None, "peer_replicas=1 but no replication"
        tasks = _replication_tasks()
        main = threading.get_native_id()
        self.dist.barrier()
        saves: list[dict[str, Any]] = []
        previous: str | None = None
        footprint_max = 0
        total = COLD_SAVES + WARMUP_SAVES + int(self.config["saves"])
        saved_at = 0.0
        for i in range(total + 1):
            if i < total:
                state.step()
            waited = answered_after = 0.0
            answer: dict[str, Any] = {}
            if replication is not None and previous is not None:
                t0 = time.perf_counter()
                status = replication.wait(previous, ANSWER_TIMEOUT_S)
                t1 = time.perf_counter()
                waited, answered_after = t1 - t0, t1 - saved_at
                answer = {
                    "replicated": status.replicated,
                    "bytes_sent": status.bytes_sent,
                    "bytes_total": status.bytes_total,
                    "refused": status.refused,
                    "error": status.last_error,
                }
            # Both replicas of `previous` answered: nothing of them is in flight, and the
            # window closes; the second barrier keeps the next save's bytes out of it.
            self.dist.barrier()
            received = _bytes_received(ring)
            self.dist.barrier()
            if saves:
                last = saves[-1]
                last["wire_received"] = received - last["received_before"]
                last["answer_wait_s"] = waited
                # The answer came at most this long after the save returned (exactly, when
                # the harness waited for it).
                last["answered_within_s"] = answered_after
                last.update(answer)
                footprint_max = max(footprint_max, folder_bytes(self.memory))
            if i == total:
                break
            tag = f"global_step{i + 1}"
            busy = _on_cpu_ns(tasks)
            main0 = _schedstat(main)
            cpu0 = time.thread_time()
            handed.clear()
            stall = self.save(state, tag)
            saved_at = time.perf_counter()
            # from the hand-off's return (the commit's last step) to the save's return
            after_handoff = saved_at - handed[-1] if handed else None
            cpu = time.thread_time() - cpu0
            main1 = _schedstat(main)
            after = _on_cpu_ns(tasks)
            beside: dict[str, float] = {}
            for tid, ran in after.items():
                name = tasks[tid].rstrip("-0123456789")
                beside[name] = beside.get(name, 0.0) + (ran - busy.get(tid, ran)) / 1e9
            phase = (
                "cold" if i < COLD_SAVES else "warmup" if i < COLD_SAVES + WARMUP_SAVES else "timed"
            )
            saves.append(
                {
                    "tag": tag,
                    "stall_s": stall,
                    # the training thread's CPU during the save, and replication's threads'
                    "stall_cpu_s": cpu,
                    "replication_cpu_s": sum(beside.values()),
                    "threads_cpu_s": beside,
                    "after_handoff_s": after_handoff,
                    # the training thread waited runnable (for a CPU) during the save
                    "runqueue_wait_s": (main1[1] - main0[1]) / 1e9,
                    "phase": phase,
                    "received_before": received,
                }
            )
            previous = tag
        threads = _thread_cpu()
        replicas = [p for p in self.memory.rglob(REPLICAS_DIR) if p.is_dir()]
        result = {
            "rank": self.rank,
            "state_bytes": state_bytes,
            "changed_bytes": changed,
            "step_s": step_s,
            "ring_sockets": len(ring),
            "saves": saves,
            "footprint_bytes": folder_bytes(self.memory),
            "footprint_max_bytes": footprint_max,
            "replicas_bytes": sum(folder_bytes(p) for p in replicas),
            "tier_files": _large_files(self.memory),
            "thread_cpu_s": threads,
            "process_cpu_s": time.process_time(),
        }
        nm.shutdown()
        self.dist.barrier()
        self.dist.destroy_process_group()
        self.write(result)

    # --- 3: recovery ----------------------------------------------------------------
    def prepare(self) -> None:
        """Save global_step1..3, make sure the newest is safe (replicated, or persisted),
        write its digests, and die."""
        import nebulaml as nm
        from nebulaml.runtime import session

        state = self.state()
        nm.init(self.config["root"], keep_memory_tier=True, **self.init_kwargs())
        live = session.live()
        assert live is not None
        tag = ""
        for step in range(1, RECOVERY_STEPS + 1):
            state.step()
            tag = f"global_step{step}"
            self.save(state, tag)
        if self.config["replicas"]:
            assert live.replication is not None
            status = live.replication.wait(tag, ANSWER_TIMEOUT_S)
            if status.replicated != tag:
                raise RuntimeError(f"{tag} not replicated: {status}")
            # The first commit's persist (at once; the interval holds the later ones) is
            # done, as it long is in a job that runs for an interval.
            deadline = time.monotonic() + ANSWER_TIMEOUT_S
            while nm.persistence_status().durable != "global_step1":
                if time.monotonic() > deadline:
                    raise RuntimeError(f"global_step1 not persisted: {nm.persistence_status()}")
                time.sleep(0.02)
        else:
            if not nm.flush_persistence(timeout_s=ANSWER_TIMEOUT_S):
                raise RuntimeError(f"{tag} not persisted: {nm.persistence_status()}")
        digests = {
            "model": _state_digests(state.model.state_dict()),
            "optimizer": _state_digests(state.optimizer.state_dict()),
        }
        self.write({"tag": tag, "digests": digests})
        self.dist.barrier()  # both ranks' newest checkpoints are safe
        os.kill(os.getpid(), signal.SIGKILL)

    def restart(self) -> None:
        import nebulaml as nm
        from nebulaml.runtime import peer_recovery, peers, session
        from nebulaml.runtime.locate import find_copy

        phases: dict[str, float] = {}
        facts: dict[str, Any] = {}

        def timed(
            module: Any, name: str, key: str, keep: Callable[[Any], None] | None = None
        ) -> None:
            inner = getattr(module, name)

            def wrapper(*args: Any, **kwargs: Any) -> Any:
                t0 = time.perf_counter()
                try:
                    out = inner(*args, **kwargs)
                finally:
                    phases[key] = phases.get(key, 0.0) + time.perf_counter() - t0
                if keep is not None:
                    keep(out)
                return out

            setattr(module, name, wrapper)

        def keep_result(result: Any) -> None:
            facts.update(
                tag=result.tag,
                source=result.source,
                durable=result.durable,
                received=[(m.tag, m.rank, m.holder, m.size, m.seconds) for m in result.received],
                sent=[(m.tag, m.rank, m.holder, m.size) for m in result.sent],
                refused=len(result.refused),
            )

        timed(peers, "open_ring", "ring")
        timed(peer_recovery, "recover_from_peers", "recover", keep_result)
        timed(peer_recovery, "_move", "receive")
        timed(peer_recovery, "_make_durable", "persist")
        self.dist.barrier()  # the job restarts together
        t0 = time.perf_counter()
        nm.init(self.config["root"], **self.init_kwargs())
        t1 = time.perf_counter()
        latest = nm.get_latest_checkpoint()
        t2 = time.perf_counter()
        assert latest is not None, "no checkpoint after the restart"
        model = latest.load(f"model_rank{self.rank}")
        optimizer = latest.load(f"optimizer_rank{self.rank}")
        t3 = time.perf_counter()
        live = session.live()
        assert live is not None
        tiers = [
            find_copy(live.tiers, latest.tag, lambda c: c.tier, item=f"{n}_rank{self.rank}")
            for n in ("model", "optimizer")
        ]
        saved = json.loads((self.out / f"prepare-rank{self.rank}.json").read_text())
        equal = (
            latest.tag == saved["tag"]
            and _state_digests(model) == saved["digests"]["model"]
            and _state_digests(optimizer) == saved["digests"]["optimizer"]
        )
        latest.release()
        del model, optimizer
        nm.shutdown()
        self.dist.barrier()
        self.dist.destroy_process_group()
        self.write(
            {
                "rank": self.rank,
                "tag": latest.tag,
                "equal": equal,
                "loaded_from": tiers,
                "init_s": t1 - t0,
                "latest_s": t2 - t1,
                "load_s": t3 - t2,
                "total_s": t3 - t0,
                "phases": phases,
                "recovery": facts,
            }
        )


def child_main(scenario: str, config_path: str, port: str) -> int:
    import logging

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    config = json.loads(Path(config_path).read_text())
    child = _Child(config, port)
    {"loop": child.loop, "prepare": child.prepare, "restart": child.restart}[scenario]()
    return 0


# ======================================================================================
# the driver
# ======================================================================================
class Job:
    """Launches a job of 2 ranks, each a simulated node."""

    def __init__(self, work: Path, shm: Path, azure_env: dict[str, str]) -> None:
        self.work, self.shm, self.azure_env = work, shm, azure_env
        self.count = 0

    def memory(self, rank: int) -> Path:
        return self.shm / f"node{rank}"

    def run(self, scenario: str, config: dict[str, Any], *, killed: bool = False) -> Path:
        """Run `scenario` on both ranks; returns the folder their JSON went to."""
        import torch.distributed as dist

        self.count += 1
        out = Path(config["out"])
        out.mkdir(parents=True, exist_ok=True)
        config_path = out / f"{scenario}-config.json"
        config_path.write_text(json.dumps({**config, "scenario": scenario}))
        store = dist.TCPStore(
            "127.0.0.1", 0, 2, is_master=True, wait_for_workers=False, multi_tenant=True
        )
        procs = []
        try:
            for rank in range(2):
                env = dict(
                    os.environ,
                    **self.azure_env,
                    MASTER_ADDR="127.0.0.1",
                    MASTER_PORT=str(store.port),
                    TORCHELASTIC_USE_AGENT_STORE="True",
                    RANK=str(rank),
                    WORLD_SIZE="2",
                    LOCAL_WORLD_SIZE="1",
                    GROUP_RANK=str(rank),
                    NEBULA_MEMORY_TIER_PATH=str(self.memory(rank)),
                    OMP_NUM_THREADS="1",
                )
                procs.append(
                    subprocess.Popen(
                        [
                            sys.executable,
                            __file__,
                            "--child",
                            scenario,
                            str(config_path),
                            str(store.port),
                        ],
                        env=env,
                        stdout=subprocess.PIPE,
                        stderr=subprocess.STDOUT,
                        text=True,
                    )
                )
            deadline = time.monotonic() + JOB_TIMEOUT_S
            outputs = []
            for proc in procs:
                text, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
                outputs.append((proc.returncode, text))
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.communicate()
            del store
        failed = [
            f"{scenario} rank {rank} exited {code}:\n{text[-4000:]}"
            for rank, (code, text) in enumerate(outputs)
            if code != (-signal.SIGKILL if killed else 0)
        ]
        if failed:  # every failed rank's output: the first to fail may be any of them
            raise RuntimeError("\n".join(failed))
        for rank, (_code, text) in enumerate(outputs):
            lines = [line for line in text.splitlines() if line.strip()]
            if lines and not killed:
                progress(f"  rank {rank} said: " + " | ".join(lines[-3:])[-400:])
        return out

    def clear_memory(self) -> None:
        shutil.rmtree(self.shm, ignore_errors=True)


def _p90(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.9 * (len(ordered) - 1)))]


def _summary(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    return {
        "median": statistics.median(values),
        "p90": _p90(values),
        "min": min(values),
        "max": max(values),
        "n": len(values),
    }


def run_loops(job: Job, args: argparse.Namespace, workload: str) -> dict[str, Any]:
    """Part 1, 2, 4 for one workload ("lora" or "all_changed"): alternated runs."""
    runs: list[dict[str, Any]] = []
    for r in range(args.runs):
        order = (0, 1) if r % 2 == 0 else (1, 0)
        for replicas in order:
            job.clear_memory()
            name = f"loop-{workload}-{r}-{replicas}"
            root = job.work / name / "persistent"
            config = {
                "out": str(job.work / name / "out"),
                "root": str(root),
                "replicas": replicas,
                "interval": args.interval,
                "state_bytes": args.state_mb * MB,
                "all_changed": workload == "all_changed",
                "saves": args.saves,
            }
            progress(f"{workload} run {r + 1}/{args.runs}, peer_replicas={replicas} ...")
            out = job.run("loop", config)
            ranks = [json.loads((out / f"loop-rank{k}.json").read_text()) for k in range(2)]
            _add_copied(root, ranks)
            runs.append({"run": r, "replicas": replicas, "ranks": ranks})
            stalls = [s["stall_s"] for rk in ranks for s in rk["saves"] if s["phase"] == "timed"]
            progress(f"  median stall {statistics.median(stalls) * 1e3:.2f} ms")
            shutil.rmtree(root, ignore_errors=True)
    job.clear_memory()
    return loop_figures(runs)


def _add_copied(root: Path, ranks: list[dict[str, Any]]) -> None:
    """Each save's `copied_bytes`: what it copied into its buffer (the history's memory
    rows' `bytes_written`): the changed bytes into a buffer that held the previous copy,
    every byte into a fresh one."""
    import nebulaml as nm

    df = nm.ops.read_history(str(root))
    rows = df[(df["tier"] == "memory") & (df["status"] == "ok")]
    copied = rows.groupby(["tag", "rank"])["bytes_written"].sum().to_dict()
    for rk in ranks:
        for save in rk["saves"]:
            save["copied_bytes"] = int(copied.get((save["tag"], rk["rank"]), -1))


ROLES = {"all": (0, 1), "leader": (0,), "follower": (1,)}


def loop_figures(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per mode (`replicas_0`, `replicas_1`): the stall of the timed saves of both ranks
    (`all`), of rank 0 (`leader`: the lowest rank, which commits each checkpoint on the
    persistent tier) and of rank 1 (`follower`), the share of saves that copied the whole
    state, the footprint of each node, the threads' CPU; with replicas, the bytes on the
    wire per checkpoint. Then the ratios replicas / none."""
    first = runs[0]["ranks"][0]
    figures: dict[str, Any] = {
        "state_bytes": first["state_bytes"],
        "changed_bytes": first["changed_bytes"],
        "step_s": statistics.median(rk["step_s"] for run in runs for rk in run["ranks"]),
        "runs": runs,
    }
    state, changed = first["state_bytes"], first["changed_bytes"]
    for replicas in (0, 1):
        mine = [run for run in runs if run["replicas"] == replicas]
        fig: dict[str, Any] = {}
        for role, ranks in ROLES.items():
            saves = [s for run in mine for k in ranks for s in run["ranks"][k]["saves"]]
            timed = [s for s in saves if s["phase"] == "timed"]
            whole = [s for s in timed if s["copied_bytes"] >= state]
            fig[role] = {
                "stall_s": _summary([s["stall_s"] for s in timed]),
                "cold_stall_s": _summary([s["stall_s"] for s in saves if s["phase"] == "cold"]),
                "warmup_stall_s": _summary([s["stall_s"] for s in saves if s["phase"] == "warmup"]),
                # saves that copied every byte (into a buffer that did not hold the
                # previous copy), and the others' stall
                "whole_copies": len(whole) / len(timed),
                "changed_copy_stall_s": _summary(
                    [s["stall_s"] for s in timed if s["copied_bytes"] < state]
                ),
                "stall_cpu_s": _summary([s["stall_cpu_s"] for s in timed]),
                "replication_cpu_in_save_s": _summary([s["replication_cpu_s"] for s in timed]),
                "after_handoff_s": _summary(
                    [s["after_handoff_s"] for s in timed if s.get("after_handoff_s") is not None]
                ),
                "runqueue_wait_s": _summary([s["runqueue_wait_s"] for s in timed]),
                "threads_in_save_s": {
                    name: statistics.mean(s["threads_cpu_s"].get(name, 0.0) for s in timed)
                    for name in sorted({n for s in timed for n in s["threads_cpu_s"]})
                },
                "run_medians_s": [
                    statistics.median(
                        s["stall_s"]
                        for k in ranks
                        for s in run["ranks"][k]["saves"]
                        if s["phase"] == "timed"
                    )
                    for run in mine
                ],
                "footprint_bytes": _summary(
                    [float(run["ranks"][k]["footprint_bytes"]) for run in mine for k in ranks]
                ),
                "footprint_max_bytes": _summary(
                    [float(run["ranks"][k]["footprint_max_bytes"]) for run in mine for k in ranks]
                ),
                "replicas_bytes": _summary(
                    [float(run["ranks"][k]["replicas_bytes"]) for run in mine for k in ranks]
                ),
            }
        # CPU seconds per save of each thread (by name), and of the process (its start
        # and the state's building included), medians over the ranks
        fig["cpu_per_save_s"] = _cpu_per_save([rk for run in mine for rk in run["ranks"]])
        if replicas:
            fig["wire"] = _wire(mine, changed)
        figures[f"replicas_{replicas}"] = fig
    none, with_ = figures["replicas_0"], figures["replicas_1"]
    figures["stall_ratio"] = {
        role: {
            "median": with_[role]["stall_s"]["median"] / none[role]["stall_s"]["median"],
            "p90": with_[role]["stall_s"]["p90"] / none[role]["stall_s"]["p90"],
        }
        for role in ROLES
    }
    return figures


def _wire(runs: list[dict[str, Any]], changed: int) -> dict[str, Any]:
    """Per checkpoint k of each rank: the sender's count, and what landed at the partner
    (the other rank's window k); the first replica of a run (whole) apart."""
    sent, landed, first_sent, first_landed = [], [], [], []
    waits, within = [], []
    for run in runs:
        a, b = run["ranks"]
        for sender, receiver in ((a, b), (b, a)):
            for k, (s, t) in enumerate(zip(sender["saves"], receiver["saves"], strict=True)):
                if "bytes_sent" not in s or s.get("replicated") != s["tag"]:
                    raise RuntimeError(f"{s['tag']} of rank {sender['rank']} not replicated: {s}")
                if k == 0:
                    first_sent.append(s["bytes_sent"])
                    first_landed.append(t["wire_received"])
                else:
                    sent.append(s["bytes_sent"])
                    landed.append(t["wire_received"])
                    waits.append(s["answer_wait_s"])
                    within.append(s["answered_within_s"])
    return {
        "bytes_sent": _summary([float(x) for x in sent]),
        "bytes_landed": _summary([float(x) for x in landed]),
        "sent_vs_changed": statistics.median(sent) / changed,
        "landed_vs_changed": statistics.median(landed) / changed,
        "landed_vs_changed_max": max(landed) / changed,
        "first_bytes_sent": _summary([float(x) for x in first_sent]),
        "first_bytes_landed": _summary([float(x) for x in first_landed]),
        "answer_wait_s": _summary(waits),
        "answered_within_s": _summary(within),
    }


def _cpu_per_save(ranks: list[dict[str, Any]]) -> dict[str, float]:
    names = sorted({n for rk in ranks for n in rk["thread_cpu_s"]})
    out = {}
    for name in names:
        per = [rk["thread_cpu_s"].get(name, 0.0) / len(rk["saves"]) for rk in ranks]
        if max(per) > 0:
            out[name] = statistics.median(per)
    out["process"] = statistics.median(rk["process_cpu_s"] / len(rk["saves"]) for rk in ranks)
    return out


def run_recoveries(job: Job, args: argparse.Namespace, tier: str, url: str) -> dict[str, Any]:
    """Part 3 on one persistent tier: `--recoveries` restarts from each source."""
    from measure import drop_page_cache

    samples: list[dict[str, Any]] = []
    for r in range(args.recoveries):
        order = ("partner", "persistent") if r % 2 == 0 else ("persistent", "partner")
        for source in order:
            job.clear_memory()
            name = f"recovery-{tier}-{r}-{source}"
            root = f"{url}/{name}" if tier == "azurite" else str(job.work / name / "persistent")
            partner = source == "partner"
            config = {
                "out": str(job.work / name / "out"),
                "root": root,
                "replicas": 1 if partner else 0,
                "interval": 3600 if partner else 0,
                "state_bytes": args.state_mb * MB,
                "all_changed": False,
                "azure": tier == "azurite",
            }
            progress(f"recovery {tier} {r + 1}/{args.recoveries} from the {source}: saving ...")
            job.run("prepare", config, killed=True)
            shutil.rmtree(job.memory(1))  # node 1 is lost; a fresh node takes its place
            if tier == "local":
                drop_page_cache([Path(root)])
            elif job.azure_env.get("AZURITE_DATA"):
                drop_page_cache([Path(job.azure_env["AZURITE_DATA"])])
            progress("  restarting ...")
            out = job.run("restart", {**config, "replicas": 1 if partner else 0})
            ranks = [json.loads((out / f"restart-rank{k}.json").read_text()) for k in range(2)]
            for rk in ranks:
                if not rk["equal"] or rk["tag"] != f"global_step{RECOVERY_STEPS}":
                    raise RuntimeError(f"rank {rk['rank']} resumed wrongly: {rk}")
            persisted = _persist_rows(root, job.azure_env, f"global_step{RECOVERY_STEPS}")
            lost = ranks[1]
            progress(
                f"  node 1 resumed {lost['tag']} in {lost['total_s']:.2f} s "
                f"(init {lost['init_s']:.2f}, load {lost['load_s']:.2f}; {lost['phases']})"
            )
            samples.append({"repeat": r, "source": source, "ranks": ranks, "persisted": persisted})
            if tier == "local":
                shutil.rmtree(job.work / name / "persistent", ignore_errors=True)
    job.clear_memory()
    return recovery_figures(samples)


def _persist_rows(root: str, env: dict[str, str], tag: str) -> list[dict[str, Any]]:
    """The history's persistent rows of `tag` (each rank's persist of its part): what it
    wrote, what it took from the previous version, how long it took."""
    import nebulaml as nm

    options = {"connection_string": env[CONNECTION_ENV]} if CONNECTION_ENV in env else None
    df = nm.ops.read_history(root, storage_options=options, tag=tag)
    rows = df[(df["tier"] == "persistent") & (df["status"] == "ok")]
    return [
        {
            "rank": int(row["rank"]),
            "bytes_written": int(row["bytes_written"]),
            "bytes_reused": int(row["bytes_reused"]),
            "duration_s": float(row["duration_s"]),
        }
        for _, row in rows.iterrows()
    ]


PHASES = ("ring", "agree", "receive", "persist", "init_rest", "latest", "load")


def _phases(rank: dict[str, Any]) -> dict[str, float]:
    p = rank["phases"]
    recover = p.get("recover", 0.0)
    inner = p.get("receive", 0.0) + p.get("persist", 0.0)
    return {
        "ring": p.get("ring", 0.0),
        "agree": max(0.0, recover - inner),
        "receive": p.get("receive", 0.0),
        "persist": p.get("persist", 0.0),
        "init_rest": rank["init_s"] - p.get("ring", 0.0) - recover,
        "latest": rank["latest_s"],
        "load": rank["load_s"],
    }


def recovery_figures(samples: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {"samples": samples}
    for source in ("partner", "persistent"):
        mine = [s for s in samples if s["source"] == source]
        lost = [s["ranks"][1] for s in mine]
        job_total = [max(rk["total_s"] for rk in s["ranks"]) for s in mine]
        phases = {k: statistics.median(_phases(rk)[k] for rk in lost) for k in PHASES}
        received = [m[3] for rk in lost for m in rk["recovery"].get("received", [])]
        rows = [row for s in mine for row in s["persisted"]]
        out[source] = {
            "lost_node_s": _summary([rk["total_s"] for rk in lost]),
            "job_s": _summary(job_total),
            "phases_s": phases,
            "received_bytes": received[0] if received else 0,
            "loaded_from": sorted({t for rk in lost for t in rk["loaded_from"]}),
            # the persist of the resumed checkpoint, each rank's part: in the restart
            # (from the partner) or before the node was lost (from the persistent tier)
            "persist_written_bytes": statistics.median(r["bytes_written"] for r in rows)
            if rows
            else None,
            "persist_reused_bytes": statistics.median(r["bytes_reused"] for r in rows)
            if rows
            else None,
        }
    return out


def replica_costs(folder: Path, size: int, repeats: int = 3) -> dict[str, float]:
    """What a receiver's building of one replica file of `size` bytes costs this machine
    in CPU seconds (the least of `repeats`, one thread), as protocol/replicas.py's inbox
    does it: the bytes taken from the base replica's mapped file in its pieces and
    written into a new memory-tier file, or over an existing file's pages, and the whole
    file hashed with the checksum's hasher."""
    import mmap

    from nebulaml.format.checksum import new_hasher
    from nebulaml.protocol.replica_inbox import _COPY_BYTES

    folder.mkdir(parents=True, exist_ok=True)
    source, target = folder / "base", folder / "new"
    block = os.urandom(1 << 20)
    with open(source, "wb") as f:
        for at in range(0, size, len(block)):
            f.write(block[: min(len(block), size - at)])
    out: dict[str, float] = {}
    fd = os.open(source, os.O_RDONLY)
    try:
        with mmap.mmap(fd, size, prot=mmap.PROT_READ) as mm:
            view = memoryview(mm)

            def once(hashing: bool, writing: str) -> float:
                if writing == "new":
                    target.unlink(missing_ok=True)
                t0 = time.thread_time()
                hasher = new_hasher()
                with open(target, "r+b" if writing == "over" else "wb") as f:
                    for at in range(0, size, _COPY_BYTES):
                        piece = view[at : at + _COPY_BYTES]
                        if hashing:
                            hasher.update(piece)
                        if writing:
                            f.write(piece)
                hasher.hexdigest()
                return time.thread_time() - t0

            bytes(view)  # the base's pages are there, as a replica held is
            for name, hashing, writing in (
                ("hash_s", True, ""),
                ("write_new_file_s", False, "new"),
                ("write_over_file_s", False, "over"),
                ("hash_and_write_new_s", True, "new"),
            ):
                out[name] = min(once(hashing, writing) for _ in range(repeats))
            view.release()
    finally:
        os.close(fd)
        source.unlink(missing_ok=True)
        target.unlink(missing_ok=True)
    return {"bytes": float(size), **out}


@contextlib.contextmanager
def azurite(work: Path) -> Iterator[tuple[str, dict[str, str]] | str]:
    """An Azurite for the recovery's az:// root: (url, the children's environment), or why
    there is none."""
    sys.path.insert(0, str(REPO / "tests"))
    from azurite import STAGING_VERSION, VERSION, Azurite, binary

    version = STAGING_VERSION if binary(STAGING_VERSION) is not None else VERSION
    if binary(version) is None:
        yield "Azurite is not installed: run `make azurite`"
        return
    data = work / "azurite"
    server = Azurite(data, log_path=work / "azurite.log", version=version)
    server.start()
    try:
        server.create_container(AZURE_CONTAINER)
        env = {CONNECTION_ENV: server.connection_string, "AZURITE_DATA": str(data)}
        progress(f"Azurite {version} on 127.0.0.1:{server.port}")
        yield f"az://{AZURE_CONTAINER}", env
    finally:
        server.stop()


# ======================================================================================
# the report
# ======================================================================================
def _ms(s: dict[str, float]) -> str:
    return f"{s['median'] * 1e3:7.2f} / {s['p90'] * 1e3:7.2f}" if s else "      -"


def _mb(x: float) -> str:
    return f"{x / MB:.1f} MB"


def render(doc: dict[str, Any]) -> str:
    lines: list[str] = []
    w = lines.append
    for workload, fig in doc["loops"].items():
        state, changed = fig["state_bytes"], fig["changed_bytes"]
        none, rep = fig["replicas_0"], fig["replicas_1"]
        w(
            f"Training loop, {workload}: {_mb(state)} of state a rank (2 ranks, one a node), "
            f"{_mb(changed)} changed per step; a step {fig['step_s'] * 1e3:.0f} ms; "
            f"{none['leader']['stall_s']['n']} timed saves a rank of each mode, "
            f"persistent_time_interval {doc['args']['interval']} s"
        )
        w(
            "  ranks         replicas  save() ms median / p90   changed-copy saves ms   "
            "whole copies  cold ms  warm-up ms  run medians ms"
        )
        # Rank 0 and rank 1 apart: their saves differ (the module's docstring); a median
        # over both ranks falls in one cluster or the other (`all` in the JSON).
        for role in ("leader", "follower"):
            for label, f in (("0", none[role]), ("1", rep[role])):
                runs = " ".join(f"{x * 1e3:.1f}" for x in f["run_medians_s"])
                w(
                    f"  {role:<13} {label:<9} {_ms(f['stall_s']):<24} "
                    f"{_ms(f['changed_copy_stall_s']):<23} {f['whole_copies']:>11.0%} "
                    f"{f['cold_stall_s']['median'] * 1e3:8.1f} "
                    f"{f['warmup_stall_s']['median'] * 1e3:10.1f}  {runs}"
                )
            cpu = (none[role]["stall_cpu_s"]["median"], rep[role]["stall_cpu_s"]["median"])
            beside = rep[role]["replication_cpu_in_save_s"]["median"]
            threads = ", ".join(
                f"{name} {none[role]['threads_in_save_s'].get(name, 0.0) * 1e3:.2f} / "
                f"{ran * 1e3:.2f}"
                for name, ran in rep[role]["threads_in_save_s"].items()
            )
            tail = (none[role]["after_handoff_s"], rep[role]["after_handoff_s"])
            w(
                f"  {role:<13} the training thread's CPU in a save: {cpu[0] * 1e3:.2f} / "
                f"{cpu[1] * 1e3:.2f} ms; replication's threads ran {beside * 1e3:.2f} ms during "
                f"a save; from the commit's hand-off to the save's return "
                f"{tail[0]['median'] * 1e3:.3f} / {tail[1]['median'] * 1e3:.3f} ms (medians)"
            )
            queued = (none[role]["runqueue_wait_s"], rep[role]["runqueue_wait_s"])
            w(
                f"  {role:<13} the training thread waited for a CPU during a save: "
                f"{queued[0]['median'] * 1e3:.2f} / {queued[1]['median'] * 1e3:.2f} ms median, "
                f"{queued[0]['p90'] * 1e3:.2f} / {queued[1]['p90'] * 1e3:.2f} ms p90; "
                f"threads beside it during a save, ms (means): {threads}"
            )
            r = fig["stall_ratio"][role]
            ok = "PASS" if r["median"] <= STALL_TARGET else "FAIL"
            w(
                f"  {role:<13} ratio 1/0: median {r['median']:.3f} (target <= {STALL_TARGET}: "
                f"{ok}), p90 {r['p90']:.3f}"
            )
        wire = rep["wire"]
        w(
            f"  wire per checkpoint (median of {wire['bytes_sent']['n']}): sent "
            f"{wire['bytes_sent']['median'] / MB:.3f} MB ({wire['sent_vs_changed']:.3f}x the "
            f"changed bytes); landed at the partner {wire['bytes_landed']['median'] / MB:.3f} MB "
            f"({wire['landed_vs_changed']:.3f}x, max {wire['landed_vs_changed_max']:.3f}x); "
            f"a run's first replica: {wire['first_bytes_landed']['median'] / MB:.1f} MB landed"
        )
        if workload == "lora":
            ok = "PASS" if wire["landed_vs_changed"] <= WIRE_TARGET else "FAIL"
            w(
                f"  bytes landed / changed: {wire['landed_vs_changed']:.3f} (target <= "
                f"{WIRE_TARGET}: {ok})"
            )
        w(
            f"  a replica answered within {wire['answered_within_s']['median'] * 1e3:.0f} ms "
            f"of its save (median; p90 {wire['answered_within_s']['p90'] * 1e3:.0f}); the "
            f"harness waited for it after the next step: median "
            f"{wire['answer_wait_s']['median'] * 1e3:.0f} ms"
        )
        cpu0, cpu1 = none["cpu_per_save_s"], rep["cpu_per_save_s"]
        repl = {k: v for k, v in cpu1.items() if "replica" in k or "gloo" in k}
        w(
            f"  CPU per save a rank: process {cpu0['process'] * 1e3:.0f} ms without, "
            f"{cpu1['process'] * 1e3:.0f} ms with; replication's threads: "
            + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in repl.items())
        )
        for role in ("leader", "follower"):
            end = (none[role]["footprint_bytes"]["median"], rep[role]["footprint_bytes"]["median"])
            most = (
                none[role]["footprint_max_bytes"]["max"],
                rep[role]["footprint_max_bytes"]["max"],
            )
            held = rep[role]["replicas_bytes"]["median"]
            w(
                f"  memory tier of the {role}'s node after the loop: without {_mb(end[0])} "
                f"({end[0] / state:.2f}x the state), with {_mb(end[1])} ({end[1] / state:.2f}x; "
                f"its partner's replica {_mb(held)}); most between saves: {_mb(most[0])} / "
                f"{_mb(most[1])}"
            )
        w("")
    costs = doc.get("replica_costs")
    if costs:
        w(
            f"A receiver's build of one replica file of {_mb(costs['bytes'])}, CPU: hashing it "
            f"{costs['hash_s'] * 1e3:.1f} ms; writing it into a new memory-tier file "
            f"{costs['write_new_file_s'] * 1e3:.1f} ms, over an existing file's pages "
            f"{costs['write_over_file_s'] * 1e3:.1f} ms; both into a new file "
            f"{costs['hash_and_write_new_s'] * 1e3:.1f} ms"
        )
        w("")
    for tier, fig in doc["recovery"].items():
        if isinstance(fig, str):
            w(f"Recovery, persistent tier {tier}: {fig}")
            w("")
            continue
        p, q = fig["partner"], fig["persistent"]
        w(
            f"Recovery of node 1's part ({_mb(p['received_bytes'])}), persistent tier {tier}: "
            f"seconds from nm.init to get_latest_checkpoint() and both loads done, median "
            f"[min-max] of {p['lost_node_s']['n']}; node 1's phases (medians)"
        )
        w(
            "  from              node 1 s           job s  "
            + " ".join(f"{k:>9}" for k in PHASES)
            + "  loads from"
        )
        for label, f in (("the partner", p), ("persistent tier", q)):
            s = f["lost_node_s"]
            w(
                f"  {label:<17} {s['median']:5.2f} [{s['min']:.2f}-{s['max']:.2f}] "
                f"{f['job_s']['median']:6.2f}  "
                + " ".join(f"{f['phases_s'][k]:9.3f}" for k in PHASES)
                + f"  {','.join(f['loaded_from'])}"
            )
        if p["persist_written_bytes"] is not None:
            w(
                f"  the restart's persist of a rank's part: {_mb(p['persist_written_bytes'])} "
                f"written, {_mb(p['persist_reused_bytes'])} taken from the previous version"
            )
        w("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        return child_main(*argv[1:4])
    parser = argparse.ArgumentParser(
        prog="peer_replicas.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--state-mb", type=float, default=100, help="state of a rank, MB")
    parser.add_argument("--runs", type=int, default=3, help="loop runs of each (0 and 1)")
    parser.add_argument("--saves", type=int, default=8, help="timed saves a run")
    parser.add_argument(
        "--interval", type=float, default=3600, help="the loops' persistent_time_interval, seconds"
    )
    parser.add_argument("--recoveries", type=int, default=2, help="restarts of each source")
    parser.add_argument("--no-azure", action="store_true", help="no Azurite recovery")
    parser.add_argument("--no-all-changed", action="store_true", help="no all-changed loop")
    parser.add_argument(
        "--parts",
        nargs="+",
        default=["loop", "costs", "recovery"],
        choices=["loop", "costs", "recovery"],
    )
    parser.add_argument("--work", type=Path, help="work folder (default: a temporary one)")
    parser.add_argument("--json", type=Path, default=RESULTS / "peer-replicas.json")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(HERE))

    started = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="nebula-peers-", dir=args.work))
    shm = Path(tempfile.mkdtemp(prefix="nebula-peers-", dir="/dev/shm"))
    load_before = os.getloadavg()
    doc: dict[str, Any] = {"loops": {}, "recovery": {}}
    try:
        with contextlib.ExitStack() as stack:
            if "loop" in args.parts:
                job = Job(work, shm, {})
                for workload in ("lora", *(() if args.no_all_changed else ("all_changed",))):
                    doc["loops"][workload] = run_loops(job, args, workload)
            if "costs" in args.parts:
                doc["replica_costs"] = replica_costs(shm / "costs", int(args.state_mb * MB))
            if "recovery" in args.parts:
                doc["recovery"]["local"] = run_recoveries(Job(work, shm, {}), args, "local", "")
                if not args.no_azure:
                    az = stack.enter_context(azurite(work))
                    if isinstance(az, str):
                        doc["recovery"]["azurite"] = az
                    else:
                        url, env = az
                        doc["recovery"]["azurite"] = run_recoveries(
                            Job(work, shm, env), args, "azurite", url
                        )
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    doc["machine"] = {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "load_before": load_before,
        "load_after": os.getloadavg(),
    }
    doc["args"] = {k: str(v) for k, v in vars(args).items()}
    doc["duration_s"] = time.perf_counter() - started
    doc["date"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
    text = render(doc)
    print(text)
    print(
        f"({doc['duration_s']:.0f} s; load average before {load_before[0]:.2f}, after "
        f"{doc['machine']['load_after'][0]:.2f})"
    )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
