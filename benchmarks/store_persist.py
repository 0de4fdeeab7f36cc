"""Persist throughput to each persistent tier: nebula vs a plain upload of the same bytes,
to a local disk, to Azure Blob Storage (Azurite) and to S3 (moto's server), in one run.

    python benchmarks/store_persist.py [--stores local azure s3] [--size-mb 256]
                                       [--repeat 3] [--json FILE]

Starts its own servers (as the tests do: 127.0.0.1, a free port, a temporary folder;
Azurite with telemetry off, moto's server from the dev extra) and, for each store in
turn, times interleaved repetitions of

  plain   the store's own upload of a local file of SIZE MiB: a write and an fsync
          (local), adlfs `put_file` (the SDK's parallel block upload), s3fs `put_file`
          (a multipart upload, s3fs's defaults);
  nebula  `nm.flush_persistence()` of a committed checkpoint of the same size from the
          memory tier to the store (the persister's whole path: the item in parallel
          blocks or parts, checksum, markers, manifest create-only, history row);

and prints MB/s (10^6 bytes per second) of each, their medians, and nebula / plain
(target: >= 0.80). The bytes are counted where they land: what the store holds under the
plain upload's name and under the checkpoint's folder after each (its own listing: the
disk's, the blob service's, the S3 server's), not what nebula says it wrote. Both
methods upload to the same server, so an emulator's own speed (Azurite is one Node.js
process, moto one Python process keeping every object in its memory) bounds both alike:
these figures compare nebula with the store's SDK, not the stores with each other. Not a
test: the figures belong in a report (docs/benchmarks.md).

Not for: what a checkpoint costs when little changed (benchmarks/lora.py).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

import azurite  # noqa: E402
import s3server  # noqa: E402

BUCKET = "bench"  # the Azure container, or the S3 bucket
STORES = ("local", "azure", "s3")


@dataclass
class Target:
    """One store to persist to: its root and options, the plain upload to compare with,
    and what the store holds under a name (bytes landed)."""

    name: str
    server: str  # what serves it, for the report
    url: str  # its root: "nebula" under the store's top
    options: dict[str, Any]
    upload: Callable[[Path, str], None]  # (local file, name under the store's plain area)
    landed: Callable[[str], int]  # bytes the store holds under a name ("plain/blob1", ...)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stores", nargs="+", choices=STORES, default=list(STORES))
    parser.add_argument("--size-mb", type=int, default=256, help="checkpoint size in MiB")
    parser.add_argument("--repeat", type=int, default=3, help="repetitions of each")
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    args = parser.parse_args(argv)
    if "azure" in args.stores and azurite.binary() is None:
        sys.stderr.write("Azurite is not installed: run `make azurite` (or `make test`) first\n")
        return 2
    if "s3" in args.stores and not s3server.installed():
        sys.stderr.write(s3server.MISSING + "\n")
        return 2

    results: dict[str, dict[str, object]] = {}
    with tempfile.TemporaryDirectory(prefix="nebula-storebench-") as tmp:
        work = Path(tmp)
        os.environ["NEBULA_MEMORY_TIER_PATH"] = str(work / "memory-tier")
        payload = _payload(args.size_mb << 20)
        local = work / "plain.bin"
        local.write_bytes(payload.numpy().tobytes())
        for name in args.stores:
            with _target(name, work) as target:
                print(f"{name} ({target.server}):", flush=True)
                results[name] = run(target, payload, local, args.repeat)
                results[name]["server"] = target.server
    report(results, args.size_mb, args.repeat)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


def _payload(size: int) -> Any:
    import torch

    return torch.randint(0, 256, (size,), dtype=torch.uint8, generator=torch.Generator())


@contextlib.contextmanager
def _target(name: str, work: Path) -> Iterator[Target]:
    """The store `name`, its server started for the block (and stopped after it)."""
    if name == "local":
        root = work / "local"
        (root / "plain").mkdir(parents=True)

        def write(src: Path, dest: str) -> None:
            with open(src, "rb") as f, open(root / dest, "wb") as out:
                out.write(f.read())
                out.flush()
                os.fsync(out.fileno())

        yield Target("local", f"a local disk ({root})", str(root / "nebula"), {}, write,
                     lambda under: _tree_bytes(root / under))  # fmt: skip
    elif name == "azure":
        import adlfs

        server = azurite.Azurite(work / "azurite", log_path=work / "azurite.log").start()
        try:
            server.create_container(BUCKET)
            fs = adlfs.AzureBlobFileSystem(connection_string=server.connection_string)
            yield Target(
                "azure", f"Azurite {azurite.VERSION} on 127.0.0.1:{server.port}",
                f"az://{BUCKET}/nebula", {"connection_string": server.connection_string},
                lambda src, dest: fs.put_file(str(src), f"{BUCKET}/{dest}"),
                lambda under: int(fs.du(f"{BUCKET}/{under}")),
            )  # fmt: skip
        finally:
            server.stop()
    else:
        import importlib.metadata

        import s3fs

        server = s3server.MotoServer(work / "moto.log").start()
        try:
            server.create_bucket(BUCKET)
            fs = s3fs.S3FileSystem(skip_instance_cache=True, **server.options())
            moto = importlib.metadata.version("moto")
            yield Target(
                "s3", f"moto {moto} on 127.0.0.1:{server.port}", f"s3://{BUCKET}/nebula",
                server.options(),
                lambda src, dest: fs.put_file(str(src), f"{BUCKET}/{dest}"),
                lambda under: int(fs.du(f"{BUCKET}/{under}")),
            )  # fmt: skip
        finally:
            server.stop()


def _tree_bytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def run(target: Target, payload: Any, local: Path, repeat: int) -> dict[str, object]:
    import nebulaml as nm

    size = local.stat().st_size
    nm.init(target.url, persistent_time_interval=3600, num_of_version_in_retention=2,
            storage_options=target.options)  # fmt: skip
    # The session's first checkpoint is persisted at once, beside whatever runs then: a
    # small one first, so that each timed one waits for its flush.
    nm.Checkpoint("global_step0").save("model", {"w": payload[:1024]})
    assert nm.flush_persistence() is True
    rows: list[dict[str, float]] = []
    for i in range(1, repeat + 1):
        tag = f"global_step{i}"
        nm.Checkpoint(tag).save("model", {"w": payload})  # memory tier only

        def plain_upload(i: int = i) -> float:
            start = time.perf_counter()
            target.upload(local, f"plain/blob{i}")
            return time.perf_counter() - start

        def nebula_persist() -> float:
            start = time.perf_counter()
            assert nm.flush_persistence() is True
            return time.perf_counter() - start

        # Alternate which goes first: a store may slow as it fills.
        if i % 2:
            plain_s, nebula_s = plain_upload(), nebula_persist()
        else:
            nebula_s, plain_s = nebula_persist(), plain_upload()
        plain_bytes = target.landed(f"plain/blob{i}")
        nebula_bytes = target.landed(f"nebula/{tag}")
        rows.append(
            {
                "run": i,
                "plain_s": plain_s,
                "plain_bytes": plain_bytes,
                "plain_mb_s": plain_bytes / plain_s / 1e6,
                "nebula_s": nebula_s,
                "nebula_bytes": nebula_bytes,
                "nebula_mb_s": nebula_bytes / nebula_s / 1e6,
            }
        )
        print(
            f"  run {i}: plain {rows[-1]['plain_mb_s']:7.1f} MB/s ({plain_s:.2f} s)   "
            f"nebula persist {rows[-1]['nebula_mb_s']:7.1f} MB/s ({nebula_s:.2f} s, "
            f"{nebula_bytes / size:.4f}x the item landed)",
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


PLAIN = {"local": "write+fsync", "azure": "adlfs put_file", "s3": "s3fs put_file"}
LABEL = {"local": "local disk", "azure": "Azure (Azurite)", "s3": "S3 (moto)"}


def report(results: dict[str, dict[str, object]], size_mb: int, repeat: int) -> None:
    print()
    print(f"Persist throughput, {size_mb} MiB, {os.cpu_count()} CPUs, median of {repeat}; "
          "bytes as the store lists them")  # fmt: skip
    for name, result in results.items():
        print(f"  {name}: {result['server']}")
    print("| store | plain upload | plain MB/s | nebula persist MB/s | nebula / plain |")
    print("| --- | --- | --- | --- | --- |")
    for name, result in results.items():
        print(f"| {LABEL[name]} | {PLAIN[name]} | {result['plain_mb_s']} | "
              f"{result['nebula_mb_s']} | {result['ratio']:.2f} (target >= 0.80) |")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
