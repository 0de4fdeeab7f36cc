"""The concurrency campaign: saves, loads, prune and retention interleaved on one root.

Three actors on one node share a persistent root and its memory tier:

    saver   a child process that trains: it saves global_step1..N (retention 2, persist
            interval 0, so its persister copies, applies retention and evicts the memory
            tier after every save) while a thread of it loads random committed tags
    reader  a second child process: loads random committed tags from both tiers and
            prunes the root (keep 1, leftovers with grace 0) now and then
    here    loader threads, a pruner thread (the API, and `nebula prune` now and then),
            and a watcher thread that lists the root over and over

Invariants (any break is a failure, named with the seed):
- the newest committed checkpoint on the root is never deleted (the watcher; and a load
  of the newest that finds it gone must find a newer one);
- a save in flight is never deleted: every save commits, every persist succeeds, and the
  last save is committed on the root at the end, with its data ("saves lost");
- a load under a read lease (the campaign holds one around both items, slowly) returns
  the data saved for that step; a plain load returns it or `CheckpointNotFoundError`
  (deleted before the read began), never another error or other data ("loads failed
  because deleted while read").

Run as a script, this module is a child: `python concurrency.py saver|reader ...`.

Not for: unit tests of the lease protocol (tests/core/test_leases.py).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from campaigns import Figures

import nebulaml as nm
from nebulaml.format.names import step_of
from nebulaml.ops.pruning import BEING_READ
from nebulaml.protocol.catalog import list_committed, read_committed
from nebulaml.protocol.leases import read_lease
from nebulaml.storage.store import Store

ITEMS = ("model", "optimizer")
NEBULA = Path(sys.executable).parent / "nebula"


def expected(step: int, item: str) -> dict[str, Any]:
    """What every step saves: tensors filled with the step number, so any mix-up shows."""
    if item == "model":
        return {"w": torch.full((16384,), float(step)), "step": step}
    return {"m": torch.full((4096,), -float(step)), "step": step}


def _same(got: Any, want: dict[str, Any]) -> bool:
    return (
        isinstance(got, dict)
        and got.keys() == want.keys()
        and all(
            torch.equal(got[k], v) if isinstance(v, torch.Tensor) else got[k] == v
            for k, v in want.items()
        )
    )


class Actor:
    """Loads and prunes on one root, counting what happened (thread-safe)."""

    def __init__(self, root: str, seed: int, who: str) -> None:
        self.root, self.seed, self.who = root, seed, who
        self.rng = random.Random(seed)
        self.counts: Counter[str] = Counter()
        self.failures: list[str] = []
        self._lock = threading.Lock()

    def add(self, key: str, n: int = 1) -> None:
        with self._lock:
            self.counts[key] += n

    def fail(self, key: str, what: str) -> None:
        with self._lock:
            self.counts[key] += 1
            self.failures.append(f"seed {self.seed} ({self.who}): {what}")

    def pick(self, rng: random.Random) -> tuple[str, list[str], bool] | None:
        """A committed tag (the newest one time in three), its tiers, and whether it was
        the newest when picked."""
        listed = nm.list_checkpoints(self.root)
        if not listed:
            return None
        index = 0 if rng.random() < 1 / 3 else rng.randrange(len(listed))
        return listed[index]["tag"], listed[index]["tiers"], index == 0

    def load_plain(self, rng: random.Random) -> None:
        """One item through the public API: its data, or not found; nothing else."""
        picked = self.pick(rng)
        if picked is None:
            return
        tag, _tiers, newest = picked
        step, item = int(tag.removeprefix("global_step")), rng.choice(ITEMS)
        self.add("loads")
        try:
            handle = nm.get_checkpoint(tag, persist_path=self.root)
            if handle is None:
                raise nm.CheckpointNotFoundError(self.root, tag)
            got = handle.load(item)
        except nm.CheckpointNotFoundError:
            self.add("loads of tags deleted before the read")
            self.check_gone(tag, newest)
            return
        except nm.NebulaError as exc:
            self.fail("loads failed because deleted while read", f"load {tag}/{item}: {exc!r}")
            return
        if not _same(got, expected(step, item)):
            self.fail("loads failed because deleted while read", f"{tag}/{item}: other data")
            return
        self.add("loads correct")

    def load_leased(self, rng: random.Random, hold_s: float) -> None:
        """Both items under a read lease held for a while: they must load, and be right."""
        picked = self.pick(rng)
        if picked is None:
            return
        tag, tiers, _newest = picked
        store = Store(self.root) if "persistent" in tiers else Store(nm.memory_tier_path(self.root))
        step = int(tag.removeprefix("global_step"))
        with read_lease(store, tag) as readable:
            if not readable:
                self.add("leases refused: deleted before the lease")
                return
            self.add("loads", len(ITEMS))
            self.add("loads under a lease", len(ITEMS))
            time.sleep(rng.uniform(0, hold_s))  # a slow reader: deleters come by meanwhile
            for item in ITEMS:
                try:
                    handle = nm.get_checkpoint(tag, persist_path=self.root)
                    if handle is None:
                        raise nm.CheckpointNotFoundError(self.root, tag)
                    got = handle.load(item)
                except nm.NebulaError as exc:
                    what = (
                        f"{tag}/{item} under a lease on {store.url}: {exc!r}; {self.folders(tag)}"
                    )
                    self.fail("loads failed because deleted while read", what)
                    continue
                if not _same(got, expected(step, item)):
                    what = f"{tag}/{item} under a lease: other data"
                    self.fail("loads failed because deleted while read", what)
                    continue
                self.add("loads correct")

    def folders(self, tag: str) -> str:
        """What the folders of `tag` hold on both tiers, for a failure's message."""
        stores = (Store(self.root), Store(nm.memory_tier_path(self.root)))
        return "; ".join(f"{s.url}: {sorted(s.list_files(tag))}" for s in stores)

    def check_gone(self, tag: str, newest: bool) -> None:
        """A load of `tag` found it on no tier: it must be gone for good (a tag is saved
        once), and if it was the newest when picked, a newer one must be there."""
        listed = nm.list_checkpoints(self.root)
        if any(c["tag"] == tag for c in listed):
            what = f"{tag} was not found, yet it is committed; {self.folders(tag)}"
            self.fail("loads failed because deleted while read", what)
        elif newest and not any((c["step"] or 0) > (step_of(tag) or 0) for c in listed):
            self.fail("newest deleted", f"{tag} was the newest and went; {self.folders(tag)}")

    def prune(self, rng: random.Random, cli: bool = False) -> bool:
        """Prune the root to its newest checkpoint (and leftovers, grace 0, now and then);
        False if there is no root yet."""
        if not os.path.isdir(self.root):
            return False  # nothing persisted yet
        incomplete = rng.random() < 0.5
        if cli:
            args = [str(NEBULA), "prune", self.root, "--keep", "1", "--yes", "--json"]
            args += ["--incomplete", "--grace", "0"] if incomplete else []
            done = subprocess.run(args, capture_output=True, text=True, timeout=120, check=False)
            # Exit 1 with the deletes it could not do listed (a tag being read) is a prune
            # that did what it may: anything else is an error.
            doc = json.loads(done.stdout) if done.returncode in (0, 1) else {}
            if done.returncode != 0 and not doc.get("skipped"):
                self.fail("prune errors", f"nebula prune: {done.returncode} {done.stderr}")
                return True
            deleted, kept = doc["deleted"], [s["reason"] for s in doc["skipped"]]
            self.add("prunes (nebula prune)")
        else:
            listing = nm.list_prune_candidates(self.root, incomplete=incomplete)
            result = nm.execute_prune(self.root, nm.plan_prune(listing, 1, grace_s=0))
            deleted, kept = list(result.deleted), [s.reason for s in result.skipped]
            self.add("prunes")
        self.add("tags pruned", len(deleted))
        self.add("prune kept: being read", kept.count(BEING_READ))
        return True

    def prune_around_a_lease(self, rng: random.Random) -> bool:
        """One prune while this thread holds a read lease on a committed tag of the root
        that is not the newest: the interleaving the random ones meet only by chance,
        made once for sure. The prune must keep that tag, saying it is being read.
        False where there was no such tag, or it went before the lease was taken."""
        persisted = [c for c in nm.list_checkpoints(self.root) if "persistent" in c["tiers"]]
        if len(persisted) < 2:
            return False
        tag = persisted[-1]["tag"]  # the oldest: a prune to the newest deletes it
        with read_lease(Store(self.root), tag) as readable:
            if not readable:
                return False
            before = self.counts["prune kept: being read"]
            self.prune(rng)
            if self.counts["prune kept: being read"] == before:
                self.fail("prunes that deleted a tag being read", f"{tag}: not kept")
            if not Store(self.root).exists(tag, "manifest.json"):
                self.fail("prunes that deleted a tag being read", f"{tag}: gone")
        self.add("prunes around a held lease")
        return True


def _thread(actor: Actor, target: Any, *args: object) -> threading.Thread:
    """A started thread running `target(*args)`; if it dies, that is a failure, not a
    quietly smaller count."""

    def run() -> None:
        try:
            target(*args)
        except Exception as exc:  # noqa: BLE001 - recorded as the campaign's failure
            actor.fail("threads that died", f"{target.__name__}: {exc!r}")

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


# the children ------------------------------------------------------------------------------
def _write_result(out: str, actor: Actor) -> None:
    with open(out, "w", encoding="utf-8") as f:
        json.dump({"counts": dict(actor.counts), "failures": actor.failures}, f)


def run_saver(root: str, steps: int, seed: int, out: str) -> None:
    actor = Actor(root, seed, "saver")
    nm.init(root, persistent_time_interval=0, num_of_version_in_retention=2)
    done = threading.Event()

    def loads() -> None:
        rng = random.Random(seed + 100)
        while not done.is_set():
            actor.load_plain(rng)

    thread = _thread(actor, loads)
    for step in range(1, steps + 1):
        actor.add("saves")
        try:
            ckpt = nm.Checkpoint(f"global_step{step}", len(ITEMS))
            for item in ITEMS:
                ckpt.save(item, expected(step, item))
        except nm.NebulaError as exc:
            actor.fail("saves lost", f"save of global_step{step}: {exc!r}")
        time.sleep(actor.rng.uniform(0, 0.005))
    try:
        nm.flush_persistence()
    except nm.NebulaError as exc:
        actor.fail("saves lost", f"the last persist: {exc!r}")
    done.set()
    thread.join(60)
    nm.shutdown()
    _write_result(out, actor)


def run_reader(root: str, seed: int, stop: str, out: str) -> None:
    actor = Actor(root, seed, "reader")
    rng = actor.rng
    while not os.path.exists(stop):
        roll = rng.random()
        if roll < 0.1:
            actor.prune(rng)
        elif roll < 0.4:
            actor.load_leased(rng, hold_s=0.02)
        else:
            actor.load_plain(rng)
    _write_result(out, actor)


# the campaign ------------------------------------------------------------------------------
def _watch(actor: Actor, stop: threading.Event) -> None:
    """The newest committed tag ever seen must stay committed until a newer one is."""
    store = Store(actor.root)
    best: tuple[tuple[int, str, str], str] | None = None
    while not stop.is_set():
        committed = list_committed(store)
        if best is not None and (not committed or committed[-1].sort_key < best[0]):
            # The listing is not atomic: look at the tag itself, then list again.
            again = list_committed(store)
            gone = read_committed(store, best[1]) is None
            if gone and (not again or again[-1].sort_key < best[0]):
                actor.fail("newest deleted", f"{best[1]} went with nothing newer committed")
        if committed and (best is None or committed[-1].sort_key > best[0]):
            best = (committed[-1].sort_key, committed[-1].tag)
        actor.add("newest checks")
        stop.wait(0.002)


def concurrency_campaign(work: Path, rounds: int, seed: int = 0) -> Figures:
    """`rounds` saves by a training child while another child and threads here load and
    prune the same root; see the module docstring for what is checked."""
    import warm  # tests/: the campaign's side only (its children run this module)

    work.mkdir(parents=True, exist_ok=True)
    root, stop_file = str(work / "root"), work / "stop"
    # One node: both children and this process see the same memory tier.
    was = os.environ.get("NEBULA_MEMORY_TIER_PATH")
    os.environ["NEBULA_MEMORY_TIER_PATH"] = str(work / "mem")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    here = Actor(root, seed, "campaign")

    def child(role: str, *args: object) -> subprocess.Popen[bytes]:
        with open(work / f"{role}.stderr", "wb") as err:
            command = [sys.executable, "-W", "ignore", __file__, role, root, *map(str, args)]
            return warm.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=err)

    saver = child("saver", rounds, seed + 1, work / "saver.json")
    reader = child("reader", seed + 2, stop_file, work / "reader.json")
    stop = threading.Event()
    saving = threading.Event()

    def loads(n: int) -> None:
        rng = random.Random(seed * 1000 + n)
        while not stop.is_set():
            if rng.random() < 0.3:
                here.load_leased(rng, hold_s=0.02)
            else:
                here.load_plain(rng)

    def prunes() -> None:
        rng = random.Random(seed * 1000 + 99)
        runs = 0
        leased = False
        while not stop.is_set():
            if not leased and saving.is_set():
                # First this one, before the random prunes leave the root one tag.
                leased = here.prune_around_a_lease(rng)
                if not leased:
                    stop.wait(0.005)
                    continue
            # The CLI costs a process start: two runs while the saver saves, the rest
            # through the API.
            runs += here.prune(rng, cli=saving.is_set() and runs in (3, 20))
            stop.wait(rng.uniform(0.005, 0.03))

    saving.set()
    threads = [_thread(here, _watch, here, stop), _thread(here, prunes)]
    threads += [_thread(here, loads, n) for n in range(2)]
    try:
        saver_rc = saver.wait(timeout=60 + rounds)
    except subprocess.TimeoutExpired:
        saver.kill()
        saver_rc = saver.wait()
    saving.clear()
    stop_file.touch()
    stop.set()
    for thread in threads:
        thread.join(120)
    try:
        reader_rc = reader.wait(timeout=120)
    except subprocess.TimeoutExpired:
        reader.kill()
        reader_rc = reader.wait()
    figures = Figures("concurrency")
    for role, rc in (("saver", saver_rc), ("reader", reader_rc)):
        try:
            result = json.loads((work / f"{role}.json").read_text())
        except (OSError, ValueError):
            stderr = (work / f"{role}.stderr").read_text(errors="replace")[-2000:]
            figures.failures.append(f"seed {seed}: the {role} child failed ({rc}): {stderr}")
            continue
        for key, n in result["counts"].items():
            figures.add(key, n)
        figures.failures.extend(result["failures"])
    for key, n in here.counts.items():
        figures.add(key, n)
    figures.failures.extend(here.failures)
    # The last save is on the root, committed, with its data.
    last = nm.get_checkpoint(f"global_step{rounds}", persist_path=root)
    if last is None or not _same(last.load("model"), expected(rounds, "model")):
        figures.add("saves lost")
        figures.failures.append(f"seed {seed}: global_step{rounds} is not on the root")
    for key in ("loads failed because deleted while read", "newest deleted", "saves lost"):
        figures.counts.setdefault(key, 0)
    if was is None:
        os.environ.pop("NEBULA_MEMORY_TIER_PATH", None)
    else:
        os.environ["NEBULA_MEMORY_TIER_PATH"] = was  # the test's own base, as before
    return figures


if __name__ == "__main__":
    role, args = sys.argv[1], sys.argv[2:]
    if role == "saver":
        run_saver(args[0], int(args[1]), int(args[2]), args[3])
    elif role == "reader":
        run_reader(args[0], int(args[1]), args[2], args[3])
    else:
        raise SystemExit(f"unknown role {role!r}")
