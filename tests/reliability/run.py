"""`make reliability`: run every campaign at full size and print one table of figures.

Usage: python tests/reliability/run.py [--quick]
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from campaigns import Figures, corruption_campaign, crash_campaign, hostile_pickle_campaign


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the short tier's sizes")
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
        ):
            started = time.monotonic()
            figures = run(work / name.replace(" ", "-"))
            runs.append((figures, time.monotonic() - started))
    print(f"{'campaign':<18} {'figure':<34} {'value':>10}")
    failed = False
    for figures, seconds in runs:
        for key, value in sorted(figures.counts.items()):
            print(f"{figures.name:<18} {key:<34} {value:>10}")
        print(f"{figures.name:<18} {'invariant failures':<34} {len(figures.failures):>10}")
        print(f"{figures.name:<18} {'seconds':<34} {seconds:>10.1f}")
        for failure in figures.failures:
            print(f"  FAILED: {failure}")
        failed = failed or bool(figures.failures)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
