"""`make bench`'s LoRA fine-tune workload (benchmarks/lora.py), run at a tiny size through
the benchmark's own command line: it must freeze what it says, count what each method
sends to the persistent tier, and check the issue's targets from those counts."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import azurite as azurite_server
import pytest
import warm

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "bench.py"


def run_lora(tmp_path: Path, mb: int, *methods: str) -> dict[str, Any]:
    """`bench.py --workloads lora` at `mb` MB of state, one round of one timed save."""
    out = tmp_path / "lora.json"
    done = warm.run(
        [sys.executable, str(BENCH), "--workloads", "lora", "--lora-mb", str(mb),
         "--lora-rounds", "1", "--lora-saves", "1", "--methods", *methods,
         "--work", str(tmp_path / "work"), "--json", str(out)],
        capture_output=True, text=True, env=dict(os.environ, COLUMNS="160"), timeout=240,
        check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "LoRA targets" in done.stdout
    assert not list((tmp_path / "work").iterdir())  # its work folder is removed
    lora: dict[str, Any] = json.loads(out.read_text())["lora"]
    return lora


def test_frozen_base_sends_what_changed_and_the_control_sends_everything(
    tmp_path: Path,
) -> None:
    lora = run_lora(tmp_path, 32, "nebula", "nebula_all_changed", "torch_save")
    state, methods = lora["state"], lora["methods"]
    assert lora["order"] == ["nebula", "nebula_all_changed", "torch_save"]
    # The base is ~95% of the state; what a step changes is the rest, counted once.
    assert state["frozen_bytes"] + state["changed_bytes"] == state["state_bytes"]
    assert 0.9 < state["frozen_bytes"] / state["state_bytes"] < 0.97

    def median(name: str, key: str) -> float:
        return float(methods[name][key]["median"])

    # Every row persists a complete checkpoint: torch.save's file is the whole state.
    assert median("torch_save", "bytes_written") >= state["state_bytes"]
    for name in ("nebula", "nebula_all_changed"):
        assert median(name, "size_bytes") >= state["state_bytes"]
        assert len(methods[name]["cold_saves"]) == 2  # timed apart from the steady save
    # The control's base changes every step: nothing can be reused, all of it is sent.
    assert median("nebula_all_changed", "bytes_written") == median(
        "nebula_all_changed", "size_bytes"
    )
    # The save copies every tensor byte; torch's own bytes stay in the buffer that holds them.
    assert median("nebula_all_changed", "copied_bytes") == state["state_bytes"]
    # The frozen base is neither copied by the save nor sent by the persist.
    changed = state["changed_bytes"]
    written = median("nebula", "bytes_written")
    assert written + median("nebula", "bytes_reused") == median("nebula", "size_bytes")
    assert written <= 1.2 * changed
    assert median("nebula", "copied_bytes") <= 1.2 * changed
    ratios = {(r["name"], r["method"]): r for r in lora["ratios"]}
    assert ratios["lora_bytes_vs_changed", "nebula"]["value"] == pytest.approx(written / changed)
    assert ratios["lora_bytes_vs_changed", "nebula"]["pass"] is True
    stall = ratios["lora_stall_vs_all_changed", "nebula"]["value"]
    assert stall == pytest.approx(
        median("nebula", "stall_s") / median("nebula_all_changed", "stall_s")
    )
    assert ratios["lora_bytes_vs_changed", "nebula_azure"]["value"] is None  # not run


@pytest.mark.slow
def test_the_azurite_row_counts_what_the_client_uploads(tmp_path: Path) -> None:
    if azurite_server.binary() is None:
        pytest.skip(azurite_server.MISSING)
    lora = run_lora(tmp_path, 8, "nebula_azure")
    fig = lora["methods"]["nebula_azure"]
    assert fig["root"] == "azurite" and "unavailable" not in fig
    sample = fig["samples"][0]
    assert sample["tag"].startswith("global_step")
    # From the checkpoint's persistent rows: uploaded + staged from the older version.
    assert sample["bytes_written"] > 0
    assert sample["bytes_written"] + sample["bytes_reused"] == sample["size_bytes"]
    assert sample["size_bytes"] >= lora["state"]["state_bytes"]
    assert sample["copied_bytes"] < sample["size_bytes"]  # the save itself skipped the base
    ratio = {r["method"]: r for r in lora["ratios"]}["nebula_azure"]
    assert ratio["value"] == pytest.approx(sample["bytes_written"] / lora["state"]["changed_bytes"])
