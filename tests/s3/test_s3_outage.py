"""S3 goes away in the middle of training, as Azure does in tests/azure/test_azure_outage*.py:
the suite's moto server, reached through a proxy of the test's own (tests/faultproxy.py),
stopped at the proxy (connections refused, those in flight reset: the server keeps its
objects, as S3 does through an outage, where a stopped moto would forget them all) or
suspended with SIGSTOP (requests hang) and resumed. Saves during the outage return within
1 s; `flush_persistence()` says False (or raises) while the newest is only in RAM, within
its deadline; the newest acknowledged checkpoint lands by itself once the store is back
and loads bit for bit; a job restarted during the outage resumes from its memory tier; a
process that ends during it ends within its `exit_timeout_s`.

In the test's process the store is reached through storage options; the child processes
reach it as a job on AWS would, through the environment (the AWS chain: keys and
`AWS_ENDPOINT_URL_S3`).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import s3server
import torch
import warm
from outage_kit import Proxied, behind_a_proxy, down_at_init, outage_during_training, store_away

import nebulaml as nm

BUCKET = "nebula-tests"  # the suite's bucket on its moto server (tests/conftest.py)
CHILD = Path(__file__).resolve().parents[1] / "reliability" / "outage_life_child.py"
EXIT_TIMEOUT_S = 3.0  # the children's exit_timeout_s


@pytest.fixture
def s3_away(s3_server: s3server.MotoServer, monkeypatch: pytest.MonkeyPatch) -> Iterator[Proxied]:
    """The suite's moto server behind a proxy of this test's own (its storage options are
    `s3_options`), the proxy's endpoint and the server's keys in the environment too (for
    child processes), with short retries and a 1 s deadline a call."""
    with behind_a_proxy(s3_server.proc, s3_server.port, monkeypatch) as server:
        for var in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL"):
            monkeypatch.delenv(var, raising=False)
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3server.KEY)
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3server.SECRET)
        monkeypatch.setenv("AWS_ENDPOINT_URL_S3", server.proxy.endpoint)
        yield server


def s3_options(server: Proxied) -> dict[str, Any]:
    """The storage options that reach the server through its proxy."""
    return {"endpoint_url": server.proxy.endpoint, "key": s3server.KEY, "secret": s3server.SECRET}


def _url() -> str:
    return f"s3://{BUCKET}/outage-{uuid.uuid4().hex[:12]}"


@pytest.mark.slow
@pytest.mark.parametrize("how", ["stopped", "suspended"])
def test_an_s3_outage_never_stops_training_and_the_newest_lands_when_it_is_back(
    s3_away: Proxied, how: str, caplog: pytest.LogCaptureFixture
) -> None:
    # Catches: a save that asks S3 something on the training thread (blocks for the
    # retries or the hang), a flush that says True (or waits past its deadline) while the
    # newest is in RAM only, a persist that hangs without a deadline (never reported as
    # failing), and a failed persist dropped: the newest never reaching S3.
    outage_during_training(s3_away, _url(), s3_options(s3_away), how)


@pytest.mark.slow
def test_s3_down_at_init_starts_memory_only_and_persists_once_it_is_back(
    s3_away: Proxied, caplog: pytest.LogCaptureFixture
) -> None:
    # Catches: init waiting out its deadline for a store that refuses the connection
    # (botocore's own retries, 5 tries with backoff, inside nebula's: main took 2-3 s);
    # the job not checkpointing to RAM at once; what it saved never persisted after.
    # (init on a hung store: the restart test below.)
    down_at_init(s3_away, _url(), s3_options(s3_away), caplog)


def _digest(loaded: dict[str, torch.Tensor]) -> str:
    """The child's digest of a state it saved (outage_life_child.digest)."""
    spec = importlib.util.spec_from_file_location("outage_life_child", CHILD)
    assert spec is not None and spec.loader is not None
    child = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(child)
    return str(child.digest(loaded))


def _child(url: str, journal: Path, *args: str) -> subprocess.Popen[str]:
    """The outage campaign's training script (its store from this test's environment)."""
    env = {**os.environ, "NEBULA_EXIT_TIMEOUT_S": str(EXIT_TIMEOUT_S), "PYTHONUNBUFFERED": "1"}
    pipe = subprocess.PIPE
    return warm.Popen([sys.executable, str(CHILD), *args[:1], url, str(journal), *args[1:]],
                      env=env, text=True, stdin=pipe, stdout=pipe, stderr=pipe)  # fmt: skip


def _expect(proc: subprocess.Popen[str], line: str) -> None:
    assert proc.stdout is not None and proc.stdin is not None
    got = proc.stdout.readline().strip()
    if got != line:
        proc.kill()
        _out, err = proc.communicate(timeout=30)
        raise AssertionError(f"expected {line!r}, got {got!r}; stderr:\n{err}")


def _tell(proc: subprocess.Popen[str], line: str = "go") -> None:
    assert proc.stdin is not None
    proc.stdin.write(f"{line}\n")
    proc.stdin.flush()


def _acknowledged(journal: Path) -> list[dict[str, object]]:
    if not journal.exists():
        return []
    return [json.loads(line) for line in journal.read_text().splitlines() if line]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_job_restarted_while_s3_hangs_resumes_from_ram_and_ends_within_its_exit_timeout(
    s3_away: Proxied, tmp_path: Path
) -> None:
    # Catches: the restart's get_latest_checkpoint() waiting on S3 (or failing after its
    # retries) instead of resuming from the memory tier; a resume after a SIGKILL loading
    # an older checkpoint than the newest acknowledged; an exit that waits on a hung call
    # without a deadline, or says its newest checkpoint is safe; that checkpoint lost
    # once the store is back (the next start on the node must persist it).
    url, journal = _url(), tmp_path / "acknowledged.jsonl"
    first = _child(url, journal, "save")
    _expect(first, "DURABLE")
    with store_away(s3_away, "suspended"):
        _tell(first)  # it saves global_step4, 5, ... in RAM only, each acknowledged
        deadline = time.monotonic() + 60
        while len(_acknowledged(journal)) < 2:
            assert time.monotonic() < deadline and first.poll() is None, first.poll()
            time.sleep(0.05)
        first.kill()
        first.communicate(timeout=60)
        newest = _acknowledged(journal)[-1]
        second = _child(url, journal, "resume")
        assert second.stdout is not None
        resumed = json.loads(second.stdout.readline())
        assert resumed["tag"] == f"global_step{newest['step']}", (resumed, newest)
        assert resumed["digest"] == newest["digest"], (resumed, newest)
        # init waits for a hung store 1 s (the call's deadline here; CONNECT_WAIT_S at most).
        assert resumed["took_s"] < 10 and resumed["init_s"] < 4.5, resumed
        _expect(second, "ACKED")  # one more step, in RAM only
        last = _acknowledged(journal)[-1]
        started = time.monotonic()
        _out, err = second.communicate("\n", timeout=EXIT_TIMEOUT_S + 60)  # ends in the hang
        ended = time.monotonic() - started
        assert ended < EXIT_TIMEOUT_S + 5, (ended, err)
        assert second.returncode == 1, (second.returncode, err)
        assert f"'global_step{last['step']}' was not persisted" in err, err
    third = _child(url, journal, "recover")  # the next start on the node, the store back
    out, err = third.communicate(timeout=60)
    assert out.strip() == "FLUSHED True" and third.returncode == 0, (out, err)
    with nm.using_storage_options(s3_options(s3_away)):
        latest = nm.get_latest_checkpoint(url)
        assert latest is not None and latest.tag == f"global_step{last['step']}", latest
        with latest:
            assert _digest(latest.load("model")) == last["digest"]
