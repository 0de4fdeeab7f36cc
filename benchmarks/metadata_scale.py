"""How nebula's metadata operations grow with the number of checkpoints on a root (issue #29).

    python benchmarks/metadata_scale.py [--quick] [--local 100 1000 10000] [--azure 100 1000]
        [--rounds 20] [--repeats 5] [--json FILE] [--profile N]

For each N, builds a persistent root holding N committed checkpoints of 1 KiB of tensor
data (`global_step1` .. `global_stepN`), then times, on that root:

  commit+persist      `nm.init(root, persistent_time_interval=0,
                      num_of_version_in_retention=N+100)`, then rounds of a 1 KiB
                      `Checkpoint(global_step<higher>).save` + `nm.flush_persistence()`:
                      the median seconds per round (`--rounds`, fewer once a root has
                      taken `--round-budget` seconds); `init` and the first round apart
  list_checkpoints    `nm.list_checkpoints(root)`, median (the first call of a process
                      apart)
  get_latest          `nm.get_latest_checkpoint(root)`, released at once, median
  nebula ls/verify    the `nebula` console script beside this Python (wall time, a process
                      each: Python's and nebula's imports included; the CLI's start-up on
                      an empty root is printed apart)
  nebula prune        `nebula prune COPY --keep 2 --yes` on a copy of the root (wall time)

Local roots (100, 1,000 and 10,000 tags) live in a temporary folder on the disk of
`--work` (default: the system's temporary folder); Azure roots (100 and 1,000) on an
Azurite this script starts as the tests do (`make azurite` installs it; 127.0.0.1, a free
port, `--skipApiVersionCheck`). Each measurement runs in a fresh process; the memory tier
is a temporary folder (`NEBULA_MEMORY_TIER_PATH`), not /dev/shm, and everything is removed
at the end.

Building N checkpoints through the API would take minutes (about a dozen commits a
second), so each root gets one real checkpoint, `global_step1`, saved through the API
(which also writes the root's identity and history), and `global_step2` .. `global_stepN`
are its clones: the same item file (hard-linked locally, uploaded to Azure), its rank
marker, and a manifest of their own (tag, step i, commit sequence i, increasing times),
sealed by nebula's own `Manifest.to_bytes`. The root is checked before it is timed:
`nm.list_checkpoints` must list N (and `nebula verify` pass).

Prints one table (rows: operations; columns: N per backend) and the targets of #29 at
10,000 local tags: a persist within 1.5x of its time at 100 tags, `list_checkpoints`
<= 1 s, `prune` <= 20 s. Writes the figures to benchmarks/results/metadata-scale.json
(`-quick` with `--quick`: 100 and 1,000 local tags only). `--profile N` instead prints
cProfile's top 15 (cumulative) of `list_checkpoints` and of one commit+persist on a local
root of N tags (the persister thread's work profiled in that thread).

Run it with another tree's code by putting that tree first on PYTHONPATH
(`PYTHONPATH=TREE/core:TREE`): the workers and the console script inherit it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
CONTAINER = "metadata"
TEMPLATE_TAG = "global_step1"
TENSOR_ELEMENTS = 256  # float32: 1 KiB of tensor data per checkpoint
LOCAL_SIZES = [100, 1_000, 10_000]
AZURE_SIZES = [100, 1_000]
QUICK_SIZES = [100, 1_000]
# The targets of #29, at the largest local root (10,000 tags).
TARGET_N = 10_000
PERSIST_RATIO_MAX = 1.5
LIST_MAX_S = 1.0
PRUNE_MAX_S = 20.0

# Rows of the table: (key in a column's figures, label).
ROWS = [
    ("persist_round_s", "commit+persist (median/round)"),
    ("persist_first_round_s", "commit+persist (first round)"),
    ("init_s", "nm.init"),
    ("list_s", "list_checkpoints (median)"),
    ("list_first_s", "list_checkpoints (first call)"),
    ("latest_s", "get_latest_checkpoint (median)"),
    ("cli_ls_s", "nebula ls"),
    ("cli_verify_s", "nebula verify"),
    ("cli_prune_s", "nebula prune --keep 2"),
]


def progress(message: str) -> None:
    print(f"[metadata-scale] {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------
# Workers: each runs in a fresh process (`--worker KIND --spec JSON`) and writes its
# figures as JSON to the file the spec names.


def _worker(kind: str, spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    import nebulaml as nm

    root, options = spec["root"], spec.get("storage_options") or {}
    if kind == "seed":
        nm.init(
            root, persistent_time_interval=0, num_of_version_in_retention=2, storage_options=options
        )
        nm.Checkpoint(TEMPLATE_TAG).save("model", {"w": torch.zeros(TENSOR_ELEMENTS)})
        nm.flush_persistence()
        nm.shutdown()
        return {}
    if kind == "api":
        return _measure_api(nm, torch, root, options, spec)
    if kind == "profile":
        return _profile(nm, torch, root, spec)
    raise SystemExit(f"unknown worker {kind!r}")


def _measure_api(
    nm: Any, torch: Any, root: str, options: dict[str, Any], spec: dict[str, Any]
) -> dict[str, Any]:
    n, repeats = spec["n"], spec["repeats"]
    out: dict[str, Any] = {}
    listed = []
    for _ in range(repeats):
        start = time.perf_counter()
        tags = nm.list_checkpoints(root)
        listed.append(time.perf_counter() - start)
        if len(tags) != n:
            raise SystemExit(f"list_checkpoints listed {len(tags)} checkpoints, not {n}")
    out["list_samples_s"] = listed
    latest = []
    for _ in range(repeats):
        start = time.perf_counter()
        handle = nm.get_latest_checkpoint(root)
        latest.append(time.perf_counter() - start)
        if handle is None or handle.tag != f"global_step{n}":
            raise SystemExit(f"get_latest_checkpoint returned {handle!r}, not global_step{n}")
        handle.release()
    out["latest_samples_s"] = latest

    start = time.perf_counter()
    nm.init(
        root,
        persistent_time_interval=0,
        num_of_version_in_retention=n + 100,
        storage_options=options,
    )
    out["init_s"] = time.perf_counter() - start
    rounds: list[float] = []
    began = time.perf_counter()
    for r in range(spec["rounds"]):
        if r >= 3 and time.perf_counter() - began > spec["round_budget_s"]:
            break
        state = {"w": torch.full((TENSOR_ELEMENTS,), float(r))}
        start = time.perf_counter()
        nm.Checkpoint(f"global_step{n + 1 + r}").save("model", state)
        nm.flush_persistence()
        rounds.append(time.perf_counter() - start)
    out["round_samples_s"] = rounds
    handle = nm.get_latest_checkpoint()
    if handle is None or handle.tag != f"global_step{n + len(rounds)}":
        raise SystemExit(f"after the rounds the newest is {handle!r}")
    handle.release()
    nm.shutdown()
    return out


def _profile(nm: Any, torch: Any, root: str, spec: dict[str, Any]) -> dict[str, Any]:
    """cProfile of list_checkpoints (this thread) and of one commit+persist: the save and
    flush in this thread, the persist and what follows it in the persister thread (its methods
    wrapped so that each runs under the profiler in that thread)."""
    import cProfile
    import functools
    import io
    import pstats

    def top(profile: cProfile.Profile, title: str) -> None:
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("cumulative").print_stats(15)
        print(f"\n===== {title} =====\n{text.getvalue()}", flush=True)

    n = spec["n"]
    # A fresh process's first listing writes a listing hold per tag: profiled in a child,
    # before anything here holds the tags; then a later call of this process.
    code = (
        "import cProfile, pstats, sys, nebulaml as nm; p = cProfile.Profile(); "
        "p.runcall(nm.list_checkpoints, sys.argv[1]); "
        "pstats.Stats(p).sort_stats('cumulative').print_stats(15)"
    )
    print(f"\n===== nm.list_checkpoints at {n} tags (first call of a process) =====", flush=True)
    subprocess.run([sys.executable, "-c", code, root], check=True)
    nm.list_checkpoints(root)
    profile = cProfile.Profile()
    profile.runcall(nm.list_checkpoints, root)
    top(profile, f"nm.list_checkpoints at {n} tags (a later call)")
    nm.init(root, persistent_time_interval=0, num_of_version_in_retention=n + 100)
    nm.Checkpoint(f"global_step{n + 1}").save("model", {"w": torch.zeros(TENSOR_ELEMENTS)})
    nm.flush_persistence()  # warm: the persister's start-up work is not a round's
    thread_profile = cProfile.Profile()
    try:
        from nebulaml.runtime.persist_actions import Persisting, Retention
    except ImportError:  # another layout: the main thread's profile only
        Persisting = Retention = None
    wrapped = []
    for owner, name in ((Persisting, "persist"), (Retention, "apply")):
        method = getattr(owner, name, None)
        if method is None:
            continue

        @functools.wraps(method)
        def run(self: Any, *args: Any, _method: Any = method, **kwargs: Any) -> Any:
            thread_profile.enable()
            try:
                return _method(self, *args, **kwargs)
            finally:
                thread_profile.disable()

        setattr(owner, name, run)
        wrapped.append((owner, name, method))

    def one_round() -> None:
        nm.Checkpoint(f"global_step{n + 2}").save("model", {"w": torch.ones(TENSOR_ELEMENTS)})
        nm.flush_persistence()

    profile = cProfile.Profile()
    start = time.perf_counter()
    profile.runcall(one_round)
    elapsed = time.perf_counter() - start
    for owner, name, method in wrapped:
        setattr(owner, name, method)
    top(profile, f"one commit+persist at {n} tags, training thread ({elapsed:.3f} s)")
    if wrapped:
        top(thread_profile, f"the same, persister thread ({', '.join(w for w, _ in wrapped)})")
    nm.shutdown()
    return {}


def run_worker(
    kind: str, spec: dict[str, Any], work: Path, timeout_s: float, script: str = __file__
) -> dict[str, Any]:
    """Run a worker of `script` (default: this one) in a fresh process; its figures, or
    {"error": ...}."""
    out = work / f"worker-{kind}-{time.monotonic_ns()}.json"
    spec = {**spec, "out": str(out)}
    cmd = [
        sys.executable,
        str(Path(script).resolve()),
        "--worker",
        kind,
        "--spec",
        json.dumps(spec),
    ]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout_s:.0f} s"}
    if proc.returncode != 0 or not out.exists():
        tail = (proc.stdout + proc.stderr).strip()[-2000:]
        return {"error": f"worker {kind} exited {proc.returncode}: {tail}"}
    figures: dict[str, Any] = json.loads(out.read_text())
    out.unlink()
    return figures


# ---------------------------------------------------------------------------------------
# Building a root of N committed checkpoints.


def clone_tags(template: dict[str, bytes], n: int, write: Any) -> None:
    """`write(tag, file, data)` for the files of `global_step2` .. `global_stepN`: the
    template's items and rank marker as they are (the marker with its tag renamed), and
    a manifest of its own: tag, step i, sequence i, and times a few microseconds apart
    after the template's (so all in the past once the clones are written); and its entry
    in the root's commit index, as a commit of this version writes it."""
    import dataclasses
    from datetime import timedelta

    from nebulaml.format.manifest import parse_manifest, parse_utc
    from nebulaml.format.names import MANIFEST_NAME
    from nebulaml.protocol.index_names import begun_path, entry_path

    manifest = parse_manifest(template[MANIFEST_NAME], "template manifest")
    markers = {
        name: json.loads(data) for name, data in template.items() if name.startswith(".rank-")
    }
    assert markers, "the template has no rank marker"
    assert manifest.sequence == 1, f"the template's sequence is {manifest.sequence}, not 1"
    base = parse_utc(manifest.committed_at)
    assert base is not None, manifest.committed_at

    def stamp(microseconds: int) -> str:
        return (base + timedelta(microseconds=microseconds)).strftime("%Y-%m-%dT%H:%M:%S.%fZ")

    for i in range(2, n + 1):
        tag = f"global_step{i}"
        for item in manifest.items:
            write(tag, item.file, template[item.file])
        for name, doc in markers.items():
            doc = {**doc, "tag": tag, "created_at": stamp(2 * i)}
            write(tag, name, (json.dumps(doc, sort_keys=True) + "\n").encode())
        clone = dataclasses.replace(
            manifest,
            tag=tag,
            step=i,
            sequence=i,
            created_at=stamp(2 * i),
            committed_at=stamp(2 * i + 1),
        )
        # Its begun record and its entry, in its step's bucket (protocol/index_names.py).
        for path in (begun_path(tag), entry_path(tag, i)):
            write("/".join(path[:-1]), path[-1], b"")
        write(tag, MANIFEST_NAME, clone.to_bytes())


def build_local(root: Path, n: int, work: Path, timeout_s: float) -> None:
    """A local root of N committed checkpoints (see the module's docstring)."""
    seeded = run_worker("seed", {"root": str(root)}, work, timeout_s)
    if "error" in seeded:
        raise RuntimeError(f"seeding {root}: {seeded['error']}")
    folder = root / TEMPLATE_TAG
    template = {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}
    # Items are hard-linked to the template's (one inode); markers and manifests written.
    from nebulaml.format.manifest import parse_manifest
    from nebulaml.format.names import MANIFEST_NAME

    items = {item.file for item in parse_manifest(template[MANIFEST_NAME], "t").items}
    made: set[str] = set()

    def write(tag: str, name: str, data: bytes) -> None:
        tag_dir = root / tag
        if tag not in made:
            tag_dir.mkdir(mode=0o700, parents=True, exist_ok=True)  # the index's buckets
            made.add(tag)
        if name in items:
            os.link(folder / name, tag_dir / name)
            return
        fd = os.open(tag_dir / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)

    clone_tags(template, n, write)


def copy_local(root: Path, dest: Path) -> None:
    """A copy of a local root for prune to delete from (files hard-linked: prune
    unlinks, it never writes into a file)."""
    shutil.copytree(root, dest, copy_function=os.link)


class AzureSide:
    """One Azurite, its container, and an fsspec filesystem on it."""

    def __init__(self, work: Path) -> None:
        sys.path.insert(0, str(REPO / "tests"))
        from azurite import Azurite, binary

        if binary() is None:
            raise RuntimeError("Azurite is not installed: run `make azurite` first")
        self.server = Azurite(work / "azurite", log_path=work / "azurite.log").start()
        self.server.create_container(CONTAINER)
        import adlfs

        self.fs = adlfs.AzureBlobFileSystem(connection_string=self.server.connection_string)
        self.options = {"connection_string": self.server.connection_string}

    def url(self, name: str) -> str:
        return f"az://{CONTAINER}/{name}"

    def build(self, name: str, n: int, work: Path, timeout_s: float) -> None:
        """An az:// root of N committed checkpoints: global_step1 saved through the API,
        its clones written to a local folder and uploaded (fsspec put, in batches)."""
        spec = {"root": self.url(name), "storage_options": self.options}
        seeded = run_worker("seed", spec, work, timeout_s)
        if "error" in seeded:
            raise RuntimeError(f"seeding {spec['root']}: {seeded['error']}")
        remote = f"{CONTAINER}/{name}/{TEMPLATE_TAG}"
        template = {Path(p).name: self.fs.cat_file(p) for p in self.fs.find(remote)}
        staging = work / f"staging-{name}"
        lpaths: list[str] = []
        rpaths: list[str] = []

        def write(tag: str, file: str, data: bytes) -> None:
            path = staging / tag / file
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
            lpaths.append(str(path))
            rpaths.append(f"{CONTAINER}/{name}/{tag}/{file}")

        clone_tags(template, n, write)
        self.fs.put(lpaths, rpaths)
        shutil.rmtree(staging)

    def count_committed(self, name: str) -> int:
        return len(self.fs.glob(f"{CONTAINER}/{name}/*/manifest.json"))

    def stop(self) -> None:
        self.server.stop()


# ---------------------------------------------------------------------------------------
# The CLI, timed as a process.


def nebula_cli() -> list[str]:
    """The console script installed beside this Python (it imports nebula_cli from
    PYTHONPATH first, as this script's workers do)."""
    script = Path(sys.executable).parent / "nebula"
    return (
        [str(script)]
        if script.exists()
        else [
            sys.executable,
            "-c",
            "import sys; from nebula_cli.app import main; sys.argv[0] = 'nebula'; main()",
        ]
    )


def time_cli(args: list[str], timeout_s: float) -> dict[str, Any]:
    start = time.perf_counter()
    try:
        proc = subprocess.run(
            [*nebula_cli(), *args],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired:
        return {"s": None, "error": f"timed out after {timeout_s:.0f} s"}
    elapsed = time.perf_counter() - start
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr).strip()[-1500:]
        return {"s": elapsed, "error": f"exit {proc.returncode}: {tail}"}
    return {"s": elapsed, "stdout_lines": proc.stdout.count("\n")}


# ---------------------------------------------------------------------------------------
# One column: a backend at one N.


def measure_column(
    backend: str, n: int, args: argparse.Namespace, work: Path, azure: AzureSide | None
) -> dict[str, Any]:
    col: dict[str, Any] = {"backend": backend, "n": n, "errors": {}}
    t0 = time.perf_counter()
    if backend == "local":
        root_path, copy_path = work / f"root-{n}", work / f"prune-{n}"
        build_local(root_path, n, work, args.timeout)
        copy_local(root_path, copy_path)
        root, copy, options = str(root_path), str(copy_path), {}
    else:
        assert azure is not None
        azure.build(f"root-{n}", n, work, args.timeout)
        azure.build(f"prune-{n}", n, work, args.timeout)
        root, copy, options = azure.url(f"root-{n}"), azure.url(f"prune-{n}"), azure.options
    col["build_s"] = time.perf_counter() - t0
    progress(f"{backend} {n}: built in {col['build_s']:.1f} s; timing")

    for key, cli_args in (("cli_ls_s", ["ls", root]), ("cli_verify_s", ["verify", root, "-q"])):
        result = time_cli(cli_args, args.timeout)
        col[key] = result["s"]
        if "error" in result:
            col["errors"][key] = result["error"]
        progress(f"{backend} {n}: {' '.join(cli_args[:1])} {_fmt(result['s'])}")

    spec = {
        "root": root,
        "storage_options": options,
        "n": n,
        "repeats": args.repeats,
        "rounds": args.rounds,
        "round_budget_s": args.round_budget,
    }
    api = run_worker("api", spec, work, args.timeout)
    if "error" in api:
        col["errors"]["api"] = api["error"]
    else:
        col["list_samples_s"] = api["list_samples_s"]
        col["list_first_s"] = api["list_samples_s"][0]
        col["list_s"] = statistics.median(api["list_samples_s"])
        col["latest_samples_s"] = api["latest_samples_s"]
        col["latest_s"] = statistics.median(api["latest_samples_s"])
        col["init_s"] = api["init_s"]
        col["round_samples_s"] = api["round_samples_s"]
        col["persist_first_round_s"] = api["round_samples_s"][0]
        col["persist_round_s"] = statistics.median(api["round_samples_s"])
        col["rounds"] = len(api["round_samples_s"])
    progress(
        f"{backend} {n}: api {_fmt(col.get('list_s'))} list, "
        f"{_fmt(col.get('persist_round_s'))}/round"
    )

    result = time_cli(["prune", copy, "--keep", "2", "--yes"], args.timeout)
    col["cli_prune_s"] = result["s"]
    if "error" in result:
        col["errors"]["cli_prune_s"] = result["error"]
    if backend == "local":
        left = sum(1 for d in Path(copy).iterdir() if (d / "manifest.json").exists())
    else:
        assert azure is not None
        left = azure.count_committed(f"prune-{n}")
    col["prune_left"] = left
    if "error" not in result and left != 2:
        col["errors"]["cli_prune_s"] = f"{left} committed checkpoints left, not 2"
    progress(f"{backend} {n}: prune {_fmt(result['s'])} ({left} left)")

    if backend == "local":
        shutil.rmtree(root_path)
        shutil.rmtree(copy_path)
    else:
        assert azure is not None
        for name in (f"root-{n}", f"prune-{n}"):
            azure.fs.rm(f"{CONTAINER}/{name}", recursive=True)
    return col


# ---------------------------------------------------------------------------------------
# Report.


def _fmt(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{seconds * 1e3:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"


def targets(columns: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The targets of #29 at 10,000 local tags; `pass` None when not measured."""
    local = {c["n"]: c for c in columns if c["backend"] == "local"}
    big, small = local.get(TARGET_N, {}), local.get(100, {})
    persist, base = big.get("persist_round_s"), small.get("persist_round_s")
    ratio = persist / base if persist is not None and base else None
    out = []
    for name, value, limit, unit in (
        (f"commit+persist at {TARGET_N:,} / at 100 tags", ratio, PERSIST_RATIO_MAX, "x"),
        (f"list_checkpoints at {TARGET_N:,} tags", big.get("list_s"), LIST_MAX_S, " s"),
        (f"nebula prune --keep 2 at {TARGET_N:,} tags", big.get("cli_prune_s"), PRUNE_MAX_S, " s"),
    ):
        failed = name.startswith("nebula prune") and "cli_prune_s" in big.get("errors", {})
        passed = None if value is None else (value <= limit and not failed)
        out.append({"target": name, "value": value, "limit": limit, "unit": unit, "pass": passed})
    return out


def render(doc: dict[str, Any]) -> None:
    columns = doc["columns"]
    heads = [f"{c['backend']} {c['n']:,}" for c in columns]
    width = max(len(label) for _key, label in ROWS) + 2
    print()
    print(
        f"metadata at scale: seconds per operation ({doc['machine']['cpus']} CPUs, "
        f"nebulaml {doc['machine']['nebulaml_commit']} from {doc['machine']['nebulaml']})"
    )
    print(f"{'operation':<{width}}" + "".join(f"{h:>14}" for h in heads))
    for key, label in ROWS:
        cells = []
        for c in columns:
            value, error = c.get(key), key in c["errors"]
            # A value with "!": measured, but the command failed (see the errors below).
            cells.append("FAILED" if value is None and c["errors"] else _fmt(value) + "!" * error)
        print(f"{label:<{width}}" + "".join(f"{cell:>14}" for cell in cells))
    print(
        f"{'(build the root: seed + clones)':<{width}}"
        + "".join(f"{_fmt(c.get('build_s')):>14}" for c in columns)
    )
    print(
        f"CLI start-up (nebula ls on an empty root): {_fmt(doc['cli_startup_s'])}; "
        f"rounds per column: {[c.get('rounds') for c in columns]}"
    )
    render_footer(doc)


def render_footer(doc: dict[str, Any]) -> None:
    """The targets met or not, the errors, and what else used the CPUs."""
    for t in doc["targets"]:
        verdict = {True: "PASS", False: "FAIL", None: "n/a (not measured)"}[t["pass"]]
        value = "-" if t["value"] is None else f"{t['value']:.3g}{t['unit']}"
        print(f"target: {t['target']} <= {t['limit']:g}{t['unit']}: {value}  {verdict}")
    for c in doc["columns"]:
        for key, error in c["errors"].items():
            print(f"error: {c['backend']} {c['n']:,} {key}: {error}")
    print(f"CPU used by other processes during the run: {doc['machine']['other_cpu_share']:.0%}")


class CpuShare:
    """Other processes' share of the CPUs over the run: the system's busy time minus this
    process's and its (waited-for) children's."""

    def __init__(self) -> None:
        self.start = self._read()

    @staticmethod
    def _read() -> tuple[float, float, float]:
        import resource

        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        busy = (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")
        own = sum(
            u.ru_utime + u.ru_stime
            for u in (
                resource.getrusage(resource.RUSAGE_SELF),
                resource.getrusage(resource.RUSAGE_CHILDREN),
            )
        )
        return time.perf_counter(), busy, own

    def other_share(self) -> float:
        t1, busy1, own1 = self._read()
        t0, busy0, own0 = self.start
        wall = (t1 - t0) * (os.cpu_count() or 1)
        return max(0.0, ((busy1 - busy0) - (own1 - own0)) / wall) if wall > 0 else 0.0


def code_commit(tree: Path) -> str | None:
    """The commit of the tree the measured nebulaml comes from (`+dirty` when its core/
    has changes), None outside a git checkout."""
    try:
        git = ["git", "-C", str(tree)]
        head = subprocess.run(
            [*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            [*git, "status", "--porcelain", "--", "core"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("+dirty" if dirty else "")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="100 and 1,000 local tags only")
    parser.add_argument("--local", type=int, nargs="*", help="local root sizes")
    parser.add_argument("--azure", type=int, nargs="*", help="Azurite root sizes")
    parser.add_argument("--rounds", type=int, default=20, help="commit+persist rounds")
    parser.add_argument(
        "--round-budget",
        type=float,
        default=120.0,
        help="seconds of rounds per root, after the first 3",
    )
    parser.add_argument("--repeats", type=int, default=5, help="list/latest repeats")
    parser.add_argument(
        "--timeout", type=float, default=1800.0, help="seconds any one command or worker may take"
    )
    parser.add_argument("--work", type=Path, help="where the roots go (default: $TMPDIR)")
    parser.add_argument("--json", type=Path, help="where to write the figures")
    parser.add_argument(
        "--profile",
        type=int,
        metavar="N",
        help="only profile list_checkpoints and a commit+persist at N tags",
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.worker:
        spec = json.loads(args.spec)
        figures = _worker(args.worker, spec)
        Path(spec["out"]).write_text(json.dumps(figures))
        return 0

    local = args.local if args.local is not None else (QUICK_SIZES if args.quick else LOCAL_SIZES)
    azure_sizes = args.azure if args.azure is not None else ([] if args.quick else AZURE_SIZES)
    work = Path(tempfile.mkdtemp(prefix="nebula-metadata-", dir=args.work))
    os.environ["NEBULA_MEMORY_TIER_PATH"] = str(work / "memory-tier")
    cpu = CpuShare()
    try:
        if args.profile:
            root = work / f"root-{args.profile}"
            build_local(root, args.profile, work, args.timeout)
            code = subprocess.run(
                [
                    sys.executable,
                    str(Path(__file__).resolve()),
                    "--worker",
                    "profile",
                    "--spec",
                    json.dumps(
                        {"root": str(root), "n": args.profile, "out": str(work / "profile.json")}
                    ),
                ],
            ).returncode
            return code

        import nebulaml

        source = Path(nebulaml.__file__).resolve().parents[2]
        empty = work / "empty-root"
        empty.mkdir()
        startup = time_cli(["ls", str(empty)], args.timeout)
        doc: dict[str, Any] = {
            "schema": "nebula-metadata-scale/1",
            "args": {
                "local": local,
                "azure": azure_sizes,
                "rounds": args.rounds,
                "round_budget_s": args.round_budget,
                "repeats": args.repeats,
            },
            "machine": {
                "host": socket.gethostname(),
                "cpus": os.cpu_count(),
                "nebulaml": str(source),
                "nebulaml_commit": code_commit(source),
                "nebula_cli": nebula_cli()[0],
                "loadavg_at_start": os.getloadavg(),
            },
            "cli_startup_s": startup["s"],
            "columns": [],
        }
        doc["columns"] = measure_all(measure_column, local, azure_sizes, args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    doc["targets"] = targets(doc["columns"])
    doc["machine"]["other_cpu_share"] = cpu.other_share()
    render(doc)
    write_results(
        doc, args.json or RESULTS / f"metadata-scale{'-quick' if args.quick else ''}.json"
    )
    return 0


def measure_all(
    measure: Any, local: list[int], azure_sizes: list[int], args: argparse.Namespace, work: Path
) -> list[dict[str, Any]]:
    """`measure(backend, n, args, work, azure)` for each local size, then each Azurite
    size on an Azurite started for them (and stopped): the columns, in that order."""
    columns = [measure("local", n, args, work, None) for n in sorted(local)]
    if azure_sizes:
        azure = AzureSide(work)
        try:
            os.environ["AZURE_STORAGE_CONNECTION_STRING"] = azure.server.connection_string
            columns += [measure("azure", n, args, work, azure) for n in sorted(azure_sizes)]
        finally:
            azure.stop()
    return columns


def write_results(doc: dict[str, Any], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2) + "\n")
    progress(f"wrote {out}")


if __name__ == "__main__":
    sys.exit(main())
