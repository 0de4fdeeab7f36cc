"""Persist throughput to Azure Blob Storage: nebula vs a plain adlfs upload, one Azurite.

    python benchmarks/azure_persist.py [--size-mb 256] [--repeat 3] [--json FILE]

Starts its own Azurite (as the tests do: 127.0.0.1, a free port, a temporary data folder,
telemetry off) and, in one run, times interleaved repetitions of

  plain   adlfs `AzureBlobFileSystem.put_file` of a local file of SIZE MiB (the SDK's
          parallel block upload, adlfs's defaults);
  nebula  `nm.flush_persistence()` of a committed checkpoint of the same size from the
          memory tier to `az://` (the persister's whole path: blocks in parallel, checksum,
          markers, manifest create-only, history row);

and prints MB/s (10^6 bytes per second) of each, their medians, and nebula / plain
(target: >= 0.80). Both upload to the same Azurite, so the emulator's own speed (it is
one Node.js process) bounds both alike. Not a test: the figure belongs in a report.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from azurite import VERSION, Azurite, binary  # noqa: E402

CONTAINER = "bench"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=int, default=256, help="checkpoint size in MiB")
    parser.add_argument("--repeat", type=int, default=3, help="repetitions of each")
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    args = parser.parse_args(argv)
    if binary() is None:
        sys.stderr.write("Azurite is not installed: run `make test` (or `make bench`) first\n")
        return 2

    work = Path(tempfile.mkdtemp(prefix="nebula-azbench-"))
    os.environ["NEBULA_MEMORY_TIER_PATH"] = str(work / "memory-tier")
    server = Azurite(work / "azurite", log_path=work / "azurite.log").start()
    try:
        server.create_container(CONTAINER)
        result = run(server, work, args.size_mb, args.repeat)
    finally:
        server.stop()
    report(result, server, args.size_mb)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


def run(server: Azurite, work: Path, size_mb: int, repeat: int) -> dict[str, object]:
    import adlfs
    import torch

    import nebulaml as nm

    size = size_mb << 20
    payload = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=torch.Generator())
    local = work / "plain.bin"
    local.write_bytes(payload.numpy().tobytes())
    plain_fs = adlfs.AzureBlobFileSystem(connection_string=server.connection_string)

    url = f"az://{CONTAINER}/nebula"
    options = {"connection_string": server.connection_string}
    nm.init(url, persistent_time_interval=3600, num_of_version_in_retention=repeat + 1,
            storage_options=options)  # fmt: skip
    rows: list[dict[str, float]] = []
    for i in range(1, repeat + 1):
        nm.Checkpoint(f"global_step{i}").save("model", {"w": payload})  # memory tier only

        def plain_upload(i: int = i) -> float:
            start = time.perf_counter()
            plain_fs.put_file(str(local), f"{CONTAINER}/plain/blob{i}")
            return time.perf_counter() - start

        def nebula_persist() -> float:
            start = time.perf_counter()
            nm.flush_persistence()
            return time.perf_counter() - start

        # Alternate which goes first: Azurite slows as its data folder grows.
        if i % 2:
            plain_s, nebula_s = plain_upload(), nebula_persist()
        else:
            nebula_s, plain_s = nebula_persist(), plain_upload()
        tag = f"global_step{i}"
        item_bytes = next(c["size_bytes"] for c in nm.list_checkpoints() if c["tag"] == tag)
        rows.append(
            {
                "run": i,
                "plain_s": plain_s,
                "plain_mb_s": size / plain_s / 1e6,
                "nebula_s": nebula_s,
                "nebula_bytes": item_bytes,
                "nebula_mb_s": item_bytes / nebula_s / 1e6,
            }
        )
        print(
            f"run {i}: plain adlfs {rows[-1]['plain_mb_s']:7.1f} MB/s ({plain_s:.2f} s)   "
            f"nebula persist {rows[-1]['nebula_mb_s']:7.1f} MB/s ({nebula_s:.2f} s)",
            flush=True,
        )
    nm.shutdown()
    plain = statistics.median(r["plain_mb_s"] for r in rows)
    nebula = statistics.median(r["nebula_mb_s"] for r in rows)
    return {
        "size_bytes": size,
        "repeat": repeat,
        "plain_mb_s": round(plain, 1),
        "nebula_mb_s": round(nebula, 1),
        "ratio": round(nebula / plain, 3),
        "runs": rows,
    }


def report(result: dict[str, object], server: Azurite, size_mb: int) -> None:
    print()
    print(f"Azure persist, {size_mb} MiB, Azurite {VERSION} on 127.0.0.1:{server.port}, "
          f"{os.cpu_count()} CPUs (median of {result['repeat']})")  # fmt: skip
    print("| backend | plain adlfs put_file MB/s | nebula persist MB/s | nebula / plain |")
    print("| --- | --- | --- | --- |")
    print(f"| Azure (Azurite) | {result['plain_mb_s']} | {result['nebula_mb_s']} | "
          f"{result['ratio']:.2f} (target >= 0.80) |")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
