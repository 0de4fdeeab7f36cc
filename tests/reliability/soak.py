"""The soak campaign (issue #43): one process saves a small state thousands of times, and
nothing it holds may grow with the number of saves.

A child process saves a 256 KiB state (one tensor changed in place, and the step) after
every step, `saves` times, with `persistent_time_interval=0.05` and a retention of 2, to a
local persistent root in the campaign's folder (its memory tier under
`NEBULA_MEMORY_TIER_PATH`, there too). Every `every` saves it waits for the persister
(`flush_persistence`, so that no persist in flight is counted) and samples:

- its RSS (`VmRSS` of /proc/self/status), open file descriptors (/proc/self/fd), threads
  (`threading.active_count()` and `Threads` of /proc/self/status; these three the least
  of 5 reads 10 ms apart: a persist's thread that is ending is not a leak);
- the memory tier's bytes and files (`nm.memory_tier_path()`), the persistent root's tag
  folders;
- the history's bytes: checkpointHistories.csv and the generation rotated out (.1).

The root starts with a history just under its rotation bound (`HISTORY_MAX_BYTES`, 4 MiB:
rows of an earlier run, as a long job's root has), so that the soak passes the bound
early and the rotation is what bounds it, not the soak's length.

Bounds (any break is a failure), after a warm-up of the first 1,000 saves:
- RSS grows less than `RSS_BOUND` bytes per 1,000 saves (end against warm-up);
- open fds and threads do not grow at all (no sample after the warm-up above it);
- the memory tier and the persistent root hold at most `retention` checkpoints (+1 whose
  turn came while sampling), their bytes at most that many checkpoints' worth;
- the history (csv and .1) stays under twice its rotation bound, and was rotated.

Reproduction (the issue, before the fixes): RSS grew about 2.7 KB per save (318 -> 331
MB over 4,900 saves, a manifest cache) and the history 1.1 MB per 5,000 saves (never
rotated).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import warm
from campaigns import Figures

from nebulaml.protocol.history import COLUMNS, HISTORY_FILE, HISTORY_MAX_BYTES, ROTATED_FILE

RETENTION = 2
STATE_BYTES = 256 << 10
RSS_BOUND = 1 << 20  # bytes per 1,000 saves, after the warm-up
HISTORY_HEADROOM = 300_000  # the seeded history is this far under its bound (5,000 saves)

CHILD = r"""
import json, os, sys, threading, time, torch
from pathlib import Path
import nebulaml as nm

root, saves, every, retention, state_bytes = sys.argv[1], *map(int, sys.argv[2:6])
nm.init(root, persistent_time_interval=0.05, num_of_version_in_retention=retention,
        exit_timeout_s=120)
tier = Path(nm.memory_tier_path())
state = {"w": torch.zeros(state_bytes // 4), "step": torch.tensor(0)}


def folder_size(base):
    size = files = 0
    for dirpath, _dirs, names in os.walk(base):
        for name in names:
            try:
                size += os.lstat(os.path.join(dirpath, name)).st_size
            except FileNotFoundError:
                continue
            files += 1
    return size, files


def history(name):
    try:
        return os.path.getsize(os.path.join(root, name))
    except FileNotFoundError:
        return 0


def status():
    text = Path("/proc/self/status").read_text()
    return dict(line.split(":", 1) for line in text.splitlines())


def settled(read):
    # The least of 5 reads 10 ms apart: a thread (or fd) of a moment, a persist's that is
    # ending, is not counted; a leaked one is there every time.
    values = []
    for _ in range(5):
        values.append(read())
        time.sleep(0.01)
    return min(values)


def fd_targets():
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            out.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            continue  # the listing's own fd, or one closed meanwhile
    return out


# The memory tier's buffers (its checkpoints' items and the pool's spares, two fds each)
# are counted apart: how many spares the pool keeps depends on whether a persist was in
# flight at the last save, so their fds move by two between samples without leaking.
TIER = os.path.realpath(tier) + os.sep


def sample(saved):
    flushed = nm.flush_persistence(timeout_s=60, raise_on_error=False)
    tier_bytes, tier_files = folder_size(tier)
    tags = [p for p in tier.iterdir() if p.is_dir() and not p.name.startswith(".")]
    kept = [p for p in Path(root).iterdir() if p.is_dir() and not p.name.startswith(".")]
    print(json.dumps({
        "saves": saved, "flushed": flushed, "t": time.monotonic(),
        "rss": int(status()["VmRSS"].split()[0]) * 1024,
        "fds": settled(lambda: sum(not t.startswith(TIER) for t in fd_targets())),
        "tier fds": settled(lambda: sum(t.startswith(TIER) for t in fd_targets())),
        "gone tier fds": settled(
            lambda: sum(t.startswith(TIER) and t.endswith(" (deleted)") for t in fd_targets())
        ),
        "threads": settled(threading.active_count),
        "os threads": settled(lambda: int(status()["Threads"])),
        "tier bytes": tier_bytes, "tier files": tier_files, "tier tags": len(tags),
        "root tags": len(kept),
        "history": history("checkpointHistories.csv"),
        "history.1": history("checkpointHistories.csv.1"),
    }), flush=True)


sample(0)
for step in range(1, saves + 1):
    state["w"].add_(1.0)
    state["step"].fill_(step)
    nm.Checkpoint(f"global_step{step}").save("model", state)
    if step % every == 0:
        sample(step)
nm.shutdown(timeout_s=120)
print("DONE", flush=True)
"""

# (sample key, figure name, unit divisor, bound per 1,000 saves after warm-up or None)
GROWTH = (
    ("rss", "RSS growth per 1,000 saves (KB)", 1000),
    ("fds", "open fds growth per 1,000 saves", 1),
    ("threads", "threads growth per 1,000 saves", 1),
    ("os threads", "OS threads growth per 1,000 saves", 1),
    ("tier bytes", "memory tier growth per 1,000 saves (KB)", 1000),
    ("tier files", "memory tier files growth per 1,000 saves", 1),
    ("history total", "history growth per 1,000 saves (KB)", 1000),
)


def _seed_history(root: Path, headroom: int) -> int:
    """A history of `HISTORY_MAX_BYTES - headroom` bytes: rows of an earlier run."""
    root.mkdir(parents=True)
    header = ",".join(COLUMNS) + "\n"
    rows = [header]
    size, step = len(header), 0
    while size < HISTORY_MAX_BYTES - headroom - 200:
        step += 1
        for tier in ("memory", "persistent"):
            row = (
                f"global_step{step},{step},{tier},0,2024-01-01T00:00:00.000000+00:00,"
                f"0.004100,{'0.004100' if tier == 'memory' else '0.0'},262547,64.0,ok,,"
                f"262547,0\n"
            )
            rows.append(row)
            size += len(row)
    (root / HISTORY_FILE).write_text("".join(rows))
    return size


def soak_campaign(work: Path, saves: int = 5000, every: int = 1000, warm_up: int = 1000) -> Figures:
    """One child saving `saves` times, sampled every `every` saves; growth is measured
    from the sample at `warm_up` saves (a multiple of `every`) to the last."""
    figures = Figures("soak")
    work.mkdir(parents=True, exist_ok=True)
    root = work / "root"
    seeded = _seed_history(root, max(20_000, HISTORY_HEADROOM * saves // 5000))
    env = {k: v for k, v in os.environ.items() if not k.startswith("NEBULA_")}
    env.update(NEBULA_MEMORY_TIER_PATH=str(work / "memory-tier"), OMP_NUM_THREADS="1")
    command = [sys.executable, "-W", "ignore", "-c", CHILD, str(root), str(saves), str(every),
               str(RETENTION), str(STATE_BYTES)]  # fmt: skip
    done = warm.run(command, capture_output=True, text=True, env=env, timeout=3600, check=False)
    samples = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    figures.counts["saves"] = samples[-1]["saves"] if samples else 0
    if done.returncode != 0 or "DONE" not in done.stdout or figures.counts["saves"] != saves:
        figures.failures.append(
            f"the child exited {done.returncode} after {figures.counts['saves']} of {saves} "
            f"saves: {done.stderr[-2000:]}"
        )
    after = [s for s in samples if s["saves"] >= warm_up]
    if len(after) < 2:
        figures.failures.append(f"{len(samples)} samples: no growth to measure")
        return figures
    for s in samples:
        s["history total"] = s["history"] + s["history.1"]
    first, last = after[0], after[-1]
    thousands = (last["saves"] - first["saves"]) / 1000
    figures.counts["saves per second"] = round(
        (last["saves"] - samples[0]["saves"]) / (last["t"] - samples[0]["t"]), 1
    )
    figures.counts["samples"] = len(samples)
    figures.counts["warm-up (saves)"] = first["saves"]
    figures.counts["RSS after warm-up (MB)"] = round(first["rss"] / 1e6, 1)
    figures.counts["RSS at the end (MB)"] = round(last["rss"] / 1e6, 1)
    for key, name, unit in GROWTH:
        figures.counts[name] = round((last[key] - first[key]) / thousands / unit, 2)
    # RSS: the bound, per 1,000 saves, end against warm-up.
    rss_rate = (last["rss"] - first["rss"]) / thousands
    if rss_rate >= RSS_BOUND:
        figures.failures.append(
            f"RSS grew {rss_rate / 1e3:.0f} KB per 1,000 saves (bound {RSS_BOUND / 1e3:.0f} KB):"
            f" {[s['rss'] for s in samples]}"
        )
    # fds (but the memory tier's) and threads: never above the warm-up's.
    for key in ("fds", "threads", "os threads"):
        if max(s[key] for s in after) > first[key]:
            figures.failures.append(f"{key} grew: {[s[key] for s in samples]}")
    # The memory tier's: two per file of the tier at most, none of a file deleted.
    figures.counts["memory tier fds max"] = max(s["tier fds"] for s in samples)
    for s in samples:
        if s["tier fds"] > 2 * s["tier files"] or s["gone tier fds"]:
            figures.failures.append(f"memory tier fds past its files at {s['saves']}: {s}")
    # Both tiers: what the retention keeps (+1 whose turn came while sampling).
    one = STATE_BYTES + (64 << 10)  # an item and its manifest, markers
    figures.counts["memory tier max (KB)"] = round(max(s["tier bytes"] for s in samples) / 1e3)
    figures.counts["memory tier max tags"] = max(s["tier tags"] for s in samples)
    figures.counts["persistent root max tags"] = max(s["root tags"] for s in samples)
    for s in samples[1:]:
        if s["tier tags"] > RETENTION + 1 or s["tier bytes"] > (RETENTION + 1) * one:
            figures.failures.append(f"memory tier past its retention at {s['saves']}: {s}")
        if s["root tags"] > RETENTION + 1:
            figures.failures.append(f"persistent root past its retention at {s['saves']}: {s}")
        if not s["flushed"]:
            figures.failures.append(f"flush failed at {s['saves']} saves")
    # The history: under twice its bound, rotated once it passed it.
    figures.counts["history seeded (KB)"] = round(seeded / 1e3)
    figures.counts["history max, csv + .1 (KB)"] = round(
        max(s["history total"] for s in samples) / 1e3
    )
    figures.counts["history rotated"] = int(last["history.1"] > 0)
    history = [s["history total"] for s in samples]
    if max(history) > 2 * HISTORY_MAX_BYTES + (64 << 10):
        figures.failures.append(f"history past twice its bound: {history}")
    if not last["history.1"] or (root / ROTATED_FILE).stat().st_size < HISTORY_MAX_BYTES:
        figures.failures.append(f"history not rotated past its bound: {last}")
    if os.path.exists(work / "memory-tier") and any((work / "memory-tier").rglob("global_step*")):
        figures.failures.append("a clean exit left the memory tier behind")
    return figures
