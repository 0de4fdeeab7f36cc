"""One job writes a root at a time (issue #18, case 2): a second job's `init` on a root
that a live job holds is refused, naming the holder's host and pid, and never evicts or
deletes the first job's checkpoints; the ranks of one job share the root; a crashed job's
hold is taken over (this host: its pid is gone; another host: its hold is not renewed).

The jobs are child processes (children/jobs_child.py) sharing this test's memory tier, as
two jobs on one node share the root's memory tier.
"""

from __future__ import annotations

import itertools
import json
import os
import socket
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
from children.crashkit import committed_tags, save_step
from jobkit import JobChild, job_env
from rendezvous import rendezvous

import nebulaml as nm
from nebulaml.format.names import JOB_PREFIX
from nebulaml.protocol import holds
from nebulaml.protocol.holds import Holder, NodeClaim, RootLease, lease_name
from nebulaml.protocol.tiers import open_tiers
from nebulaml.runtime import job as job_module
from nebulaml.runtime.job import job_identity
from nebulaml.runtime.ranks import RankInfo
from nebulaml.storage.store import Store

Start = Callable[..., JobChild]


@pytest.fixture
def start_job(memory_tier: Path, tmp_path: Path) -> Iterator[Start]:
    """Start a jobs_child.py scenario (a job of its own unless `env` says otherwise)."""
    started: list[JobChild] = []

    def start(scenario: str, *args: object, **env: str) -> JobChild:
        stderr = tmp_path / f"job-{len(started)}-{scenario}.stderr"
        child = JobChild(scenario, *args, env=job_env(memory_tier, **env), stderr_path=stderr)
        started.append(child)
        return child

    yield start
    for child in started:
        child.kill()


def hold_files(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith(JOB_PREFIX))


@pytest.mark.slow
def test_a_second_job_is_refused_naming_the_holders_host_and_pid(
    root: Path, start_job: Start
) -> None:
    first = start_job("hold", root, 2, 3600)
    first.wait_for("READY", 60)
    second = start_job("attempt", root, 10, 1)
    assert second.wait(60) == 3, second.stdout + second.stderr
    line = next(x for x in second.stdout.splitlines() if x.startswith("REFUSED"))
    assert f"pid {first.proc.pid} on {socket.gethostname()}" in line, line
    assert "SAVED" not in second.stdout


@pytest.mark.slow
def test_a_refused_job_never_evicts_the_live_jobs_unpersisted_checkpoints(
    root: Path, start_job: Start, memory_tier: Path
) -> None:
    # The first job's newest, global_step3, is in the memory tier only (the interval
    # holds its persist back): before #18 a second job's saves evicted it (its persister
    # keeps only its own), and the acknowledged global_step3 was gone with no error.
    first = start_job("hold", root, 3, 3600)
    first.wait_for("READY", 60)
    second = start_job("attempt", root, 10, 3)
    second.wait(60)
    memory = open_tiers(str(root)).memory
    assert committed_tags(memory) == ["global_step3"]
    assert "SAVED" not in second.stdout, second.stdout


@pytest.mark.slow
def test_the_ranks_of_one_job_share_the_root(root: Path, start_job: Start) -> None:
    # What tells one launch from another: torchrun's run id, the rendezvous, or ours.
    with rendezvous(2) as meeting:  # a port of this test's own, bound while it runs
        served = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": meeting["MASTER_PORT"]}
        served["WORLD_SIZE"] = "2"
        for first_env, second_env in (
            ({"TORCHELASTIC_RUN_ID": "run-7"}, {"TORCHELASTIC_RUN_ID": "run-7"}),
            (
                {**served, "WORLD_SIZE": "2", "RANK": "0"},
                {**served, "WORLD_SIZE": "2", "RANK": "1"},
            ),
            ({"NEBULA_JOB_ID": "my-job"}, {"NEBULA_JOB_ID": "my-job"}),
        ):
            first = start_job("hold", root, 0, 3600, **first_env)
            first.wait_for("READY", 60)
            other = start_job("hold", root, 0, 3600, **second_env)
            other.wait_for("READY", 60)  # joined, not refused
            other.kill()
            first.kill()


def test_another_launch_with_another_id_is_refused(root: Path, start_job: Start) -> None:
    first = start_job("hold", root, 0, 3600, TORCHELASTIC_RUN_ID="run-a")
    first.wait_for("READY", 60)
    second = start_job("attempt", root, 1, 1, TORCHELASTIC_RUN_ID="run-b")
    assert second.wait(60) == 3
    assert "job torchelastic:run-a" in second.stdout


@pytest.mark.slow
def test_a_crashed_jobs_hold_is_taken_over_and_its_checkpoints_recovered(
    root: Path, start_job: Start
) -> None:
    first = start_job("hold", root, 2, 3600)
    first.wait_for("READY", 60)
    first.kill()  # SIGKILL: its hold stays on disk, naming a pid that is gone
    assert len(hold_files(root)) == 1
    second = start_job("attempt", root, 3, 1)
    assert second.wait(120) == 0, second.stdout + second.stderr
    assert "DONE" in second.stdout
    # The dead job's unpersisted global_step2 was persisted by the new job's recovery.
    assert committed_tags(Store(str(root)))[-2:] == ["global_step2", "global_step3"]
    assert hold_files(root) == []  # released at its clean exit


def write_hold(root: Path, generation: int, *, host: str, age_s: float) -> None:
    when = (datetime.now(timezone.utc) - timedelta(seconds=age_s)).isoformat()
    doc = Holder("job-elsewhere", host, 4242, None, when, when)
    root.mkdir(parents=True, exist_ok=True)
    (root / lease_name(generation)).write_bytes(doc.to_bytes())
    old = time.time() - age_s
    os.utime(root / lease_name(generation), (old, old))


def test_another_hosts_hold_counts_until_it_is_not_renewed(root: Path) -> None:
    write_hold(root, 4, host="node-elsewhere", age_s=5)
    with pytest.raises(nm.RootInUseError, match="pid 4242 on node-elsewhere"):
        nm.init(str(root))
    write_hold(root, 4, host="node-elsewhere", age_s=holds.HOLD_TTL_S + 30)
    nm.init(str(root), persistent_time_interval=0)  # taken over: the next generation
    assert hold_files(root) == [lease_name(5)]
    doc = json.loads((root / lease_name(5)).read_text())
    assert doc["pid"] == os.getpid() and doc["host"] == socket.gethostname()
    nm.shutdown()
    assert hold_files(root) == []


@pytest.mark.parametrize("skew_s", [-120, 120])
def test_another_hosts_hold_is_judged_by_the_stores_clock_too(root: Path, skew_s: int) -> None:
    """A hold renewed just now by a host whose clock runs 120 s behind or ahead of ours
    (its renewed_at that far off, the store's time of the write now) counts: its job
    lives. Bug caught (main): the store's time was asked only for unreadable holds, and
    the skewed host's root was taken over while its holder lived."""
    write_hold(root, 4, host="node-elsewhere", age_s=skew_s)
    os.utime(root / lease_name(4))  # written now, by the store's clock
    with pytest.raises(nm.RootInUseError, match="pid 4242 on node-elsewhere"):
        nm.init(str(root))
    assert hold_files(root) == [lease_name(4)]


def test_the_holder_renews_its_hold_and_says_when_it_lost_it(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(job_module, "RENEW_S", 0.05)
    nm.init(str(root), persistent_time_interval=0)
    (name,) = hold_files(root)
    first = json.loads((root / name).read_text())["renewed_at"]
    deadline = time.monotonic() + 10
    while json.loads((root / name).read_text())["renewed_at"] == first:
        assert time.monotonic() < deadline, "the hold was not renewed"
        time.sleep(0.05)
    # A job elsewhere judged this one gone and took the root over: the next call says so.
    write_hold(root, 99, host="node-elsewhere", age_s=0)
    deadline = time.monotonic() + 10
    for step in itertools.count(1):  # a save before the renewal saw it is a new tag each time
        try:
            save_step(step)
        except nm.RootInUseError as exc:
            assert "taken over by job job-elsewhere" in str(exc)
            break
        assert time.monotonic() < deadline, "the lost hold was never reported"
        time.sleep(0.05)


@pytest.mark.slow
def test_memory_only_jobs_in_one_folder_are_one_at_a_time(start_job: Start) -> None:
    first = start_job("hold", "-", 1, 0)  # "-": no persistent root, the memory tier alone
    first.wait_for("READY", 60)
    tiers = open_tiers(None)
    with pytest.raises(nm.RootInUseError, match=f"pid {first.proc.pid}"):
        NodeClaim.take(tiers.memory, "another-job")


def test_root_lease_rules(tmp_path: Path) -> None:
    store = Store(str(tmp_path / "r"))
    store.make_dir()
    lease = RootLease.take(store, "job-a")
    assert lease.owner and hold_files(tmp_path / "r") == [lease_name(1)]
    assert not RootLease.take(store, "job-a", leader=False).owner  # a rank of job-a joins
    with pytest.raises(nm.RootInUseError):
        RootLease.take(store, "job-b")
    lease.release()
    assert hold_files(tmp_path / "r") == []
    assert RootLease.take(store, "job-b").owner


def test_job_identity() -> None:
    host, pid = socket.gethostname(), os.getpid()
    assert job_identity(RankInfo()) == f"process:{host}:{pid}"
    two = RankInfo(rank=1, world_size=2, local_world_size=2)
    env = {"MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "29500"}
    with pytest.MonkeyPatch.context() as mp:
        for key, value in env.items():
            mp.setenv(key, value)
        mp.delenv("TORCHELASTIC_RUN_ID", raising=False)
        assert job_identity(two) == "rendezvous:10.0.0.5:29500"
        mp.setenv("MASTER_ADDR", "127.0.0.1")
        assert job_identity(two) == f"rendezvous:{host}/127.0.0.1:29500"
        mp.setenv("TORCHELASTIC_RUN_ID", "none")  # torchrun's static rendezvous says none
        assert job_identity(two).startswith("rendezvous:")
        mp.setenv("TORCHELASTIC_RUN_ID", "abc")
        assert job_identity(two) == "torchelastic:abc"
        mp.setenv("NEBULA_JOB_ID", "mine")
        assert job_identity(RankInfo()) == "nebula:mine"


def test_a_planted_hold_above_a_live_jobs_takes_nothing_over(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Bug caught (#29, the junk campaign's reading): a hold planted above a running
    job's (dated years ahead, unreadable, a FIFO) was taken, at the job's next renewal,
    for another job's takeover: every later persist failed with RootInUseError."""
    monkeypatch.setattr(job_module, "RENEW_S", 0.05)
    nm.init(str(root), persistent_time_interval=0)
    (name,) = hold_files(root)
    write_hold(root, 97, host="node-elsewhere", age_s=-3 * 365 * 86400)  # years ahead
    (root / lease_name(98)).write_bytes(b"\x00not json")
    os.mkfifo(root / lease_name(99))
    renewed = json.loads((root / name).read_text())["renewed_at"]
    deadline = time.monotonic() + 10
    while json.loads((root / name).read_text())["renewed_at"] == renewed:
        assert time.monotonic() < deadline, "the hold was not renewed"
        time.sleep(0.05)
    for step in (1, 2):
        save_step(step)  # never RootInUseError
        assert nm.flush_persistence()
    nm.shutdown()
