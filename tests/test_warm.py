"""The suite's warm children (tests/warm.py) behave as `python` started afresh does, in
what the tests rely on: arguments, environment, folder, streams, exit status, signals,
atexit and non-daemon threads at the exit, `-W` and `-u`. Each case runs warm (forked
from the worker's zygote) and as a real process, and must give the same."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import warm

CHILD = r"""
import atexit, os, sys, threading, time, warnings
print("argv", sys.argv[1:], "path0", repr(sys.path[0]), "name", __name__)
print("env", os.environ.get("WARM_PROBE"), "cwd", os.getcwd())
print("stdin", sys.stdin.readline().strip())
warnings.warn("hidden by -W ignore")
atexit.register(lambda: print("atexit", flush=True))
threading.Thread(target=lambda: (time.sleep(0.2), print("thread done", flush=True))).start()
sys.stderr.write("to stderr\n")
sys.exit(int(sys.argv[1]))
"""


def _launch(how: str, args: list[str], **kwargs: object) -> subprocess.Popen[str]:
    if how == "cold":
        return subprocess.Popen(args, text=True, **kwargs)  # type: ignore[call-overload]
    for _ in range(200):  # the zygote imports torch first: a few seconds at most
        if warm.ZYGOTE.ready() is not None:
            break
        time.sleep(0.05)
    proc = warm.Popen(args, text=True, **kwargs)
    assert proc._conn is not None, "not forked from the zygote"
    return proc


@pytest.fixture(autouse=True)
def _zygote_here() -> None:
    if os.environ.get(warm.COLD_ENV):
        pytest.skip(f"{warm.COLD_ENV} is set: every child is a real process")


@pytest.mark.parametrize("how", ["warm", "cold"])
def test_a_script_sees_what_a_fresh_python_sees(how: str, tmp_path: Path) -> None:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    env = dict(os.environ, WARM_PROBE="probe")
    proc = _launch(
        how,
        [sys.executable, "-W", "ignore", str(script), "3", "x y"],
        cwd=tmp_path,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    out, err = proc.communicate("line in\n", timeout=60)
    assert proc.returncode == 3
    assert out.splitlines() == [
        f"argv ['3', 'x y'] path0 {str(tmp_path)!r} name __main__",
        f"env probe cwd {tmp_path}",
        "stdin line in",
        "thread done",  # non-daemon threads end before atexit, as at a real exit
        "atexit",
    ], out
    assert err == "to stderr\n", err  # the warning was filtered by -W ignore


@pytest.mark.parametrize("how", ["warm", "cold"])
def test_code_with_c_and_an_uncaught_exception(how: str, tmp_path: Path) -> None:
    proc = _launch(
        how,
        [sys.executable, "-c", "import sys; print(sys.argv, repr(sys.path[0])); 1/0", "a"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 1
    assert out == "['-c', 'a'] ''\n"
    assert err.splitlines()[-1] == "ZeroDivisionError: division by zero"


@pytest.mark.parametrize("how", ["warm", "cold"])
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM, signal.SIGINT])
def test_signals_reach_the_child_and_its_status_says_so(how: str, sig: int) -> None:
    proc = _launch(
        how,
        [sys.executable, "-u", "-c", "import time; print('up'); time.sleep(60)"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None
    assert proc.stdout.readline() == "up\n"  # -u: not held in a buffer
    assert proc.poll() is None
    os.kill(proc.pid, sig)  # its own pid: the process the caller holds
    assert proc.wait(timeout=30) == -sig
    proc.communicate()


THREADS_TAKING_SIGINT = r"""
import os, signal
main = str(os.getpid())
taking = []
for tid in os.listdir("/proc/self/task"):
    with open(f"/proc/self/task/{tid}/status") as f:
        fields = dict(line.split(":", 1) for line in f if ":" in line)
    if not int(fields["SigBlk"], 16) & (1 << (signal.SIGINT - 1)):
        taking.append("main" if tid == main else "other")
print(sorted(taking))
"""


@pytest.mark.parametrize("how", ["warm", "cold"])
def test_only_the_main_thread_takes_a_signal_sent_to_the_child(how: str) -> None:
    # Catches: a thread torch starts in a warm child (its intra-op pool, sized by the
    # zygote for the child) that takes a SIGINT meant for the process: the main thread's
    # sleep is not interrupted, and the child runs on (test_signals..., 1 run in 3).
    proc = _launch(how, [sys.executable, "-c", THREADS_TAKING_SIGINT], stdout=subprocess.PIPE)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0
    assert out.strip() == "['main']"


@pytest.mark.parametrize("how", ["warm", "cold"])
def test_a_wait_with_a_timeout_times_out_while_it_runs(how: str) -> None:
    proc = _launch(how, [sys.executable, "-c", "import time; time.sleep(60)"])
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(timeout=0.3)
    proc.kill()
    assert proc.wait(timeout=30) == -signal.SIGKILL


def test_a_launch_the_zygote_cannot_reproduce_starts_a_real_process() -> None:
    proc = warm.Popen([sys.executable, "-I", "-c", "pass"])  # an option it does not take
    assert proc._conn is None
    assert proc.wait(timeout=60) == 0
    done = warm.run(["true"])  # not Python at all
    assert done.returncode == 0
