"""The node-loss campaign (issue #44): a job of 2 simulated nodes checkpointing every step
with `peer_replicas=1` loses a node at a random moment (its rank SIGKILLed, its memory
tier deleted: a fresh node replaces it), the job dies with it (the other node's rank
SIGKILLed too, its memory tier kept), and the whole job restarts; every restart must
resume, on every rank, a checkpoint no older than what the partner held, bit for bit.

A job is a sequence of incarnations on one persistent root: each is 2 ranks of
node_loss_worker.py, each a node of its own (LOCAL_WORLD_SIZE=1, GROUP_RANK, its own
NEBULA_MEMORY_TIER_PATH folder), meeting at a store this process serves (gloo on
127.0.0.1), as torchrun would restart them (TORCHELASTIC_RUN_ID the job's,
TORCHELASTIC_RESTART_COUNT the incarnation). Each incarnation gets a
`persistent_time_interval` of 3600 s (two in three: only the first checkpoint of an
incarnation and the one recovered reach the persistent tier) or 1 s. The campaign waits
for the incarnation to resume and train 0.2-4 s (or, for START_KILLS of the losses, to
join its process group, and 0-0.5 s more: in `nm.init`'s recovery), then SIGKILLs a
random node's rank, deletes that node's memory tier, SIGKILLs the other rank 0-0.5 s
after the first, records what the persistent tier holds (its newest committed step: what
a restart without replicas would resume) and starts the next incarnation. The last one
trains a little, is asked to stop (exit 0, its checkpoints persisted at `nm.shutdown`).

From each rank's own fsynced journal, for every restart (invariants; any break is a
failure, and the job's folder is kept under NODE_LOSS_CAMPAIGN_KEEP, default
/work/node-loss-failures, with the ranks' output):
- every rank resumes (within WAIT_S: no hang), and every rank the same step;
- that step is at or after the newest step every rank journalled as replicated (the
  partner held its part, verified) in the incarnation killed, and at or after the newest
  step the persistent tier held at the kill: a node's loss costs nothing the partner or
  the persistent tier held. An incarnation killed before it resumed keeps the bound of
  the restart before it when the same node is lost again (its partner still holds what
  it held); when the other node is lost, both nodes of the pair are gone before the
  recovery finished, and the persistent tier alone bounds it;
- that step is no newer than the newest step every rank began to save;
- what loads is that step's state on every rank, every item bit for bit (checked by the
  worker), and the job goes on: after the last restart it trains, stops, exits 0, and
  its root's latest checkpoint is its last acknowledged one, every item its step's state.
Figures: restarts, resumes at the newest acknowledged step (how far replication lags),
the steps lost with replicas against those a restart from the persistent tier alone
would have lost, the restart time (from the first SIGKILL to every rank resumed) and
`nm.init`'s (with the recovery). Each run also leaves in the keep folder, under its start
time: rounds.tsv (a row per restart), figures.json and every job's rank logs.

Not for: a chosen loss at a chosen point (tests/dist/test_peer_recovery.py), a rank
killed with its node's memory tier kept (elastic.py).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import warm
from campaigns import Figures, keep_failed, median_max, utc_clock
from node_loss_worker import check_loaded
from rendezvous import rendezvous

import nebulaml as nm
from nebulaml.format.names import REPLICA_DONE, REPLICAS_DIR, marker_name
from nebulaml.protocol.catalog import list_committed
from nebulaml.storage.store import Store

WORKER = Path(__file__).with_name("node_loss_worker.py")
NODES = 2  # one rank each
ROUNDS_PER_JOB = 5  # node losses per job (each job: a fresh root, a clean end)
PAUSE_S = 0.05  # between two steps
LONG_INTERVAL_S = 3600.0
SHORT_INTERVAL_S = 1.0
SHORT_INTERVALS = 1 / 3  # of the incarnations
START_KILLS = 0.15  # of the losses: while the incarnation starts (init, recovery, resume)
SURVIVOR_DELAY_S = 0.5  # the other node's rank is SIGKILLed up to this long after
WAIT_S = 180.0  # for an incarnation to start, resume, or end


def keep_folder() -> Path:
    return Path(os.environ.get("NODE_LOSS_CAMPAIGN_KEEP", "/work/node-loss-failures"))


# the journals ---------------------------------------------------------------------------
@dataclass
class Incarnation:
    """What the ranks of one incarnation journalled."""

    number: int
    pids: dict[int, int] = field(default_factory=dict)
    joined: set[int] = field(default_factory=set)  # in the process group: nm.init next
    # per rank: (step, wall clock, nm.init's seconds, the tag it received or "-", the
    # incarnation that saved the checkpoint it loaded or "-")
    resumed: dict[int, tuple[int, float, float, str, str]] = field(default_factory=dict)
    saves: dict[int, int] = field(default_factory=dict)  # newest step begun, per rank
    acks: dict[int, int] = field(default_factory=dict)  # newest step acknowledged
    replicated: dict[int, int] = field(default_factory=dict)
    durable: dict[int, int] = field(default_factory=dict)
    done: dict[int, int] = field(default_factory=dict)

    def all_resumed(self) -> bool:
        return len(self.resumed) == NODES

    def every_rank(self, per_rank: dict[int, int]) -> int:
        """The newest step every rank reached in `per_rank` (0: some rank none)."""
        return min((per_rank.get(r, 0) for r in range(NODES)), default=0)


def read_journals(folder: Path) -> dict[int, Incarnation]:
    """Every rank's journal, by incarnation (a torn last line is ignored)."""
    incarnations: dict[int, Incarnation] = {}
    for rank in range(NODES):
        path = folder / f"rank{rank}.journal"
        if not path.exists():
            continue
        current: Incarnation | None = None
        for line in path.read_text(errors="replace").splitlines():
            word, *rest = line.split() or [""]
            try:
                if word == "start":
                    number = int(rest[0])
                    current = incarnations.setdefault(number, Incarnation(number))
                    current.pids[rank] = int(rest[1])
                elif current is None:
                    continue
                elif word == "joined":
                    current.joined.add(rank)
                elif word == "resumed":
                    step, when, init_s, got, lineage = rest[:5]
                    current.resumed[rank] = (int(step), float(when), float(init_s), got, lineage)
                elif word in ("save", "ack", "replicated", "durable", "done"):
                    per_rank = {"save": current.saves, "ack": current.acks,
                                "replicated": current.replicated, "durable": current.durable,
                                "done": current.done}[word]  # fmt: skip
                    per_rank[rank] = max(per_rank.get(rank, 0), int(rest[0]))
            except (IndexError, ValueError):
                continue
    return incarnations


# one job ----------------------------------------------------------------------------------
@dataclass
class Loss:
    """One node lost: the incarnation it ended, the node, when, and what was left."""

    incarnation: int
    node: int
    wanted: str  # "start" (while the incarnation starts) or "training"
    at: float  # wall clock of the first SIGKILL
    survivor_delay_s: float
    persisted: int = 0  # the persistent tier's newest committed step once both were gone
    kept_own: list[int] = field(default_factory=list)  # the other node's own parts' steps
    kept_replica: list[int] = field(default_factory=list)  # its replicas of the lost rank


@dataclass
class Job:
    name: str
    folder: Path
    rounds: int
    rng: random.Random
    losses: list[Loss] = field(default_factory=list)
    intervals: dict[int, float] = field(default_factory=dict)  # per incarnation
    exit_codes: list[int | None] = field(default_factory=list)  # of the last incarnation
    errors: list[str] = field(default_factory=list)

    @property
    def root(self) -> Path:
        return self.folder / "root"

    @property
    def journals(self) -> Path:
        return self.folder / "journal"

    def memory(self, node: int) -> Path:
        return self.folder / "mem" / f"node{node}"

    def log(self, rank: int) -> Path:
        return self.folder / f"rank{rank}.log"


def newest_persisted(root: Path) -> int:
    """The persistent tier's newest committed step (0: none)."""
    try:
        committed = list_committed(Store(str(root)))
    except nm.NebulaError:
        return 0
    return max((int(c.tag.removeprefix("global_step")) for c in committed), default=0)


def _kept(memory: Path, rank: int, lost: int) -> tuple[list[int], list[int]]:
    """The steps of rank `rank`'s own committed parts in its node's memory tier
    `memory`, and of the whole replicas it keeps of rank `lost`'s."""

    def steps(pattern: str) -> list[int]:
        return sorted(int(p.parent.name.removeprefix("global_step")) for p in memory.glob(pattern))

    own = steps(f"*/global_step*/{marker_name(rank)}")
    return own, steps(f"*/{REPLICAS_DIR}/rank-{lost}/global_step*/{REPLICA_DONE}")


def _snapshot(job: Job, dst: Path) -> None:
    """Both nodes' memory tiers and the persistent tier as they are: every file's size,
    and copies of the small records (markers, manifests, replica records)."""
    lines = []
    bases = [("root", job.root), *((f"node{n}", job.memory(n)) for n in range(NODES))]
    for tier, base in bases:
        for path in sorted(base.rglob("*")) if base.exists() else []:
            try:
                if not path.is_file():
                    continue
                rel = path.relative_to(base)
                lines.append(f"{tier}/{rel} {path.stat().st_size}")
                if path.suffix in (".json", ".csv"):
                    target = dst / tier / rel
                    target.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(path, target)
            except OSError:
                continue
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "files.txt").write_text("\n".join(lines) + "\n")


def _env(job: Job, rank: int, incarnation: int, meeting: dict[str, str]) -> dict[str, str]:
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
            "MASTER_ADDR", "MASTER_PORT")  # fmt: skip
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in drop and not k.startswith(("TORCHELASTIC_", "NEBULA_"))
    }
    env.update(
        meeting,
        RANK=str(rank),
        WORLD_SIZE=str(NODES),
        LOCAL_RANK="0",
        LOCAL_WORLD_SIZE="1",
        GROUP_RANK=str(rank),
        TORCHELASTIC_RUN_ID=f"{job.name}-{os.getpid()}",
        TORCHELASTIC_RESTART_COUNT=str(incarnation),
        NEBULA_MEMORY_TIER_PATH=str(job.memory(rank)),
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
    )
    return env


def _wait_for(
    job: Job, what: str, ready: Callable[[], bool], procs: list[subprocess.Popen[bytes]]
) -> bool:
    """Until `ready()`; False (an error noted) if a rank ended or WAIT_S passed first."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        if ready():
            return True
        if any(p.poll() is not None for p in procs):
            codes = [p.poll() for p in procs]
            job.errors.append(f"a rank ended before {what} (exit codes {codes})")
            return False
        time.sleep(0.02)
    job.errors.append(f"{what}: not within {WAIT_S:.0f} s (a hang)")
    return False


def _incarnation(job: Job, number: int) -> Incarnation:
    return read_journals(job.journals).get(number, Incarnation(number))


def _lose_a_node(job: Job, number: int, procs: list[subprocess.Popen[bytes]]) -> None:
    """SIGKILL a random node's rank and delete its memory tier; then the other's rank."""
    rng = job.rng

    def joined() -> bool:
        return len(_incarnation(job, number).joined) == NODES

    def resumed() -> bool:
        return _incarnation(job, number).all_resumed()

    if number > 0 and rng.random() < START_KILLS:
        wanted = "start"  # in nm.init: the recovery of the loss before, mostly
        if not _wait_for(job, f"incarnation {number} joined", joined, procs):
            return
        time.sleep(rng.uniform(0.0, 0.5))
    else:
        wanted = "training"
        if not _wait_for(job, f"incarnation {number} resumed", resumed, procs):
            return
        time.sleep(rng.uniform(0.2, 4.0))
    node = rng.randrange(NODES)
    delay = rng.uniform(0.0, SURVIVOR_DELAY_S)
    at = time.time()
    procs[node].send_signal(signal.SIGKILL)
    procs[node].wait()
    if job.memory(node).exists():  # the node is gone: a fresh one replaces it
        shutil.rmtree(job.memory(node))
    time.sleep(max(0.0, at + delay - time.time()))
    for other, proc in enumerate(procs):
        if other != node and proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
    for proc in procs:
        proc.wait()
    loss = Loss(number, node, wanted, at, delay, newest_persisted(job.root))
    loss.kept_own, loss.kept_replica = _kept(job.memory(1 - node), 1 - node, node)
    job.losses.append(loss)
    _snapshot(job, job.folder / "snapshots" / f"loss{len(job.losses)}")


def _finish(job: Job, number: int, procs: list[subprocess.Popen[bytes]]) -> None:
    """The last incarnation: let it resume and train, ask it to stop, wait for its end."""

    def resumed() -> bool:
        return _incarnation(job, number).all_resumed()

    if _wait_for(job, f"incarnation {number} resumed", resumed, procs):
        time.sleep(job.rng.uniform(1.0, 2.0))
    (job.journals / "stop").touch()
    deadline = time.monotonic() + WAIT_S
    for proc in procs:
        try:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            job.errors.append(f"incarnation {number}: a rank did not exit within {WAIT_S:.0f} s")
    job.exit_codes = [proc.poll() for proc in procs]


def run_job(job: Job) -> None:
    """Every incarnation of one job: `job.rounds` node losses, then a clean end."""
    job.journals.mkdir(parents=True)
    for number in range(job.rounds + 1):
        interval = SHORT_INTERVAL_S if job.rng.random() < SHORT_INTERVALS else LONG_INTERVAL_S
        job.intervals[number] = interval
        logs: list[IO[bytes]] = [open(job.log(r), "ab") for r in range(NODES)]  # noqa: SIM115
        procs: list[subprocess.Popen[bytes]] = []
        try:
            with rendezvous(NODES) as meeting:
                for rank in range(NODES):
                    argv = [sys.executable, str(WORKER), str(job.root), str(job.journals),
                            str(interval), str(PAUSE_S)]  # fmt: skip
                    env = _env(job, rank, number, meeting)
                    procs.append(warm.Popen(argv, env=env, stdout=logs[rank],
                                            stderr=subprocess.STDOUT))  # fmt: skip
                if number < job.rounds:
                    _lose_a_node(job, number, procs)
                else:
                    _finish(job, number, procs)
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
            for log in logs:
                log.close()
        if job.errors:
            return


# the checks -------------------------------------------------------------------------------
@dataclass
class Tally:
    restart_s: list[float] = field(default_factory=list)  # first SIGKILL -> every rank resumed
    init_s: list[float] = field(default_factory=list)  # nm.init with the recovery, per rank
    rows: list[str] = field(default_factory=list)


def check_job(job: Job, figures: Figures, tally: Tally) -> list[str]:
    """The invariants of the module's docstring, from the journals; the failures."""
    failures = [f"{job.name}: {e}" for e in job.errors]
    incs = read_journals(job.journals)
    # Per rank, on the job's timeline (a restart goes on from the step it resumed): the
    # newest step it began to save, and the newest it acknowledged.
    began = {r: 0 for r in range(NODES)}
    acked = {r: 0 for r in range(NODES)}
    bound = 0  # the lower bound of the restart before, carried over a start-up loss
    last_victim: int | None = None
    for loss in job.losses:
        k = loss.incarnation
        inc = incs.get(k, Incarnation(k))
        for r in range(NODES):
            if r in inc.resumed:
                began[r] = acked[r] = inc.resumed[r][0]
            began[r] = inc.saves.get(r, began[r])
            acked[r] = inc.acks.get(r, acked[r])
        trained = inc.all_resumed() and max(w for _s, w, *_ in inc.resumed.values()) < loss.at
        phase = "training" if trained else "start"
        if trained:
            replicated = inc.every_rank(inc.replicated)
            held = replicated
        elif k > 0 and loss.node == last_victim:
            replicated, held = 0, bound  # the same node again: its partner holds as before
        else:
            replicated, held = 0, 0
            if k > 0:
                figures.add("both nodes lost before a recovery finished")
        bound = max(held, loss.persisted)
        last_victim = loss.node
        newest_acked, newest_begun = min(acked.values()), min(began.values())
        figures.add(f"losses while {phase}")
        figures.add(f"losses of node {loss.node}")
        nxt = incs.get(k + 1, Incarnation(k + 1))
        lost_again = any(x.incarnation == k + 1 for x in job.losses)
        if not nxt.all_resumed():
            if lost_again and not job.errors:
                figures.add("restarts lost before every rank resumed")
            else:
                failures.append(f"{job.name}: incarnation {k + 1} never resumed on every "
                                f"rank after node {loss.node} was lost")  # fmt: skip
            if not nxt.resumed:
                continue
        figures.add("restarts checked")
        steps = sorted({s for s, *_ in nxt.resumed.values()})
        resumed = steps[0]
        back_s = math.nan
        if nxt.all_resumed():
            back_s = max(w for _s, w, *_ in nxt.resumed.values()) - loss.at
            tally.restart_s.append(back_s)
            tally.init_s.extend(i for _s, _w, i, *_ in nxt.resumed.values())
        received = sorted(r for r, (_s, _w, _i, got, _l) in nxt.resumed.items() if got != "-")
        if received:
            figures.add("restarts with a part sent back")
        if len(steps) > 1:
            figures.add("ranks resumed different steps")
            failures.append(f"{job.name}: after loss {k + 1} the ranks resumed {steps}")
        failures += _saved_whole(job, incs, nxt, figures)
        if resumed < bound:
            figures.add("resumed behind the replicated or persisted")
            failures.append(
                f"{job.name}: after node {loss.node} was lost (incarnation {k}, while "
                f"{phase}) the job resumed step {resumed}, behind step {bound} (replicated "
                f"by every rank: {replicated}; persisted: {loss.persisted}; the other node "
                f"kept its own parts of steps {loss.kept_own} and rank {loss.node}'s "
                f"replicas of steps {loss.kept_replica})"
            )
            if loss.kept_replica and not set(loss.kept_replica) & set(loss.kept_own):
                figures.add("behind: own part of replicated step gone")
        if steps[-1] > newest_begun:
            figures.add("resumed a step not every rank began")
            failures.append(
                f"{job.name}: after loss {k + 1} the job resumed step {steps[-1]}, newer "
                f"than every rank began ({newest_begun})"
            )
        if resumed == newest_acked:
            figures.add("resumed the newest acknowledged")
        elif resumed > newest_acked:
            figures.add("resumed a step not yet acknowledged")
        else:
            figures.add("resumed behind the newest acknowledged")
        if trained:
            if resumed >= replicated:
                figures.add("resumed at or after the newest replicated")
            figures.add("steps lost, with replicas", max(0, newest_acked - resumed))
            figures.add("steps lost, persistent tier alone",
                        max(0, newest_acked - loss.persisted))  # fmt: skip
            if loss.persisted < newest_acked:
                figures.add("restarts set back, persistent tier alone")
            if resumed < newest_acked:
                figures.add("restarts set back, with replicas")
        tally.rows.append(
            f"{job.name}\t{k}\t{loss.node}\t{utc_clock(loss.at)}\t{phase}\t"
            f"{job.intervals.get(k, math.nan):g}\t{newest_begun}\t{newest_acked}\t"
            f"{replicated}\t{loss.persisted}\t{steps}\t{received}\t{back_s:.2f}\t"
            f"{loss.kept_own}\t{loss.kept_replica}"
        )
    figures.add("restarts", len(job.losses))
    for rank in range(NODES):
        path = job.journals / f"results-rank{rank}.txt"
        for line in path.read_text().splitlines() if path.exists() else []:
            if line.startswith("FAIL"):
                figures.add("torn or failed resumes" if "torn" in line else "worker failures")
                failures.append(f"{job.name} rank {rank}: {line}")
            elif line.startswith("OK"):
                figures.add("resumes loaded and checked (per rank)")
    if not job.errors:
        failures += _check_end(job, incs, figures)
    return failures


def _saved_whole(
    job: Job, incs: dict[int, Incarnation], inc: Incarnation, figures: Figures
) -> list[str]:
    """Whether what `inc`'s ranks loaded at their resume was saved whole by the
    incarnation its `meta` names: every rank of it began saving that step."""
    failures = []
    for rank, (step, _w, _i, _got, lineage) in sorted(inc.resumed.items()):
        if step == 0:
            continue
        saver = incs.get(int(lineage)) if lineage.isdigit() else None
        if saver is None or any(
            saver.saves.get(r, 0) < step or saver.resumed.get(r, (step,))[0] >= step
            for r in range(NODES)
        ):
            figures.add("resumed a checkpoint not saved whole")
            failures.append(f"{job.name}: rank {rank} of incarnation {inc.number} loaded "
                            f"step {step} as saved by incarnation {lineage}, which did not "
                            "save it on every rank")  # fmt: skip
    return failures


def _check_end(job: Job, incs: dict[int, Incarnation], figures: Figures) -> list[str]:
    """After the job's clean end: it went on training, exited 0, and its root's latest
    checkpoint is the last acknowledged one, every item its step's state."""
    failures = []
    last = incs.get(job.rounds, Incarnation(job.rounds))
    if job.exit_codes != [0] * NODES:
        failures.append(f"{job.name}: the last incarnation exited {job.exit_codes}")
    acked = last.every_rank(last.acks)
    resumed = max((s for s, *_ in last.resumed.values()), default=0)
    if acked <= resumed:
        failures.append(f"{job.name}: the job did not go on after its last restart "
                        f"(resumed {resumed}, acknowledged {acked})")  # fmt: skip
    listed = list_committed(Store(str(job.root)))
    newest = max(listed, key=lambda c: int(c.tag.removeprefix("global_step")), default=None)
    if newest is None or newest.tag != f"global_step{acked}":
        figures.add("latest is not the last acknowledged")
        failures.append(
            f"{job.name}: after the job the latest is {newest.tag if newest else None}, "
            f"the last acknowledged {acked}"
        )
        return failures
    os.environ["NEBULA_MEMORY_TIER_PATH"] = str(job.folder / "reader")
    try:
        handle = nm.get_checkpoint(newest.tag, persist_path=str(job.root))
        if handle is None:
            failures.append(f"{job.name}: {newest.tag} did not open")
            return failures
        with handle:
            lineage, problems = check_loaded(handle, acked, NODES)
        if lineage != job.rounds:
            problems.append(f"{newest.tag} was saved by incarnation {lineage}, not the last")
    finally:
        os.environ.pop("NEBULA_MEMORY_TIER_PATH", None)
    figures.add("final checkpoints checked")
    if problems:
        figures.add("torn final checkpoints")
        failures.extend(f"{job.name}: {p}" for p in problems)
    return failures


def _keep(job: Job, stamp: str, failures: list[str]) -> None:
    """A failed job's folder (root, both memory tiers, journals, snapshots, the ranks'
    output) under the keep folder, for diagnosis."""
    losses = [
        f"incarnation {x.incarnation}: node {x.node} lost at {utc_clock(x.at)} (aimed at its "
        f"{x.wanted}; the other SIGKILLed {x.survivor_delay_s:.2f} s later); persisted "
        f"then: step {x.persisted}"
        for x in job.losses
    ]
    keep_failed(job.folder, keep_folder() / stamp / job.name, failures, {"losses.txt": losses})


def node_loss_campaign(work: Path, rounds: int, seed: int = 0) -> Figures:
    """`rounds` node losses in all, in jobs of ROUNDS_PER_JOB; see the module docstring."""
    figures = Figures("node loss")
    rng = random.Random(seed)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    tally = Tally()
    for n in range(math.ceil(rounds / ROUNDS_PER_JOB)):
        size = min(ROUNDS_PER_JOB, rounds - n * ROUNDS_PER_JOB)
        job = Job(f"job{n}", work / f"job{n}", size, random.Random(rng.random()))
        run_job(job)
        failures = check_job(job, figures, tally)
        figures.failures.extend(failures)
        if failures:
            _keep(job, stamp, failures)
        with contextlib.suppress(OSError):  # the ranks' output, for the report
            logs = keep_folder() / stamp / "logs"
            logs.mkdir(parents=True, exist_ok=True)
            for rank in range(NODES):
                shutil.copy2(job.log(rank), logs / f"{job.name}-rank{rank}.log")
        shutil.rmtree(job.folder, ignore_errors=True)
    median_max(figures, "restart", tally.restart_s)
    median_max(figures, "nm.init with the recovery", tally.init_s)
    for key in ("resumed behind the replicated or persisted",
                "ranks resumed different steps", "torn or failed resumes",
                "resumed a step not every rank began", "resumed a checkpoint not saved whole",
                "steps lost, with replicas",
                "steps lost, persistent tier alone"):  # fmt: skip
        figures.counts.setdefault(key, 0)
    table = keep_folder() / stamp / "rounds.tsv"
    with contextlib.suppress(OSError):
        table.parent.mkdir(parents=True, exist_ok=True)
        header = ("job\tincarnation lost\tnode\tlost at (UTC)\tphase\tpersist interval s\t"
                  "begun by all\tacknowledged by all\treplicated by all\tpersisted\t"
                  "resumed\tranks that received\trestart s\tother node's own parts\t"
                  "its replicas of the lost rank\n")  # fmt: skip
        table.write_text(header + "\n".join(tally.rows) + "\n")
        (table.parent / "figures.json").write_text(json.dumps(figures.counts, indent=1))
    return figures
