"""`make reliability`: run every campaign at full size and print one table of figures.

The campaigns of campaigns.py and concurrency.py return their figures; the scenario files
that are plain tests (disk full, hostile paths, exit signals) are run with pytest, and
their rows count the scenarios that passed, failed and were skipped.

Usage: python tests/reliability/run.py [--quick] [--only CAMPAIGN ...]
"""

from __future__ import annotations

import argparse
import logging
import subprocess
import sys
import tempfile
import time
import warnings
import xml.etree.ElementTree as ET
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
# tests/: the campaigns start their children through tests/warm.py (cold here: no zygote)
sys.path.insert(1, str(Path(__file__).parents[1]))

from campaigns import Figures, corruption_campaign, crash_campaign, hostile_pickle_campaign
from clock_steps import clock_steps_campaign
from concurrency import concurrency_campaign
from elastic import elastic_campaign
from junk import junk_campaign
from node_loss import node_loss_campaign
from operators import operators_campaign
from outages import outage_campaign
from signals import double_signal_campaign
from soak import soak_campaign
from stale_roots import stale_root_campaign
from two_jobs import two_jobs_campaign

HERE = Path(__file__).parent

SCENARIO_FILES = (
    ("disk full", "test_disk_full.py"),
    ("hostile paths", "test_hostile_paths.py"),
    ("exit signals", "test_exit_signals.py"),
    ("hostile namespace", "test_hostile_namespace.py"),
)


def scenario_campaign(name: str, test_file: str, work: Path) -> Figures:
    """Run one scenario file with pytest (in a child process) and count its outcomes."""
    figures = Figures(name)
    work.mkdir(parents=True, exist_ok=True)
    report = work / "junit.xml"
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
               f"--junitxml={report}", str(HERE / test_file)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, check=False, timeout=1800)
    try:
        cases = ET.parse(report).getroot().iter("testcase")
    except (OSError, ET.ParseError):
        figures.failures.append(
            f"pytest {test_file} exited {done.returncode}: {done.stdout[-2000:]}"
        )
        return figures
    for case in cases:
        kinds = {"failure", "error", "skipped"}
        outcome = next((child.tag for child in case if child.tag in kinds), "passed")
        if outcome in ("failure", "error"):
            figures.add("scenarios failed")
            figures.failures.append(f"{test_file}::{case.get('name')}")
        elif outcome == "skipped":
            figures.add("scenarios skipped")
        else:
            figures.add("scenarios passed")
    figures.counts.setdefault("scenarios failed", 0)
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the short tier's sizes")
    parser.add_argument(
        "--only", nargs="+", metavar="CAMPAIGN", help="run only these campaigns (by name)"
    )
    args = parser.parse_args(argv)
    logging.disable(logging.WARNING)
    warnings.simplefilter("ignore")
    runs: list[tuple[Figures, float]] = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for name, run in (
            ("corruption", lambda w: corruption_campaign(w, 80 if args.quick else 1000)),
            ("hostile pickles", hostile_pickle_campaign),
            ("crash", lambda w: crash_campaign(w, 10 if args.quick else 200)),
            ("crash lazy", lambda w: crash_campaign(w, 10 if args.quick else 100, lazy=True)),
            ("concurrency", lambda w: concurrency_campaign(w, 60 if args.quick else 3000)),
            ("double signal", lambda w: double_signal_campaign(w, 3 if args.quick else 20)),
            ("stale roots", lambda w: stale_root_campaign(w, 3 if args.quick else 30)),
            ("two jobs", lambda w: two_jobs_campaign(w, 3 if args.quick else 30)),
            ("operators", lambda w: operators_campaign(w, 2 if args.quick else 20)),
            ("clock steps", lambda w: clock_steps_campaign(w, 40 if args.quick else 600)),
            (
                "outages",
                lambda w: (
                    outage_campaign(w, 3, restarts=2, exits=2)
                    if args.quick
                    else outage_campaign(w, 30)
                ),
            ),
            ("elastic restarts", lambda w: elastic_campaign(w, 3 if args.quick else 30)),
            ("node loss", lambda w: node_loss_campaign(w, 2 if args.quick else 30)),
            ("junk", lambda w: junk_campaign(w, 2 if args.quick else 20)),
            ("soak", lambda w: soak_campaign(w, *((2000, 250) if args.quick else (5000, 1000)))),
            *(
                (name, lambda w, name=name, path=path: scenario_campaign(name, path, w))
                for name, path in SCENARIO_FILES
            ),
        ):
            if args.only and name not in args.only:
                continue
            started = time.monotonic()
            figures = run(work / name.replace(" ", "-"))
            runs.append((figures, time.monotonic() - started))
    print(f"{'campaign':<18} {'figure':<42} {'value':>10}")
    failed = False
    for figures, seconds in runs:
        for key, value in sorted(figures.counts.items()):
            print(f"{figures.name:<18} {key:<42} {value:>10}")
        print(f"{figures.name:<18} {'invariant failures':<42} {len(figures.failures):>10}")
        print(f"{figures.name:<18} {'seconds':<42} {seconds:>10.1f}")
        for failure in figures.failures:
            print(f"  FAILED: {failure}")
        failed = failed or bool(figures.failures)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
