"""The double-signal campaign: exit by a signal, then more signals during the exit persist.

torchrun and Kubernetes send SIGTERM, then signal again while the process is still
persisting its last checkpoint; people press Ctrl-C twice. Each child (the `exit_slowly`
scenario of tests/core/children/nebula_child.py) holds global_step2 back with the interval
and persists it at exit over a throttled link that takes PERSIST_S seconds. The campaign
ends it with SIGTERM or SIGINT, then, once the exit persist is under way, signals it again
at a random moment. Children in turn: (a) only that, with a long exit_timeout_s; (b) an
exit_timeout_s shorter than the persist; (c) a third signal, which abandons the persist.

Every child must end one of two ways: global_step2 committed (loading as saved) with the
status of its first signal (143, or SIGINT's), or status EXIT_NOT_PERSISTED with a stderr
line naming global_step2 and the memory tier that still holds it (and it does). Anything
else is an unreported loss.

Not for: the single-signal cases (test_exit_signals.py) or assertions (test_campaigns.py).
"""

from __future__ import annotations

import os
import random
import re
import signal
import sys
import time
from pathlib import Path

from campaigns import Figures

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "core" / "children"))

import crashkit  # tests/core/children, put on the path above

from nebulaml.protocol.catalog import read_committed
from nebulaml.runtime.exit import EXIT_NOT_PERSISTED
from nebulaml.storage.store import Store

TAG = "global_step2"
PERSIST_S = (1.0, 2.5)  # how long a child's exit persist takes, drawn in this range
KINDS = ("double", "short exit_timeout_s", "triple")
WAIT_S = 120  # bound on any wait for a child
_MEMORY_TIER = re.compile(r"still in the memory tier \((.+?)\), and the next")


def _status_of(signum: int) -> int:
    # nebula's SIGTERM handler exits with 128 + 15; CPython ends an uncaught
    # KeyboardInterrupt by SIGINT itself (subprocess's -2, a shell's 130).
    return -signal.SIGINT if signum == signal.SIGINT else 128 + signum


def double_signal_campaign(work: Path, children: int, seed: int = 0) -> Figures:
    """Run `children` children (the kinds in turn) and check how each one ended."""
    figures = Figures("double signal")
    rng = random.Random(seed)
    work.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, NEBULA_MEMORY_TIER_PATH=str(work / "mem"), PYTHONUNBUFFERED="1",
               OMP_NUM_THREADS="1")  # fmt: skip
    for i in range(children):
        kind = KINDS[i % len(KINDS)]
        persist_s = rng.uniform(*PERSIST_S)
        exit_timeout_s = rng.uniform(0.1, 0.6) * persist_s if kind == KINDS[1] else 60.0
        first, second, third = (rng.choice((signal.SIGTERM, signal.SIGINT)) for _ in range(3))
        folder = work / f"root{i}"
        child = crashkit.Child(
            "exit_slowly", crashkit.unique_protocol(), folder, exit_timeout_s, persist_s,
            env=env, stderr_path=work / f"child{i}.stderr",
        )  # fmt: skip
        try:
            child.wait_for("READY", WAIT_S)
            child.proc.send_signal(first)
            child.wait_for("PERSISTING", WAIT_S)  # the exit persist is under way
            # The third kind's signals both land within the persist's first 3/4.
            time.sleep(rng.uniform(0, persist_s / (2 if kind == KINDS[2] else 1)))
            child.proc.send_signal(second)
            figures.add("signals sent", 2)
            if kind == KINDS[2]:
                _wait_for_announcement(child)  # else the two could arrive as one
                time.sleep(rng.uniform(0, persist_s / 4))
                child.proc.send_signal(third)
                figures.add("signals sent")
            status = child.wait(WAIT_S)
        except AssertionError as exc:  # no line, or no exit, within WAIT_S
            figures.failures.append(f"child {i} ({kind}): {exc}")
            continue
        finally:
            child.kill()  # reaped in any case
        figures.add("children")
        _judge(figures, f"child {i} ({kind}, {first.name} then {second.name})", child,
               status, _status_of(first), folder)  # fmt: skip
    for key in ("persisted", "reported not persisted", "unreported losses"):
        figures.counts.setdefault(key, 0)
    return figures


def _wait_for_announcement(child: crashkit.Child) -> None:
    """Until the child said it is finishing the persist (or exited, or WAIT_S passed)."""
    deadline = time.monotonic() + WAIT_S
    while "finishing the persist of" not in child.stderr:
        if child.proc.poll() is not None or time.monotonic() > deadline:
            return
        time.sleep(0.01)


def _judge(
    figures: Figures, who: str, child: crashkit.Child, status: int, clean: int, folder: Path
) -> None:
    stderr = child.stderr
    if any("finishing the persist of" in line for line in stderr.splitlines()):
        figures.add("said it was finishing the persist")
    persisted = read_committed(Store(folder), TAG) is not None
    lines = stderr.splitlines()
    reports = [line for line in lines if "not persisted" in line and repr(TAG) in line]
    if persisted and not reports:
        figures.add("persisted")
        if status != clean:
            figures.failures.append(f"{who}: persisted, but exited {status}, not {clean}")
        try:
            crashkit.assert_files_hold_known(folder, 2)
        except AssertionError as exc:
            figures.failures.append(f"{who}: persisted, but does not load as saved: {exc}")
        return
    if len(reports) == 1:
        figures.add("reported not persisted")
        if "abandoned" in reports[0]:
            figures.add("abandoned on a third signal")
        else:
            figures.add("exit_timeout_s ran out")
        if persisted:
            figures.add("reported, but committed after all")  # the commit won the race
        if status != EXIT_NOT_PERSISTED:
            figures.failures.append(f"{who}: reported, but exited {status}")
        found = _MEMORY_TIER.search(reports[0])
        if found is None or read_committed(Store(found.group(1)), TAG) is None:
            figures.failures.append(f"{who}: not in the memory tier it named: {reports[0]}")
        return
    figures.add("unreported losses")
    figures.failures.append(f"{who}: exited {status}, {TAG} not persisted and not reported "
                            f"once:\n{stderr[-2000:]}")  # fmt: skip
