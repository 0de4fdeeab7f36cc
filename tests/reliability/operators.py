"""The operators campaign (issue #18, cases 3 and 4): operator commands against a training
job, in a loop, while the job is SIGKILLed and restarted now and then.

A training child (two_jobs.TRAINER: a save after every step, persisted as soon as the
persister is free, retention 2; each save journalled once it returned) runs on a root
while threads here, as operators on the same node, run over and over:

    copy     the newest checkpoint to the persistent tier (`nebula copy ROOT --latest
             persistent`: the tag the trainer's persister may be persisting), and to
             another root; now and then through the `nebula` command itself
    flush    `nebula flush ROOT`: the memory tier's newest to the persistent tier
    prune    keep 1 to 3
    verify   every checkpoint of the root, both tiers
    readers  `get_latest_checkpoint` (or `get_checkpoint` of a listed tag), a pause, then
             a load of both items: the handle holds its checkpoint meanwhile

Each round the trainer trains for a few seconds, then is SIGKILLed; the next round's
trainer takes its hold over and resumes.

Invariants (any break is a failure):
- the trainer's saves never fail ("errors in the trainer": an operator never makes a
  running trainer's save raise);
- no acknowledged checkpoint is lost (after each kill the newest checkpoint is at least
  the newest acknowledged one and loads with its journalled state);
- a reader whose handle the library gave it loads it ("readers failed by retention");
- a verify finds nothing corrupt.
An operator's own failure (a copy whose source was deleted before it began, say) is
counted by kind, not a failure.

Not for: unit tests of the cooperation (tests/core/test_cowriters.py, test_handles.py).
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

from campaigns import Figures
from two_jobs import TRAINER, Trainer, check_acknowledged

import nebulaml as nm
from nebulaml.ops.pruning import execute_prune, list_prune_candidates, plan_prune

NEBULA = Path(sys.executable).parent / "nebula"


class Operators:
    """The operator threads of one campaign, and what they counted."""

    def __init__(self, root: Path, backup: Path, env: dict[str, str], seed: int) -> None:
        self.root, self.backup, self.env, self.seed = str(root), str(backup), env, seed
        self.counts: Counter[str] = Counter()
        self.failures: list[str] = []
        self.cli_runs = 0
        self.said: list[str] = []  # what failed operator commands said (not failures)
        self._lock = threading.Lock()

    def add(self, key: str, n: int = 1) -> None:
        with self._lock:
            self.counts[key] += n

    def fail(self, key: str, what: str) -> None:
        with self._lock:
            self.counts[key] += 1
            self.failures.append(f"seed {self.seed}: {what}")

    def operator_error(self, what: str, exc: BaseException) -> None:
        self.add(f"operator errors: {what} {type(exc).__name__}")

    # the operators ----------------------------------------------------------------------
    def copy(self, rng: random.Random) -> None:
        dest = "persistent" if rng.random() < 0.7 else self.backup
        if dest == "persistent" and self.cli_runs < 3 and rng.random() < 0.1:
            self.cli_runs += 1
            command = [str(NEBULA), "copy", self.root, "--latest", dest, "-q"]
            done = subprocess.run(command, env=self.env, capture_output=True, text=True,
                                  timeout=300, check=False)  # fmt: skip
            self.add("copies (nebula copy)")
            if done.returncode != 0:
                self.add(f"operator errors: nebula copy exit {done.returncode}")
                self.said.append(done.stderr.strip()[-300:])
            return
        try:
            nm.copy_checkpoint(self.root, None, dest, overwrite=dest != "persistent")
        except nm.NebulaError as exc:
            self.operator_error("copy", exc)
            return
        self.add("copies to the persistent tier" if dest == "persistent" else "copies elsewhere")

    def flush(self, _rng: random.Random) -> None:
        try:
            nm.persist_memory_tier(self.root)
        except nm.NebulaError as exc:
            self.operator_error("flush", exc)
            return
        self.add("flushes")

    def prune(self, rng: random.Random) -> None:
        try:
            plan = plan_prune(list_prune_candidates(self.root), rng.randint(1, 3))
            result = execute_prune(self.root, plan)
        except nm.NebulaError as exc:
            self.operator_error("prune", exc)
            return
        self.add("prunes")
        self.add("tags pruned", len(result.deleted))

    def verify(self, _rng: random.Random) -> None:
        try:
            results = nm.verify_checkpoints(self.root)
        except nm.NebulaError as exc:
            self.operator_error("verify", exc)
            return
        self.add("verifies")
        for result in results:
            if result["status"] == "corrupt":
                self.fail("verify found corrupt", f"verify: {result}")
            else:
                self.add(f"verify results {result['status']}")

    def read(self, rng: random.Random) -> None:
        how = "latest"
        if rng.random() < 0.5:
            handle = nm.get_latest_checkpoint(self.root)
        else:
            how = "listed"
            listed = nm.list_checkpoints(self.root)
            if not listed:
                return
            handle = nm.get_checkpoint(rng.choice(listed)["tag"], self.root)
            if handle is None:
                self.add("listed tags gone before get_checkpoint")
                return
        if handle is None:
            return
        with handle:
            time.sleep(rng.uniform(0.0, 0.8))  # the caller does something else first
            try:
                handle.load("model")
                handle.load("optimizer")
            except nm.CheckpointNotFoundError as exc:
                self.fail("readers failed by retention", f"{how} {handle.tag}: {exc}")
                return
            except nm.NebulaError as exc:
                self.fail("readers failed otherwise", f"{how} {handle.tag}: {exc!r}")
                return
        self.add("reads correct")

    def loop(self, what: str, stop: threading.Event, n: int) -> None:
        rng = random.Random(self.seed * 100 + n)
        act = getattr(self, what)
        while not stop.is_set():
            try:
                act(rng)
            except Exception as exc:  # noqa: BLE001 - a failure of the campaign's invariants
                self.fail("operator crashed", f"{what}: {exc!r}")
            stop.wait(rng.uniform(0.0, 0.1))


def operators_campaign(work: Path, rounds: int, seed: int = 0) -> Figures:
    """`rounds` rounds of a trainer, SIGKILLed after a few seconds, with operators at work
    on its root all along; see the module docstring."""
    figures = Figures("operators")
    rng = random.Random(seed)
    work.mkdir(parents=True, exist_ok=True)
    script, root, backup = work / "trainer.py", work / "root", work / "backup"
    script.write_text(TRAINER)
    os.environ["NEBULA_MEMORY_TIER_PATH"] = str(work / "mem")  # one node: one memory tier
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    for var in ("NEBULA_JOB_ID", "TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    ops = Operators(root, backup, env, seed)
    journals: list[Path] = []
    stop = threading.Event()
    threads = [
        threading.Thread(target=ops.loop, args=(what, stop, n), daemon=True)
        for n, what in enumerate(("copy", "copy", "flush", "prune", "verify", "read", "read"))
    ]
    try:
        for n in range(rounds):
            journal = work / f"journal-{n}.txt"
            journals.append(journal)
            trainer = Trainer(script, root, journal, work / f"out-{n}.txt", env,
                              interval=0.0, pause=0.02)  # fmt: skip
            state = trainer.started()
            if state != "READY":
                figures.failures.append(f"seed {seed} round {n}: the trainer did not start: "
                                        f"{trainer.output[-1500:]}")  # fmt: skip
                trainer.kill()
                continue
            if n == 0:
                for thread in threads:
                    thread.start()
            time.sleep(rng.uniform(2.0, 5.0))
            errors = trainer.errors()
            figures.add("errors in the trainer", len(errors))
            figures.failures.extend(f"seed {seed} round {n}: {e}" for e in errors[:3])
            trainer.kill()
            figures.add("kills")
            figures.add("saves", len(journal.read_text().splitlines()) if journal.exists() else 0)
            check_acknowledged(root, journals, figures, f"seed {seed} round {n}")
    finally:
        stop.set()
        for thread in threads:
            if thread.is_alive():
                thread.join(120)
    for key, value in ops.counts.items():
        figures.add(key, value)
    figures.failures.extend(ops.failures)
    for key in ("errors in the trainer", "acknowledged checkpoints lost",
                "readers failed by retention", "latest failed to load"):  # fmt: skip
        figures.counts.setdefault(key, 0)
    os.environ.pop("NEBULA_MEMORY_TIER_PATH", None)
    return figures
