"""The two-jobs campaign (issue #18, case 2): two training jobs started on one root, again
and again; one job writes a root at a time.

Each round starts a training job (a child process that saves one checkpoint after another
and journals each one once its save returned, fsynced: the ground truth of what was
acknowledged) and, at a random moment, or at the very same moment, a second job with
another identity on the same root. Then the job that runs is SIGKILLed or SIGTERMed at a
random time; the next round's jobs take its hold over.

Invariants (any break is a failure):
- of two jobs on one root, exactly one runs: the other's `init` is refused
  (`RootInUseError`), before it saves anything ("both jobs ran", "neither job ran");
- no acknowledged checkpoint is lost: after each round the newest checkpoint of the root
  is at least the newest acknowledged one, and loads with the state journalled for it;
- a job whose predecessor was killed starts (its hold is taken over), and resumes from the
  newest checkpoint.

Not for: unit tests of the holds (tests/core/test_two_jobs.py).
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time
from pathlib import Path

import warm
from campaigns import Figures, _digest_of

import nebulaml as nm

TRAINER = """
import hashlib, os, sys, time, torch
import nebulaml as nm

root, journal, interval, pause = sys.argv[1], sys.argv[2], float(sys.argv[3]), float(sys.argv[4])
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)


def digest():
    h = hashlib.sha256()
    for sd in (model.state_dict(), opt.state_dict()["state"]):
        for key in sorted(sd, key=str):
            value = sd[key]
            for t in (value.values() if isinstance(value, dict) else [value]):
                if isinstance(t, torch.Tensor):
                    h.update(t.detach().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


try:
    nm.init(root, persistent_time_interval=interval, num_of_version_in_retention=2)
except nm.RootInUseError as exc:
    print("REFUSED", exc, flush=True)
    sys.exit(3)
step = 0
latest = nm.get_latest_checkpoint()
if latest is not None:
    with latest:
        model.load_state_dict(latest.load("model"))
        opt.load_state_dict(latest.load("optimizer"))
    step = int(latest.tag.removeprefix("global_step"))
print("READY", step, flush=True)
gen = torch.Generator().manual_seed(step)
while True:
    step += 1
    model(torch.randn(16, 64, generator=gen)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
    saved = digest()
    try:
        ckpt = nm.Checkpoint(f"global_step{step}", 2)
        ckpt.save("model", model.state_dict())
        ckpt.save("optimizer", opt.state_dict())
        nm.wait_for_snapshot()  # committed: a lazy save (the default) commits in the background
    except nm.NebulaError as exc:
        print("ERROR", type(exc).__name__, str(exc).replace("\\n", " "), flush=True)
        time.sleep(pause)
        continue
    with open(journal, "a") as f:  # acknowledged: written only once it is committed
        f.write(f"{step} {saved}\\n")
        f.flush()
        os.fsync(f.fileno())
    time.sleep(pause)
"""


class Trainer:
    """One training job (TRAINER) with its journal; stdout kept in a file."""

    def __init__(self, script: Path, root: Path, journal: Path, out: Path, env: dict[str, str],
                 interval: float = 0.2, pause: float = 0.01) -> None:  # fmt: skip
        self.journal, self.out_path = journal, out
        self._out = open(out, "wb")  # noqa: SIM115 - closed by wait()/kill()
        self.proc = warm.Popen(
            [sys.executable, "-W", "ignore", str(script), str(root), str(journal),
             str(interval), str(pause)],
            env=env, stdout=self._out, stderr=subprocess.STDOUT,
        )  # fmt: skip

    @property
    def output(self) -> str:
        return self.out_path.read_text(errors="replace")

    def started(self, timeout_s: float = 120) -> str:
        """Once known: "READY", "REFUSED", or "EXITED" (it ended otherwise)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            text = self.output
            if "READY" in text:
                return "READY"
            if "REFUSED" in text:
                self.proc.wait(timeout=60)
                return "REFUSED"
            if self.proc.poll() is not None:
                return "EXITED"
            time.sleep(0.02)
        self.kill()
        return "EXITED"

    def kill(self, how: int = 9) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(how)
        try:
            rc = self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rc = self.proc.wait()
        self._out.close()
        return rc

    def errors(self) -> list[str]:
        return [line for line in self.output.splitlines() if line.startswith("ERROR")]


def acknowledged(journals: list[Path]) -> tuple[int, str] | None:
    """The newest acknowledged (step, digest) of every journal."""
    best: tuple[int, str] | None = None
    for journal in journals:
        if not journal.exists():
            continue
        for line in journal.read_text().splitlines():
            parts = line.split()
            if len(parts) == 2 and (best is None or int(parts[0]) >= best[0]):
                best = (int(parts[0]), parts[1])
    return best


def check_acknowledged(root: Path, journals: list[Path], figures: Figures, where: str) -> None:
    """The newest acknowledged checkpoint is there, and loads with its journalled state."""
    acked = acknowledged(journals)
    if acked is None:
        return
    step, digest = acked
    latest = nm.get_latest_checkpoint(str(root))
    if latest is None or int(latest.tag.removeprefix("global_step")) < step:
        figures.add("acknowledged checkpoints lost")
        figures.failures.append(f"{where}: step {step} acknowledged, latest {latest}")
        return
    with latest:
        try:
            state = _digest_of(latest.load("model"), latest.load("optimizer"))
        except nm.NebulaError as exc:
            figures.add("latest failed to load")
            figures.failures.append(f"{where}: {latest.tag} failed to load: {exc}")
            return
    if latest.tag == f"global_step{step}" and state != digest:
        figures.add("acknowledged state differs")
        figures.failures.append(f"{where}: {latest.tag} loads other state than acknowledged")
    figures.add("acknowledged checkpoints checked")


def two_jobs_campaign(work: Path, rounds: int, seed: int = 0) -> Figures:
    """`rounds` rounds of two jobs on one root; see the module docstring."""
    figures = Figures("two jobs")
    rng = random.Random(seed)
    work.mkdir(parents=True, exist_ok=True)
    script, root = work / "trainer.py", work / "root"
    script.write_text(TRAINER)
    # One node: the jobs and this process share the root's memory tier.
    os.environ["NEBULA_MEMORY_TIER_PATH"] = str(work / "mem")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    for var in ("NEBULA_JOB_ID", "TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    journals: list[Path] = []
    for n in range(rounds):
        where = f"seed {seed} round {n}"

        def start(who: str, n: int = n) -> Trainer:
            journal = work / f"journal-{n}-{who}.txt"
            journals.append(journal)
            return Trainer(script, root, journal, work / f"out-{n}-{who}.txt", env)

        together = n % 3 == 2  # every third round: both jobs start at the very same time
        first = start("a")
        if together:
            second = start("b")
        else:
            first_state = first.started()
            if first_state != "READY":
                figures.failures.append(f"{where}: the first job did not start: "
                                        f"{first.output[-1500:]}")  # fmt: skip
                first.kill()
                continue
            time.sleep(rng.uniform(0.0, 1.0))
            second = start("b")
        states = {"a": first.started(), "b": second.started()}
        figures.add("rounds")
        figures.add("rounds started together" if together else "rounds started one after")
        running = [t for who, t in (("a", first), ("b", second)) if states[who] == "READY"]
        refused = [who for who, state in states.items() if state == "REFUSED"]
        figures.add("second job refused", len(refused))
        if len(running) > 1:
            figures.add("both jobs ran")
            figures.failures.append(f"{where}: both jobs ran on one root")
        elif not running:
            figures.add("neither job ran")
            outputs = first.output[-800:] + second.output[-800:]
            figures.failures.append(f"{where}: neither job ran: {states} {outputs}")
        if "EXITED" in states.values():
            figures.failures.append(f"{where}: a job ended otherwise: {states}")
        time.sleep(rng.uniform(0.3, 2.0))  # training
        for trainer in running:
            errors = trainer.errors()
            figures.add("errors in the trainer", len(errors))
            figures.failures.extend(f"{where}: {e}" for e in errors[:3])
        how = 15 if rng.random() < 0.3 else 9
        figures.add("jobs SIGTERMed" if how == 15 else "jobs SIGKILLed")
        for trainer in (first, second):
            trainer.kill(how)
        check_acknowledged(root, journals, figures, where)
    for key in ("both jobs ran", "neither job ran", "acknowledged checkpoints lost",
                "errors in the trainer", "latest failed to load"):  # fmt: skip
        figures.counts.setdefault(key, 0)
    os.environ.pop("NEBULA_MEMORY_TIER_PATH", None)
    return figures
