"""Child processes for the crash and exit tests.

Run as `python nebula_child.py SCENARIO ARG...`. Each scenario drives nebula the way a
training script does and then crashes, hangs or exits at a chosen point; the test that
started it checks what is left on disk. Lines on stdout ("READY", "PERSISTING ...",
"EXITING") tell the test when the chosen point is reached.

Not for: assertions; the tests make those.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading

import crashkit

import nebulaml as nm


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def hang() -> None:
    threading.Event().wait()  # until the test kills us


def crash_before_commit(root: str, n_items: str) -> None:
    """global_step1 committed and persisted; global_step2 has items but no commit."""
    nm.init(root, persistent_time_interval=0)
    crashkit.save_step(1)
    nm.flush_persistence()
    ckpt = nm.Checkpoint("global_step2", -2)
    for item in crashkit.ITEMS[: int(n_items)]:
        ckpt.save(item, crashkit.known_state(2, item))
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


def crash_after_commits(root: str) -> None:
    """global_step1 persisted; 2 and 3 committed but held back by the interval; SIGKILL."""
    nm.init(root, persistent_time_interval=3600)
    crashkit.save_step(1)
    nm.flush_persistence()  # also starts the interval: 2 and 3 are not due for an hour
    crashkit.save_step(2)
    crashkit.save_step(3)
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


SCENARIOS = {
    f.__name__: f
    for f in (
        crash_before_commit,
        crash_in_persist,
        crash_after_commits,
        init_and_exit,
        exit_with_pending,
        exit_while_blocked,
        exit_after_failure,
    )
}

if __name__ == "__main__":
    SCENARIOS[sys.argv[1]](*sys.argv[2:])
