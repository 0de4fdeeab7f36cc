"""The life of a save, read in one place: runtime/save.py's pipeline calls the steps of
runtime/steps.py in their order, and a save run for real traces them in that order.

Bugs caught: a step moved (the commit published before an item's snapshot, the hand-over
to the persister before the history row), a step that no longer runs or runs twice, a
pipeline whose code reads in another order than it runs.
"""

from __future__ import annotations

import ast
import logging
from pathlib import Path

import pytest

import nebulaml as nm
from nebulaml.runtime import history_queue, persist_actions, persist_loop, save, steps

STEPS_LOGGER = "nebulaml.steps"


def _traced(records: list[logging.LogRecord], tag: str) -> list[str]:
    """The steps traced for `tag`, in the order they ran."""
    out = []
    for record in records:
        if record.name == STEPS_LOGGER:
            step, _, traced_tag = record.getMessage().rpartition(" ")
            if traced_tag == tag:
                out.append(step)
    return out


def _trace_calls_in_source_order(module: object) -> list[str]:
    """The first argument of each `trace(...)` call in `module`'s source, in source order,
    each step once."""
    tree = ast.parse(Path(module.__file__).read_text())  # type: ignore[attr-defined]
    calls = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "trace"
        and node.args
        and isinstance(node.args[0], ast.Constant)
    ]
    calls.sort(key=lambda node: (node.lineno, node.col_offset))
    seen: list[str] = []
    for node in calls:
        step = node.args[0].value  # type: ignore[attr-defined]
        if step not in seen:
            seen.append(step)
    return seen


def test_the_save_pipeline_reads_in_the_order_of_its_steps() -> None:
    assert _trace_calls_in_source_order(save) == list(steps.SAVE + steps.COMMIT)


def test_the_persisters_steps_are_each_traced_in_their_order() -> None:
    traced = [
        _trace_calls_in_source_order(module)
        for module in (persist_loop, persist_actions, history_queue)
    ]
    assert traced == [["persist", "evict"], ["retain"], ["history"]]
    assert sorted(step for steps_of in traced for step in steps_of) == sorted(steps.PERSIST)


@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
def test_a_save_traces_its_steps_in_the_pipelines_order(
    root: Path, caplog: pytest.LogCaptureFixture, lazy: bool
) -> None:
    caplog.set_level(logging.DEBUG, logger=STEPS_LOGGER)
    nm.init(str(root), persistent_time_interval=0, lazy_snapshot=lazy)
    ckpt = nm.Checkpoint("global_step1", 2)
    ckpt.save("model", {"w": [1.0] * 8})
    ckpt.save("optimizer", {"lr": 0.1})  # commits
    nm.flush_persistence()
    nm.shutdown()  # the history rows written
    # One process, one rank: no name to claim, no other rank to wait for.
    item = ["room", "snapshot"]
    assert _traced(caplog.records, "global_step1") == [
        "begin",
        *item,
        *item,
        "publish",
        "record",
        "hand over",
        *steps.PERSIST,
    ]
