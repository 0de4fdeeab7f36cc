"""Child processes for the crash and exit tests.

Run as `python nebula_child.py SCENARIO ARG...`. Each scenario drives nebula the way a
training script does and then crashes, hangs or exits at a chosen point; the test that
started it checks what is left on disk. Lines on stdout ("READY", "PERSISTING ...",
"EXITING") tell the test when the chosen point is reached.

Not for: assertions; the tests make those.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import sys
import threading
import time

import crashkit

import nebulaml as nm


def say(line: str) -> None:
    if line == "READY":
        # The test may signal us at once. A KeyboardInterrupt that CPython raises while
        # the main thread runs a garbage collector's callback (a WeakSet's, say) is
        # "ignored" and the Ctrl-C lost: collect now, so that none runs in that window.
        gc.collect()
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def hang() -> None:
    """Until the test kills us, as a training loop would: the main thread back in Python
    every 0.1 s, so that a signal another thread took is handled at once (a main thread
    asleep in one long wait would not wake for it)."""
    while True:
        time.sleep(0.1)


def crash_before_commit(root: str, n_items: str) -> None:
    """global_step1 committed and persisted; global_step2 has items but no commit."""
    nm.init(root, persistent_time_interval=0)
    crashkit.save_step(1)
    nm.flush_persistence()
    ckpt = nm.Checkpoint("global_step2", -2)
    for item in crashkit.ITEMS[: int(n_items)]:
        ckpt.save(item, crashkit.known_state(2, item))
    nm.wait_for_snapshot()  # the items' lazy copies taken (no commit: none was asked)
    say("READY")
    hang()


def crash_in_persist(protocol: str, folder: str) -> None:
    """global_step1 persisted; the persist of global_step2 blocks inside its first item."""
    fs = crashkit.register(protocol, fault_tags=frozenset({"global_step2"}))
    nm.init(f"{protocol}://{folder}", persistent_time_interval=0)
    crashkit.save_step(1)
    nm.flush_persistence()
    fs.mode = "block"  # the FaultFS prints PERSISTING once the persister is stuck
    crashkit.save_step(2)
    hang()


def crash_with_best_unpersisted(protocol: str, folder: str) -> None:
    """global_step1 persisted; the persist of global_step2 (labelled best) blocks; then
    global_step3 is committed, held back by the interval, and the test SIGKILLs us."""
    fs = crashkit.register(protocol, fault_tags=frozenset({"global_step2"}))
    nm.init(f"{protocol}://{folder}", persistent_time_interval=3600)
    crashkit.save_step(1)
    nm.flush_persistence()
    fs.mode = "block"  # the FaultFS prints PERSISTING once the persister is stuck
    ckpt = nm.Checkpoint("global_step2", len(crashkit.ITEMS), labels=["best"])
    for item in crashkit.ITEMS:
        ckpt.save(item, crashkit.known_state(2, item))
    crashkit.save_step(3)
    say("SAVED")
    hang()


def crash_with_a_resaved_label_unpersisted(protocol: str, folder: str) -> None:
    """ "last" (labelled) persisted with step 1's state; saved again with step 2's, whose
    persist blocks; then global_step3 is committed, and the test SIGKILLs us."""
    fs = crashkit.register(protocol, fault_tags=frozenset({"last"}))
    nm.init(f"{protocol}://{folder}", persistent_time_interval=3600)
    for step in (1, 2):
        if step == 2:
            fs.mode = "block"  # the FaultFS prints PERSISTING once the persister is stuck
        ckpt = nm.Checkpoint("last", len(crashkit.ITEMS), overwrite=True, labels=["kept"])
        for item in crashkit.ITEMS:
            ckpt.save(item, crashkit.known_state(step, item))
        if step == 1:
            nm.flush_persistence()
    crashkit.save_step(3)
    say("SAVED")
    hang()


def crash_with_a_removal_pending(protocol: str, folder: str) -> None:
    """global_step1 persisted; the persist of global_step2 blocks; the framework removes
    global_step1 (Lightning's ModelCheckpoint through `Persister.forget`), and the test
    SIGKILLs us before the thread got to the removal."""
    from nebulaml.runtime import session

    fs = crashkit.register(protocol, fault_tags=frozenset({"global_step2"}))
    nm.init(f"{protocol}://{folder}", persistent_time_interval=0, num_of_version_in_retention=5)
    crashkit.save_step(1)
    nm.flush_persistence()
    fs.mode = "block"  # the FaultFS prints PERSISTING once the persister is stuck
    crashkit.save_step(2)
    # Removed only once the thread is stuck in global_step2's persist: a removal asked for
    # before that persist began was taken by the thread first (the save returns sooner
    # since its eviction left it), and global_step1 was gone before the kill.
    assert fs.blocked.wait(60)
    live = session.live()
    assert live is not None
    live.persister.forget("global_step1")
    say("REMOVED")
    hang()


def crash_after_commits(root: str) -> None:
    """global_step1 persisted; 2 and 3 committed but held back by the interval; SIGKILL."""
    from nebulaml.runtime import session

    nm.init(root, persistent_time_interval=3600)
    crashkit.save_step(1)
    nm.flush_persistence()  # also starts the interval: 2 and 3 are not due for an hour
    crashkit.save_step(2)
    crashkit.save_step(3)
    # global_step2's memory copy is evicted by the persister's thread: killed once it is
    # gone, the memory tier holds global_step3 alone (a kill before leaves both, and
    # the restart persists the newest all the same).
    live = session.live()
    assert live is not None
    live.persister.settle_eviction()
    os.kill(os.getpid(), signal.SIGKILL)


def init_and_exit(root: str) -> None:
    """What a restarted job does first: init on the same root, then exit normally."""
    nm.init(root)


def exit_with_pending(root: str, how: str) -> None:
    """global_step2 is held back by the interval when the interpreter exits."""
    nm.init(root, persistent_time_interval=3600)
    crashkit.save_step(1)
    nm.flush_persistence()
    crashkit.save_step(2)
    persisted = [c["tag"] for c in nm.list_checkpoints() if "persistent" in c["tiers"]]
    say("PERSISTED " + json.dumps(persisted))
    if how == "raise":
        raise RuntimeError("training failed")


def exit_while_blocked(protocol: str, folder: str) -> None:
    """The persist of global_step1 never finishes; exit may wait only exit_timeout_s=1."""
    fs = crashkit.register(protocol, mode="block")
    nm.init(f"{protocol}://{folder}", persistent_time_interval=0, exit_timeout_s=1)
    crashkit.save_step(1)
    if not fs.blocked.wait(timeout=60):
        sys.exit("the persist of global_step1 never started")
    say("EXITING")


def exit_after_failure(protocol: str, folder: str) -> None:
    """The persist of global_step1 fails (disk full); no API call follows before exit."""
    import errno

    crashkit.register(protocol, mode="fail", fail_errno=errno.ENOSPC)
    nm.init(f"{protocol}://{folder}", persistent_time_interval=0)
    crashkit.save_step(1)
    say("EXITING")


class _Throttled:
    """A FaultFS item file written at `rate` bytes a second (a slow link); says
    PERSISTING once, at the first byte it holds back."""

    def __init__(self, raw: object, path: str, rate: float) -> None:
        self._raw, self._path, self._rate = raw, path, rate

    def write(self, data: object) -> int:
        view = memoryview(data).cast("B")  # type: ignore[arg-type]
        for start in range(0, len(view), 4096):
            piece = view[start : start + 4096]
            if not _Throttled.announced:
                _Throttled.announced = True
                say(f"PERSISTING {self._path}")
            time.sleep(len(piece) / self._rate)
            self._raw.write(piece)  # type: ignore[attr-defined]
        return len(view)

    announced = False

    def __getattr__(self, name: str) -> object:
        return getattr(self._raw, name)

    def __enter__(self) -> _Throttled:
        return self

    def __exit__(self, *exc: object) -> None:
        self._raw.close()  # type: ignore[attr-defined]


def register_throttled(protocol: str, tag: str, rate: float) -> None:
    """Register FaultFS under `protocol` with the item files of `tag` written slowly."""
    cls = crashkit.register(protocol, fault_tags=frozenset({tag}))
    plain_open = cls._open

    def _open(self: crashkit.FaultFS, path: str, mode: str = "rb", **kwargs: object) -> object:
        f = plain_open(self, path, mode, **kwargs)
        return f if "r" in mode or not cls._faulty(path) else _Throttled(f, path, rate)

    cls._open = _open  # type: ignore[method-assign]


def exit_slowly(protocol: str, folder: str, exit_timeout_s: str, persist_s: str) -> None:
    """global_step1 persisted; global_step2, held back by the interval, is persisted at
    exit over a link so slow that its persist lasts about `persist_s` seconds. The test
    signals the child once READY (an exit by signal), and again once PERSISTING."""
    import io

    import torch

    size = 0
    for item in crashkit.ITEMS:
        buf = io.BytesIO()
        torch.save(crashkit.known_state(2, item), buf)
        size += len(buf.getvalue())
    register_throttled(protocol, "global_step2", size / float(persist_s))
    nm.init(f"{protocol}://{folder}", persistent_time_interval=3600,
            exit_timeout_s=float(exit_timeout_s))  # fmt: skip
    crashkit.save_step(1)
    nm.flush_persistence()
    crashkit.save_step(2)  # held back: the exit persists it
    say("READY")
    hang()


def exit_into_a_slow_atexit(root: str) -> None:
    """global_step1 persisted; the script returns, and an exit handler of its own (run
    after nebula's exit persist) takes a while: the test SIGTERMs us during it."""
    import atexit

    nm.init(root, persistent_time_interval=0)
    crashkit.save_step(1)
    nm.flush_persistence()

    def slow() -> None:
        say("SLOW")
        time.sleep(30)

    atexit.register(slow)


def exit_memory_root(root: str) -> None:
    """A memory:// root (it lives as long as this process): global_step2 is held back by
    the interval; an atexit handler registered after init says what the root holds then."""
    import atexit

    nm.init(root, persistent_time_interval=3600)
    crashkit.save_step(1)
    nm.flush_persistence()
    crashkit.save_step(2)

    def report() -> None:
        from nebulaml.protocol.catalog import list_committed
        from nebulaml.storage.store import Store

        say("COMMITTED " + json.dumps([c.tag for c in list_committed(Store(root))]))

    atexit.register(report)
    say("EXITING")


def exit_while_a_thread_saves(root: str) -> None:
    """The main thread ends while a non-daemon thread still trains: its save of
    global_step2, after the main thread is done, is the one the exit must persist."""
    nm.init(root, persistent_time_interval=3600)
    crashkit.save_step(1)
    nm.flush_persistence()

    def train() -> None:
        time.sleep(1.0)
        crashkit.save_step(2)
        say("SAVED")

    threading.Thread(target=train, name="trainer").start()
    say("EXITING")


SCENARIOS = {
    f.__name__: f
    for f in (
        crash_before_commit,
        crash_in_persist,
        crash_after_commits,
        crash_with_best_unpersisted,
        crash_with_a_resaved_label_unpersisted,
        crash_with_a_removal_pending,
        init_and_exit,
        exit_with_pending,
        exit_while_blocked,
        exit_after_failure,
        exit_slowly,
        exit_into_a_slow_atexit,
        exit_memory_root,
        exit_while_a_thread_saves,
    )
}

if __name__ == "__main__":
    SCENARIOS[sys.argv[1]](*sys.argv[2:])
