"""The order in which pytest-xdist's workers run the suite (`make test`: `--dist worksteal`):
the longest tests first, shared between the workers so that each has as much to run, and
the short ones last, so that the run does not end on one worker running a long test alone
while the other has nothing left.

worksteal gives each worker an even share of the collected tests, in their order (the
first worker the first share), and a worker that runs out takes the second half of the
longest queue left. So the collection is laid out as one share per worker: the long tests
(`ESTIMATE_S`, else `SLOW_S` for a test marked slow) dealt out longest first to whichever
share has the least seconds so far, each share running its long tests longest first, then
its short ones in the order they were collected (what is taken from its end is short).

Tests that share a set-up of their module's (a module-scoped fixture, tests/shared_setup.py's
`once`) or that must not overlap (`one_at_a_time`) go together (`GROUPS`): one share, one
after the other in their collected order, so that neither worker waits on the other's lock
nor builds a module's set-up twice.

Another order (one worker, `-p no:xdist`, another `--dist`) keeps the collected one.
Not for: what a test proves (any order passes); only the time the run takes.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

import pytest

# Seconds (setup, call and teardown) of the suite's longest tests on a busy 2-core machine
# (pytest --durations), by file and name: a name without its parameters counts for each
# of them. Refresh them when a test grows or shrinks by much: a wrong figure costs time,
# never a result.
ESTIMATE_S = {
    "tests/integrations/test_lightning_ddp.py": {
        "test_ddp_killed_mid_epoch_resumes_from_last_and_keeps_what_modelcheckpoint_keeps": 30.0,
        "test_ddp_saves_on_rank_0_and_every_rank_resumes_bit_for_bit[lightning]": 28.0,
        "test_ddp_saves_on_rank_0_and_every_rank_resumes_bit_for_bit[torchrun]": 21.0,
    },
    "tests/reliability/test_campaigns.py": {
        "test_outages_never_block_training_or_lose_an_acknowledged_checkpoint": 24.0,
        "test_two_jobs_on_one_root_run_one_at_a_time": 15.0,
    },
    "tests/packaging/test_wheel.py": {
        "test_the_wheel_holds_every_module_the_completions_license_and_markers": 32.0,
    },
    "tests/test_demo.py": {
        "test_demo_kills_resumes_and_proves_identical_state": 24.0,
    },
    "tests/integrations/test_transformers.py": {
        "test_ddp_trainer_saves_through_rank_0_and_resumes_on_both_ranks": 23.0,
        "test_trainer_resumes_after_sigkill_as_if_never_interrupted": 19.0,
    },
    "tests/integrations/test_deepspeed.py": {
        "test_save_and_resume_go_through_nebula_with_identical_state[0-2]": 22.0,
        "test_save_and_resume_go_through_nebula_with_identical_state[0-1]": 10.5,
        "test_zero3_killed_resumes_and_resaves_as_deepspeeds_own_checkpoints": 19.0,
    },
    "tests/integrations/test_examples.py": {
        "test_deepspeed_example": 19.0,
        "test_lightning_example": 13.0,
    },
    "tests/test_docs.py": {
        "test_the_quickstart_runs_crashes_and_resumes": 16.0,
    },
    "tests/azure/test_azure_outage_life.py": {
        "test_a_job_restarted_during_an_outage_resumes_from_its_memory_tier": 12.0,
        "test_a_process_ending_during_an_outage_ends_within_its_exit_timeout": 10.0,
    },
    "tests/test_bench_lora.py": {
        "test_the_azurite_row_counts_what_the_client_uploads": 11.0,
        "test_frozen_base_sends_what_changed_and_the_control_sends_everything": 7.0,
    },
}
SLOW_S = 4.0  # a test marked slow that ESTIMATE_S does not name
SHORT_S = 0.2  # any other test

# Tests that run in one worker, one after the other: a module's own set-up (module-scoped
# fixtures, tests/shared_setup.py's `once`), or DeepSpeed's jobs (`one_at_a_time`).
GROUPS = {
    "tests/packaging/test_wheel.py": "wheel",
    "tests/integrations/test_deepspeed.py": "deepspeed",
    "tests/integrations/test_examples.py::test_deepspeed_example": "deepspeed",
    "tests/integrations/test_dcp.py": "dcp",
    "tests/azure/test_azure_reuse.py": "azure-reuse",
}
DIST_KEY = "nebula_dist"  # the controller's --dist, handed to each worker (workerinput)


def estimate(item: pytest.Item) -> float:
    """How long `item` takes, in seconds, as far as this module knows."""
    path, _, name = item.nodeid.partition("::")
    known = ESTIMATE_S.get(path, {})
    for key in (name, name.split("[", 1)[0]):
        if key in known:
            return known[key]
    return SLOW_S if item.get_closest_marker("slow") is not None else SHORT_S


def group(nodeid: str) -> str | None:
    """The name of the group `nodeid` runs in (`GROUPS`), if any."""
    for key in (nodeid.split("[", 1)[0], nodeid.split("::", 1)[0]):
        if key in GROUPS:
            return GROUPS[key]
    return None


def shares(count: int, workers: int) -> list[int]:
    """How many of `count` tests worksteal first gives each of `workers` workers.

    Example:
        >>> shares(7, 2)
        [3, 4]
    """
    sizes, left = [], count
    for i in range(workers):
        sizes.append(left // (workers - i))
        left -= sizes[-1]
    return sizes


def lay_out(
    items: Sequence[pytest.Item], workers: int, estimate: Callable[[pytest.Item], float] = estimate
) -> list[pytest.Item]:
    """`items` as one share per worker, each its long tests longest first, then its short
    ones in their collected order (see the module's docstring).

    Example: 2 workers, tests of 9, 5, 4 and 3 s, and 4 short ones
        >>> from types import SimpleNamespace as I  # stand-ins for pytest.Item
        >>> items = [I(nodeid=n, s=s) for n, s in zip("wxabyzcd", [0, 0, 9, 5, 0, 0, 4, 3])]
        >>> laid = lay_out(items, 2, lambda i: i.s or SHORT_S)  # type: ignore[arg-type]
        >>> "".join(i.nodeid for i in laid)
        'adwxbcyz'
    """
    units: dict[str, list[pytest.Item]] = {}  # a group's tests, or a test alone
    for item in items:
        units.setdefault(group(item.nodeid) or item.nodeid, []).append(item)
    seconds = {key: sum(estimate(i) for i in unit) for key, unit in units.items()}
    long_units = sorted((k for k in units if seconds[k] > SHORT_S * len(units[k])),
                        key=lambda k: -seconds[k])  # fmt: skip
    sizes = shares(len(items), workers)
    loads = [0.0] * workers
    long_of: list[list[pytest.Item]] = [[] for _ in range(workers)]
    for key in long_units:  # the longest to the share with the least seconds (and room)
        room = [w for w in range(workers) if len(long_of[w]) + len(units[key]) <= sizes[w]]
        share = min(room or range(workers), key=lambda w: loads[w])
        long_of[share].extend(units[key])
        loads[share] += seconds[key]
    placed = {id(i) for share in long_of for i in share}
    short = iter([i for i in items if id(i) not in placed])
    laid: list[pytest.Item] = []
    for share, size in zip(long_of, sizes, strict=True):
        laid += share
        laid += [next(short) for _ in range(max(0, size - len(share)))]
    laid += list(short)  # none left, unless a share's long tests overflowed it
    return laid


def order(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Reorder `items` in place for `--dist worksteal` with several workers; else as is."""
    workerinput = getattr(config, "workerinput", None)
    if workerinput is None or workerinput.get(DIST_KEY) != "worksteal":
        return
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        items[:] = lay_out(items, workers)
