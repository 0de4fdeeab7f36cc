"""Child processes for the tests of jobs sharing a root and of checkpoint handles (#18).

Run as `python jobs_child.py SCENARIO ROOT ARG...`. Lines on stdout tell the test what
happened ("READY", "SAVED <step>", "REFUSED <message>", "ERROR <message>"); the test
kills the children it starts.

Not for: assertions; the tests make those.
"""

from __future__ import annotations

import sys
import threading
import time

import crashkit

import nebulaml as nm


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def hang() -> None:
    threading.Event().wait()  # until the test kills us


def init_or_refuse(root: str, **options: object) -> bool:
    """`nm.init` ("-": no persistent root); says REFUSED (and returns False) when another
    job holds the root."""
    try:
        nm.init(None if root == "-" else root, **options)  # type: ignore[arg-type]
    except nm.RootInUseError as exc:
        say(f"REFUSED {exc}")
        return False
    return True


def hold(root: str, steps: str, interval: str) -> None:
    """Init, save `steps` checkpoints (persisted at most every `interval` s), then wait."""
    if not init_or_refuse(root, persistent_time_interval=float(interval)):
        sys.exit(3)
    for step in range(1, int(steps) + 1):
        crashkit.save_step(step)
        say(f"SAVED {step}")
    say("READY")
    hang()


def attempt(root: str, first_step: str, steps: str) -> None:
    """Init (maybe refused), then save `steps` checkpoints from `first_step` and exit."""
    if not init_or_refuse(root, persistent_time_interval=0):
        sys.exit(3)
    say("READY")
    start = int(first_step)
    for step in range(start, start + int(steps)):
        crashkit.save_step(step)
        say(f"SAVED {step}")
    nm.flush_persistence()
    say("DONE")


def train(root: str, interval: str, retention: str, pause: str) -> None:
    """Save one checkpoint after another until killed; every call into nebula that fails
    is said (ERROR ...) and training goes on, as a trainer that logs and retries would."""
    if not init_or_refuse(root, persistent_time_interval=float(interval),
                          num_of_version_in_retention=int(retention)):  # fmt: skip
        sys.exit(3)
    latest = nm.get_latest_checkpoint()
    step = int(latest.tag.removeprefix("global_step")) if latest is not None else 0
    if latest is not None:
        latest.release()
    say(f"READY {step}")
    while True:
        step += 1
        try:
            crashkit.save_step(step)
        except nm.NebulaError as exc:
            say(f"ERROR {type(exc).__name__}: {exc}")
            continue
        say(f"SAVED {step}")
        time.sleep(float(pause))


def handle(root: str) -> None:
    """Take a handle to the newest checkpoint of `root` (no session), then wait."""
    latest = nm.get_latest_checkpoint(root)
    say(f"HOLDING {latest.tag if latest else None}")
    hang()


def copy_paused(root: str, tag: str, dest: str, gate: str) -> None:
    """`nm.copy_checkpoint(root, tag, dest)` (an operator's `nebula copy`), paused once its
    writer marker is at the destination ("COPYING") until the file `gate` exists."""
    import os

    said = False

    def progress(_done: int, _total: int) -> None:
        nonlocal said
        if not said:
            said = True
            say("COPYING")
            while not os.path.exists(gate):
                time.sleep(0.02)

    report = nm.copy_checkpoint(root, tag, dest, progress=progress)
    say(f"COPIED {report['copied_items']} unchanged={report['unchanged']}")


SCENARIOS = {f.__name__: f for f in (hold, attempt, train, handle, copy_paused)}

if __name__ == "__main__":
    SCENARIOS[sys.argv[1]](*sys.argv[2:])
