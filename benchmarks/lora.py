"""The LoRA fine-tune workload (issue #30): what a checkpoint costs when 95% of the state
is frozen, for nebula and each peer, against nebula on the same run with every byte changed.

The state (lora_model.py): a base of frozen linear layers (~95% of `model` + `optimizer`)
and a LoRA adapter trained with Adam. Every save follows a real training step (forward,
backward, Adam on the adapter) and saves `model` and `optimizer`, as a fine-tuning job
does. The rows:

  nebula               the seed API, its defaults (a save's copy deferred to the next
                       forward and backward: `lazy_snapshot="auto"`), persisting to a
                       folder in the work folder (`nm.init(root, persistent_time_interval=0)`)
  nebula_own_item      the same, the frozen base saved as an item of its own: items `base`
                       (the base's weights and biases), `adapter` (the rest of `model`: the
                       LoRA parameters) and `optimizer`; on a local root the `base` item,
                       unchanged whole, is a hard link to the previous version's file
  nebula_all_changed   the same, on the control: the same model and sizes, whose base is
                       changed in place (`add_` under `torch.no_grad()`) at every step
  nebula_sync, nebula_sync_all_changed
                       nebula and its control with the copy at save() (`lazy_snapshot=
                       False`): the stall target's pair. Deferred, both copies run beside
                       the next step and both stalls are a few ms; at save(), the stall is
                       the copy, which skips what did not change
  nebula_azure         the frozen-base state, persisting to `az://` on an Azurite this
                       workload starts (127.0.0.1, a temporary data folder), when installed
  nebula_s3            the frozen-base state, persisting to `s3://` on moto's S3 server this
                       workload starts (tests/s3server.py: 127.0.0.1, in its memory), through
                       a relay that counts the bytes it receives (tests/wirecount.py)
  torch_save, dcp_save, dcp_async, dcp_async_reused, torchsnapshot
                       the peers (peers.py) on the frozen-base state; torchsnapshot where
                       installed

The methods take turns in `rounds` rounds (the order reversed every other round, so that
drift in the machine's load hits all alike); in each, a method makes `saves` timed saves
in a row. The Azurite and S3 rows run in the first round only: a persist there takes
seconds (Azurite and moto are one process each), and their byte counts are the same in
every round.
nebula's session starts afresh for each of its rounds, and its first `COLD_SAVES` saves
after a start are timed apart (`cold`): the first fills fresh buffers and persists whole;
reuse starts from the third (nebula keeps two snapshot buffers, and the persist compares
a version's blocks once it knows the previous version's). The peers start once.

One save: t0, `save` returns (blocking), [a forward+backward if the method defers its
fence], the fence returns, durable (nebula: `nm.flush_persistence()`; peers: fsynced).
stall = blocking + fence; durable = from t0. Bytes per checkpoint sent to the persistent
tier: nebula's, the `bytes_written` of the checkpoint's `persistent` rows in
checkpointHistories.csv (a local root: what was not cloned from the previous version; an
az:// root: what the client uploaded), with `bytes_reused` beside it and the memory rows'
`bytes_written` (what the save copied into its buffer); the peers', the size of the files
the checkpoint wrote. The S3 row's bytes are counted where they land instead: what the
server received through the relay from the save to the persist's end (every request of
it, heads and the commit's small files included). The changed bytes: the adapter's
parameters and Adam's state, counted from the state (`LoraState.changed_bytes`).

Disk bytes per checkpoint, for every row that persists to the work folder (nebula's local
rows and the peers): what reached the disk, the `write_bytes` of /proc/self/io from just
before the save to its end (durable: nebula's persister is a thread of this process, and
its memory tier is tmpfs, which counts nothing). On ext4 `copy_file_range` copies a
cloned range inside the kernel, so what nebula reuses within a changed file reaches the
disk all the same; a file unchanged whole is a hard link and writes nothing. The work
folder is probed first (1 MiB written and fsynced must count at least 1 MiB); where the
kernel does not count, the rows say "not counted" (`disk_bytes` None), never 0. The memory
tier's base folder is probed too (`memory_tier_writes_counted`: where it is not on tmpfs,
the nebula rows' disk figures include what the saves copied into it).

Resume: after its last round each nebula local row loads its newest checkpoint from the
persistent tier (the memory tier deleted) and compares it with the state it saved, bit
for bit (`resume_exact`).

Targets (issue #30): nebula's stall <= 0.2 x the control's; nebula's bytes per checkpoint
<= 1.2 x the changed bytes, on local disk and on Azurite; on S3 (issue #45), whose parts
are at least 5 MiB, <= 1.3 x; the own-item row's disk bytes per checkpoint <= 1.2 x the
changed bytes (unchanged bytes cost no disk writes on ext4 either).

Not for: the GPT-2 workload (bench.py, runner.py) or the tables (lora_report.py).
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from lora_model import LoraShape, LoraState
from measure import disk_writes_counted, summarize, tree_bytes, write_bytes
from model import TrainState
from nebula_methods import RETENTION, Nebula
from peers import (
    DcpAsync,
    DcpSave,
    Method,
    Pending,
    TorchSave,
    TorchSnapshot,
    Unavailable,
)
from report import target_ratio
from runner import COLD_SAVES, Steps, progress

import nebulaml as nm

REPO = Path(__file__).resolve().parents[1]
AZURE_CONTAINER = "bench"
CONNECTION_ENV = "AZURE_STORAGE_CONNECTION_STRING"
STALL_TARGET = 0.2  # nebula's stall / the all-changed control's, both copied at save()
BYTES_TARGET = 1.2  # bytes sent per checkpoint / changed bytes
S3_BYTES_TARGET = 1.3  # on S3, whose multipart parts are at least 5 MiB
AZURE_ROUNDS = 1  # the Azurite and S3 rows' rounds: their byte counts are the same every round
S3_BUCKET = "bench"
PEERS = ("torch_save", "dcp_save", "dcp_async", "dcp_async_reused", "torchsnapshot")
NEBULA_ROWS = (
    "nebula",
    "nebula_own_item",
    "nebula_all_changed",
    "nebula_sync",
    "nebula_sync_all_changed",
    "nebula_azure",
    "nebula_s3",
)
METHODS = (*NEBULA_ROWS, *PEERS)  # the table's order


@dataclass(slots=True)
class LoraSave:
    """One save: its times, and the bytes its checkpoint sent to the persistent tier."""

    tag: str
    stall_s: float
    blocking_s: float
    fence_s: float
    durable_s: float
    bytes_written: int = 0
    bytes_reused: int | None = None  # nebula: taken from the previous version
    size_bytes: int = 0  # the checkpoint's bytes (a complete copy)
    copied_bytes: int | None = None  # nebula: what the save copied into its buffer
    wire_bytes: int | None = None  # the S3 row: what the server received for it
    disk_bytes: int | None = None  # local rows: write_bytes from the save to durable


@dataclass
class LoraRow:
    """One method on one state."""

    method: Method
    state: LoraState
    root: str  # "local", "azurite" or "s3"
    unavailable: str | None = None
    wire: Any = None  # the S3 row's counting relay (tests/wirecount.py)
    count_disk: bool = False  # a local row, and the kernel counts writes in the work folder
    cold: list[LoraSave] = field(default_factory=list)
    saves: list[LoraSave] = field(default_factory=list)
    resume_mismatches: list[str] | None = None  # nebula local rows: None until checked


class NebulaOwnItem(Nebula):
    """nebula, the frozen base an item of its own: `base`, `adapter` (the rest of
    `model`), `optimizer`. A `LoraState`'s rows only."""

    def __init__(self) -> None:
        super().__init__(
            lazy=None, name="nebula_own_item", label="nebula, frozen base its own item"
        )

    def save(self, state: TrainState, step: int) -> Pending:
        assert isinstance(state, LoraState)
        tag = f"global_step{step}"
        base, adapter = state.model_items()
        ckpt = nm.Checkpoint(tag, 3)
        ckpt.save("base", base)
        ckpt.save("adapter", adapter)
        ckpt.save("optimizer", state.optimizer.state_dict())
        self.tags.append(tag)
        self.saved = [self.root / t for t in self.tags[-RETENTION:]]
        return Pending(nm.wait_for_snapshot, nm.flush_persistence)

    def load(self, state: TrainState, *, from_disk: bool) -> Any:
        ckpt = nm.get_latest_checkpoint(self.root_url)
        if ckpt is None:
            raise RuntimeError(f"{self.label}: no checkpoint under {self.root_url}")
        with ckpt:
            model = {**ckpt.load("base"), **ckpt.load("adapter")}
            return {"model": model, "optimizer": ckpt.load("optimizer")}


def lora_rows(
    names: Sequence[str],
    frozen: LoraState,
    control: LoraState,
    azure: dict[str, Any] | str | None,
    s3: dict[str, Any] | str | None = None,
) -> list[LoraRow]:
    """The rows of `names`, in the table's order. `azure`: the Azurite's `url` and
    `storage_options` for `nebula_azure`, or why there is none; `s3`: the moto server's
    `url`, `storage_options` and counting `relay` for `nebula_s3`, or why there is none."""
    made: dict[str, LoraRow] = {
        "nebula": LoraRow(Nebula(lazy=None), frozen, "local"),
        "nebula_own_item": LoraRow(NebulaOwnItem(), frozen, "local"),
        "nebula_all_changed": LoraRow(
            Nebula(lazy=None, name="nebula_all_changed", label="nebula, all-changed control"),
            control,
            "local",
        ),
        "nebula_sync": LoraRow(Nebula(lazy=False), frozen, "local"),
        "nebula_sync_all_changed": LoraRow(
            Nebula(
                lazy=False,
                name="nebula_sync_all_changed",
                label="nebula, all-changed control, lazy_snapshot=False",
            ),
            control,
            "local",
        ),
        "torch_save": LoraRow(TorchSave(), frozen, "local"),
        "dcp_save": LoraRow(DcpSave(), frozen, "local"),
        "dcp_async": LoraRow(DcpAsync(reused_stager=False), frozen, "local"),
        "dcp_async_reused": LoraRow(DcpAsync(reused_stager=True), frozen, "local"),
        "torchsnapshot": LoraRow(TorchSnapshot(), frozen, "local"),
    }
    options = azure if isinstance(azure, dict) else {}
    made["nebula_azure"] = LoraRow(
        Nebula(lazy=None, name="nebula_azure", label="nebula to Azurite", **options),
        frozen,
        "azurite",
        unavailable=azure if isinstance(azure, str) else None,
    )
    where = dict(s3) if isinstance(s3, dict) else {}
    relay = where.pop("relay", None)
    made["nebula_s3"] = LoraRow(
        Nebula(lazy=None, name="nebula_s3", label="nebula to S3 (moto)", **where),
        frozen,
        "s3",
        unavailable=s3 if isinstance(s3, str) else None,
        wire=relay,
    )
    return [made[n] for n in METHODS if n in names]


def _time_save(method: Method, state: LoraState, step: int) -> LoraSave:
    t0 = time.perf_counter()
    pending = method.save(state, step)
    t1 = time.perf_counter()
    if method.defers_fence:
        state.forward_backward()  # the next step's compute, overlapping the copy
    t2 = time.perf_counter()
    pending.wait_mutable()
    t3 = time.perf_counter()
    pending.wait_durable()
    t4 = time.perf_counter()
    tag = method.tags[-1] if isinstance(method, Nebula) else f"step{step}"
    sample = LoraSave(tag, (t1 - t0) + (t3 - t2), t1 - t0, t3 - t2, t4 - t0)
    if not isinstance(method, Nebula):
        sample.bytes_written = sample.size_bytes = tree_bytes([method.latest()])
    return sample


def _counted_save(row: LoraRow, step: int) -> LoraSave:
    """`_time_save`, and meanwhile: for the S3 row what the server received, for a local
    row what this process wrote to the disk (from just before the save to durable)."""
    before = None if row.wire is None else row.wire.sent
    disk = write_bytes() if row.count_disk else None
    sample = _time_save(row.method, row.state, step)
    if before is not None:
        sample.wire_bytes = row.wire.sent - before
    if disk is not None:
        after = write_bytes()
        sample.disk_bytes = None if after is None else after - disk
    return sample


def _stretch(row: LoraRow, steps: Steps, saves: int, *, last: bool) -> None:
    """One round of `row`: after a (re)start its cold saves, then `saves` timed ones,
    each after a training step; in its `last` round a nebula local row's resume check."""
    method, state = row.method, row.state
    started = method.activate(state)
    for k in range(COLD_SAVES if started else 0):
        state.step()
        row.cold.append(_counted_save(row, steps()))
        progress(f"lora cold save {k + 1} {method.label}: stall {row.cold[-1].stall_s:.3f} s")
        method.prune()
    timed = []
    for _ in range(saves):
        state.step()
        sample = _counted_save(row, steps())
        timed.append(sample)
        progress(
            f"lora save {method.label}: stall {sample.stall_s:.3f} s, "
            f"durable {sample.durable_s:.2f} s"
        )
        method.prune()
    if isinstance(method, Nebula):
        method.deactivate(keep_memory=False)  # history rows are complete after shutdown
        _add_history(method, [*row.cold[-COLD_SAVES:], *timed] if started else timed)
        if last and row.root == "local":  # the state is still the one the last save took
            row.resume_mismatches = mismatches(
                method.load(state, from_disk=True), state.state_dict()
            )
            if row.resume_mismatches:
                progress(f"lora {method.label}: resume differs at {row.resume_mismatches[:5]}")
        for sample in [*row.cold, *timed]:
            if sample.wire_bytes is not None:  # counted where it landed
                sample.bytes_written = sample.wire_bytes
    row.saves.extend(timed)


def _leaves(obj: Any, prefix: str = "") -> dict[str, Any]:
    """Every leaf of a nested state dict by its path: tensors and plain values."""
    if isinstance(obj, dict):
        return {
            k: v for key, val in obj.items() for k, v in _leaves(val, f"{prefix}/{key}").items()
        }
    if isinstance(obj, (list, tuple)):
        return {k: v for i, val in enumerate(obj) for k, v in _leaves(val, f"{prefix}/{i}").items()}
    return {prefix: obj}


def mismatches(loaded: Any, reference: Any) -> list[str]:
    """The paths where `loaded` differs from `reference`, bit for bit (empty: equal)."""
    got, want = _leaves(loaded), _leaves(reference)
    bad = set(got) ^ set(want)
    for key in set(got) & set(want):
        a, b = got[key], want[key]
        if isinstance(b, torch.Tensor):
            same = (
                isinstance(a, torch.Tensor)
                and (a.dtype, a.shape) == (b.dtype, b.shape)
                and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
            )
        else:
            same = type(a) is type(b) and a == b
        if not same:
            bad.add(key)
    return sorted(bad)


def _add_history(method: Nebula, samples: list[LoraSave]) -> None:
    """Fill nebula's samples' bytes from the history rows of their checkpoints."""
    df = nm.ops.read_history(method.root_url, storage_options=method.storage_options)
    ok = df[df["status"] == "ok"]
    for sample in samples:
        rows = ok[ok["tag"] == sample.tag]
        persisted = rows[rows["tier"] == "persistent"]
        memory = rows[rows["tier"] == "memory"]
        if persisted.empty or memory.empty:
            raise RuntimeError(f"{method.label}: no history rows for {sample.tag}")
        sample.bytes_written = int(persisted["bytes_written"].sum())
        sample.bytes_reused = int(persisted["bytes_reused"].sum())
        sample.size_bytes = int(persisted["size_bytes"].sum())
        sample.copied_bytes = int(memory["bytes_written"].sum())


@contextmanager
def azurite(work: Path) -> Iterator[dict[str, Any] | str]:
    """A running Azurite for the `nebula_azure` row: the method's `url` and
    `storage_options`, or why there is none."""
    sys.path.insert(0, str(REPO / "tests"))
    from azurite import STAGING_VERSION, Azurite, binary, missing

    # The Azurite that stages blocks from a URL, as Azure does (make azurite installs it).
    if binary(STAGING_VERSION) is None:
        yield missing(STAGING_VERSION)
        return
    server = Azurite(work / "azurite", log_path=work / "azurite.log", version=STAGING_VERSION)
    server.start()
    # nm.memory_tier_path takes no storage_options: it reads the account from here.
    saved = os.environ.get(CONNECTION_ENV)
    os.environ[CONNECTION_ENV] = server.connection_string
    try:
        server.create_container(AZURE_CONTAINER)
        url = f"az://{AZURE_CONTAINER}/lora-nebula"
        yield {"url": url, "storage_options": {"connection_string": server.connection_string}}
    finally:
        server.stop()
        if saved is None:
            os.environ.pop(CONNECTION_ENV, None)
        else:
            os.environ[CONNECTION_ENV] = saved


@contextmanager
def moto(work: Path) -> Iterator[dict[str, Any] | str]:
    """A running moto S3 server for the `nebula_s3` row, behind a relay that counts what
    it receives: the method's `url`, `storage_options` and the `relay`, or why there is
    none."""
    sys.path.insert(0, str(REPO / "tests"))
    import s3server
    from wirecount import CountingRelay

    if not s3server.installed():
        yield s3server.MISSING
        return
    server = s3server.MotoServer(work / "moto.log").start()
    relay = CountingRelay(server.port)
    try:
        server.create_bucket(S3_BUCKET)
        options = {**server.options(), "endpoint_url": relay.endpoint}
        yield {"url": f"s3://{S3_BUCKET}/lora-nebula", "storage_options": options, "relay": relay}
    finally:
        relay.close()
        server.stop()


def run_lora(
    work: Path, state_bytes: int, *, names: Sequence[str], rounds: int, saves: int
) -> dict[str, Any]:
    """Build both states, run every method of `names` in `rounds` rounds of `saves`
    saves; returns the workload's JSON document."""
    shape = LoraShape.for_state_bytes(state_bytes)
    progress(f"lora: building the states ({shape}) ...")
    frozen, control = LoraState(shape), LoraState(shape, all_changed=True)
    t0 = time.perf_counter()
    with ExitStack() as stack:
        azure = stack.enter_context(azurite(work)) if "nebula_azure" in names else None
        s3 = stack.enter_context(moto(work)) if "nebula_s3" in names else None
        rows = lora_rows(names, frozen, control, azure, s3)
        counted = disk_writes_counted(work)
        if not counted:
            progress(f"lora: {work}: this kernel does not count its writes: disk 'not counted'")
        for row in rows:
            row.count_disk = counted and row.root == "local"
        nebula_local = any(isinstance(r.method, Nebula) and r.root == "local" for r in rows)
        tier_counted = memory_tier_counted(work) if counted and nebula_local else None
        if tier_counted:
            progress("lora: warning: the memory tier is not on tmpfs: its writes are counted too")
        for row in rows:
            if row.unavailable is None:
                try:
                    row.method.setup(work / "lora" / row.method.name, row.state)
                except Unavailable as exc:
                    row.unavailable = str(exc)
            if row.unavailable is not None:
                progress(f"lora {row.method.label}: unavailable: {row.unavailable}")
        ready = [r for r in rows if r.unavailable is None]
        steps = Steps()
        try:
            for r in range(rounds):
                for row in ready if r % 2 == 0 else ready[::-1]:
                    if row.root in ("azurite", "s3") and r >= AZURE_ROUNDS:
                        continue  # an upload of the whole state takes seconds there
                    _stretch(row, steps, saves, last=r == rounds - 1)
        finally:
            for row in ready:
                row.method.teardown()
    doc = lora_document(frozen, rows, rounds, saves, time.perf_counter() - t0, disk=counted)
    doc["memory_tier_writes_counted"] = tier_counted
    return doc


def memory_tier_counted(work: Path) -> bool:
    """Whether writes into the memory tier's base folder count in `write_bytes` (they do
    not on tmpfs, /dev/shm, where it is unless NEBULA_MEMORY_TIER_PATH moves it); then
    the nebula rows' disk figures hold what their saves copied there too."""
    base = Path(nm.memory_tier_path(str(work / "lora" / "root"))).parent
    # Probed in a private folder of its own on the same filesystem (the base's nearest
    # folder that exists): nothing is made in the base, which nebula's init makes 0700.
    existing = next(p for p in (base, *base.parents) if p.is_dir())
    with tempfile.TemporaryDirectory(prefix="nebula-probe-", dir=existing) as folder:
        return disk_writes_counted(Path(folder))


def lora_document(
    state: LoraState,
    rows: list[LoraRow],
    rounds: int,
    saves: int,
    seconds: float,
    *,
    disk: bool,
) -> dict[str, Any]:
    """The workload's figures, their targets and every sample."""
    changed = state.changed_bytes
    methods = {row.method.name: row_figures(row, changed) for row in rows}
    return {
        "state": {
            "shape": {f: getattr(state.shape, f) for f in state.shape.__slots__},
            "num_params": state.num_params,
            "state_bytes": state.state_bytes,
            "frozen_bytes": state.frozen_bytes,
            "changed_bytes": changed,
            "step_s": state.time_step(3),
        },
        "rounds": rounds,
        "saves_per_round": saves,
        "duration_s": seconds,
        "disk_writes_counted": disk,
        "order": [row.method.name for row in rows],
        "methods": methods,
        "ratios": lora_ratios(methods, changed),
    }


def row_figures(row: LoraRow, changed_bytes: int) -> dict[str, Any]:
    """Summaries (median, min, max) of one row's timed saves, and every sample."""
    fig: dict[str, Any] = {
        "label": row.method.label,
        "state": "all_changed" if row.state.all_changed else "frozen",
        "root": row.root,
    }
    if row.unavailable is not None:
        return {**fig, "unavailable": row.unavailable}
    saves = row.saves
    written = [s.bytes_written for s in saves]
    fig.update(
        {
            "stall_s": summarize([s.stall_s for s in saves]),
            "blocking_s": summarize([s.blocking_s for s in saves]),
            "fence_s": summarize([s.fence_s for s in saves]),
            "durable_s": summarize([s.durable_s for s in saves]),
            "bytes_written": summarize(written),
            "size_bytes": summarize([s.size_bytes for s in saves]),
            "written_vs_changed": summarize([w / changed_bytes for w in written]),
            "samples": [_sample(s) for s in saves],
            "cold_saves": [_sample(s) for s in row.cold],
        }
    )
    if isinstance(row.method, Nebula):
        fig["bytes_reused"] = summarize([s.bytes_reused or 0 for s in saves])
        fig["copied_bytes"] = summarize([s.copied_bytes or 0 for s in saves])
    if row.root == "local":  # None: the kernel does not count this folder's writes
        disk = [s.disk_bytes for s in saves if s.disk_bytes is not None]
        counted = bool(saves) and len(disk) == len(saves)
        fig["disk_bytes"] = summarize(disk) if counted else None
        fig["disk_vs_changed"] = summarize([d / changed_bytes for d in disk]) if counted else None
    if row.resume_mismatches is not None:
        fig["resume_exact"] = not row.resume_mismatches
        fig["resume_mismatches"] = row.resume_mismatches
    return fig


def _sample(sample: LoraSave) -> dict[str, Any]:
    return {k: getattr(sample, k) for k in sample.__slots__}


def _median(methods: dict[str, Any], name: str, key: str) -> float | None:
    fig = methods.get(name)
    if not fig or "unavailable" in fig or not fig.get(key):
        return None
    return float(fig[key]["median"])


def lora_ratios(methods: dict[str, Any], changed_bytes: int) -> list[dict[str, Any]]:
    """The issue's targets for the frozen-base workload (a value of None: not measured)."""
    # The copy's cost shows where it is taken at save(): deferred, both stalls are a few ms.
    stall = _median(methods, "nebula_sync", "stall_s")
    control = _median(methods, "nebula_sync_all_changed", "stall_s")
    ratios = [
        target_ratio(
            "lora_stall_vs_all_changed",
            "nebula_sync",
            None if stall is None or not control else stall / control,
            "<=",
            STALL_TARGET,
            "frozen-base stall <= 0.2 x the all-changed control's, same run, both copied "
            "at save() (lazy_snapshot=False)",
        )
    ]
    for name, where, limit in (
        ("nebula", "local disk", BYTES_TARGET),
        ("nebula_own_item", "local disk, the frozen base its own item", BYTES_TARGET),
        ("nebula_azure", "Azurite", BYTES_TARGET),
        ("nebula_s3", "S3 (moto), counted by the server's relay", S3_BYTES_TARGET),
    ):
        written = _median(methods, name, "bytes_written")
        ratios.append(
            target_ratio(
                "lora_bytes_vs_changed",
                name,
                None if written is None else written / changed_bytes,
                "<=",
                limit,
                f"bytes sent to the persistent tier ({where}) per checkpoint <= {limit} x "
                f"the changed bytes (adapter + Adam state)",
            )
        )
    disk = _median(methods, "nebula_own_item", "disk_bytes")
    ratios.append(
        target_ratio(
            "lora_disk_vs_changed",
            "nebula_own_item",
            None if disk is None else disk / changed_bytes,
            "<=",
            BYTES_TARGET,
            f"disk writes per checkpoint (write_bytes of /proc/self/io, local disk), the "
            f"frozen base its own item, <= {BYTES_TARGET} x the changed bytes",
        )
    )
    return ratios
