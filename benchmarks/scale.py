"""How commit latency grows with the number of ranks (`make scale`).

Simulates N ranks writing one small item each into the same tag on a local root, through
the real commit protocol (writer marker, item, rank marker; the last rank to arrive
publishes the manifest). The figure that matters is the commit latency: the time the last
rank spends in `commit_rank`, from publishing its marker to the manifest being written,
which reads every rank's marker once. It must grow no faster than linearly.

Usage: python benchmarks/scale.py [--ranks 64 128 256] [--repeats 3] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from nebulaml.format.manifest import utc_now
from nebulaml.protocol.commit import begin_tag, commit_rank, write_item
from nebulaml.storage.store import Store


def measure(world_size: int, root: Path) -> dict[str, float]:
    """One simulated checkpoint of `world_size` ranks; timings in seconds."""
    store = Store(root)
    tag = "global_step1"
    created = utc_now()
    marker_s = []
    commit_s = 0.0
    manifest = None
    for rank in range(world_size):
        begin_tag(store, tag, rank=rank, overwrite=False, world_size=world_size)
        entry = write_item(
            store, tag, f"shard_rank{rank}", {"w": torch.full((256,), rank)}, rank=rank
        )
        t0 = time.perf_counter()
        manifest = commit_rank(
            store, tag, rank=rank, world_size=world_size, items=[entry], created_at=created
        )
        elapsed = time.perf_counter() - t0
        if rank < world_size - 1:
            marker_s.append(elapsed)
        else:
            commit_s = elapsed
    assert manifest is not None and len(manifest.items) == world_size
    return {
        "ranks": world_size,
        "commit_latency_s": commit_s,
        "marker_publish_s": statistics.median(marker_s) if marker_s else 0.0,
        "manifest_bytes": len(manifest.to_bytes()),
    }


def run(ranks: list[int], repeats: int) -> list[dict[str, float]]:
    """The median of `repeats` runs for each number of ranks, interleaved."""
    samples: dict[int, list[dict[str, float]]] = {n: [] for n in ranks}
    for _ in range(repeats):
        for n in ranks:
            with tempfile.TemporaryDirectory() as tmp:
                samples[n].append(measure(n, Path(tmp) / "root"))
    rows = []
    for n in ranks:
        runs = samples[n]
        rows.append(
            {
                "ranks": n,
                "commit_latency_s": statistics.median(r["commit_latency_s"] for r in runs),
                "marker_publish_s": statistics.median(r["marker_publish_s"] for r in runs),
                "manifest_bytes": runs[0]["manifest_bytes"],
            }
        )
    base = rows[0]
    for row in rows:
        # > 1 means faster than linear growth from the smallest size; < 1, slower.
        row["latency_per_rank_vs_smallest"] = (row["commit_latency_s"] / row["ranks"]) / (
            base["commit_latency_s"] / base["ranks"]
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args(argv)
    rows = run(sorted(args.ranks), args.repeats)
    print(f"{'ranks':>6} {'commit latency':>15} {'per rank vs smallest':>21} "
          f"{'marker publish':>15} {'manifest':>9}")  # fmt: skip
    for r in rows:
        print(
            f"{r['ranks']:>6} {r['commit_latency_s'] * 1e3:>12.1f} ms "
            f"{r['latency_per_rank_vs_smallest']:>20.2f}x "
            f"{r['marker_publish_s'] * 1e3:>12.2f} ms {r['manifest_bytes']:>8} B"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
