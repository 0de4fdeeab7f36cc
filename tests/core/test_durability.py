"""What a persist makes durable before it commits, seen in the system calls it makes.

A persist to a local root must fsync every data file it writes and the tag folder that
names them before `manifest.json` appears: a crash after the manifest's link but before
those fsyncs would leave a committed checkpoint whose items the disk never received. No
other test sees this: a missing fsync changes no byte that a test can read back.

How it is recorded: the persist runs in a child process under `strace -f -y` (every
thread; `-y` prints the path behind each descriptor), which records each `openat`,
`fsync`/`fdatasync` and `link`/`rename` the process makes, in the order it makes them.
Nothing of nebula's is replaced or wrapped: the child runs the library as a job does.
(Python's audit hooks were the other candidate: they see `open`, but `os.fsync` raises no
audit event, so they cannot see the fsyncs.) Without strace the test is skipped, saying
so; `make venv` installs it (as root), as it installs zsh and xfsprogs.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

TAG = "global_step1"
CHILD = """
import sys
import torch
import nebulaml as nm

nm.init(sys.argv[1], persistent_time_interval=3600)
ckpt = nm.Checkpoint("global_step1", 2)
ckpt.save("model", {"w": torch.arange(70_000, dtype=torch.float32)})
ckpt.save("optimizer", {"step": torch.tensor(7), "m": torch.ones(5_000)})
assert nm.flush_persistence("global_step1")
nm.shutdown()
"""
TRACED = "openat,fsync,fdatasync,link,linkat,rename,renameat,renameat2"

# One line of `strace -f -y -qq`: "<pid> <call>(<args>) = <result>", or an unfinished
# call ("... <unfinished ...>") whose arguments are all there, resumed on a later line.
_CALL = re.compile(r"^\d+\s+(?P<call>\w+)\((?P<args>.*)$")
_DIR_AND_NAME = r'(?:AT_FDCWD|\d+)<(?P<{d}>[^>]*)>, "(?P<{n}>[^"]*)"'
_OPENAT = re.compile(_DIR_AND_NAME.format(d="dir", n="name") + r", (?P<flags>[A-Z_|]+)")
_FD = re.compile(r"^\d+<(?P<path>[^>]*)>")
_TWO_PATHS = re.compile(r'^"(?P<src>[^"]*)", "(?P<dst>[^"]*)"')
_AT_TWO_PATHS = re.compile(
    _DIR_AND_NAME.format(d="sdir", n="src") + ", " + _DIR_AND_NAME.format(d="ddir", n="dst")
)


@dataclass(frozen=True, slots=True)
class Call:
    """One system call of the trace: what it did (`create`, `fsync`, `name`: a link or
    rename gave a file this name) to which path, in the order the process made them."""

    what: str
    path: str


def parse_trace(text: str) -> list[Call]:
    calls = []
    for line in text.splitlines():
        m = _CALL.match(line)
        if m is None or m["args"].startswith("..."):
            continue  # a resumed call: recorded where it started
        call, args = m["call"], m["args"]
        if call == "openat":
            o = _OPENAT.match(args)
            if o is not None and "O_CREAT" in o["flags"]:
                calls.append(Call("create", os.path.join(o["dir"], o["name"])))
        elif call in ("fsync", "fdatasync"):
            f = _FD.match(args)
            if f is not None:
                calls.append(Call("fsync", f["path"]))
        elif call in ("link", "rename"):
            t = _TWO_PATHS.match(args)
            if t is not None:
                calls.append(Call("name", t["dst"]))
        elif call in ("linkat", "renameat", "renameat2"):
            a = _AT_TWO_PATHS.match(args)
            if a is not None:
                calls.append(Call("name", os.path.join(a["ddir"], a["dst"])))
    return calls


def _strace() -> str:
    strace = shutil.which("strace")
    if strace is None:
        pytest.skip("strace is not installed: `make venv` installs it as root (apt-get)")
    probe = subprocess.run(
        [strace, "-qq", "-f", "-o", os.devnull, "true"], capture_output=True, text=True
    )
    if probe.returncode != 0:
        pytest.skip(f"strace cannot trace a child here: {probe.stderr.strip()}")
    return strace


@pytest.mark.slow
def test_every_data_file_and_its_folder_are_fsynced_before_the_manifest_appears(
    tmp_path: Path, memory_tier: Path
) -> None:
    # Catches: a persisted data file never fsynced (local_files.DirectFile.close, the local
    # writers), and the tag folder not fsynced after the items' names were created
    # (local.py's publish): either way a power cut after the commit could lose an item
    # of a committed checkpoint.
    strace = _strace()
    root = Path(os.path.realpath(tmp_path)) / "root"
    trace = tmp_path / "persist.strace"
    child = subprocess.run(
        [strace, "-f", "-y", "-qq", "-o", str(trace), "-e", f"trace={TRACED}",
         sys.executable, "-c", CHILD, str(root)],
        env=dict(os.environ, NEBULA_MEMORY_TIER_PATH=str(memory_tier)),
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert child.returncode == 0, child.stderr
    folder = str(root / TAG)
    manifest = json.loads((root / TAG / "manifest.json").read_text())
    data_files = [f"{folder}/{item['file']}" for item in manifest["items"]]
    assert len(data_files) == 2, manifest

    calls = parse_trace(trace.read_text())
    commits = [i for i, c in enumerate(calls) if c == Call("name", f"{folder}/manifest.json")]
    assert len(commits) == 1, f"manifest.json published {len(commits)} times: {calls}"
    before = calls[: commits[0]]
    for path in data_files:
        created = [i for i, c in enumerate(before) if c == Call("create", path)]
        assert created, f"{path} was not created before the manifest appeared"
        synced = [i for i, c in enumerate(before) if c == Call("fsync", path) and i > created[-1]]
        assert synced, f"{path} was not fsynced before the manifest appeared"
        folder_synced = [
            i for i, c in enumerate(before) if c == Call("fsync", folder) and i > created[-1]
        ]
        assert folder_synced, (
            f"{folder} was not fsynced between the creation of {path} and the manifest"
        )


def test_the_trace_parser_reads_what_strace_writes() -> None:
    # The parser's own table: a resumed call, a relative name under a folder descriptor,
    # and the three ways a file gets its name.
    text = "\n".join([
        '7 openat(AT_FDCWD</w>, "/r/t/model", O_WRONLY|O_CREAT|O_EXCL, 0666) = 9</r/t/model>',
        '7 openat(3</r>, "t", O_RDONLY|O_DIRECTORY) = 4</r/t>',
        "7 fsync(9</r/t/model> <unfinished ...>",
        "8 <... fsync resumed>) = 0",
        '7 renameat2(AT_FDCWD</w>, "/r/t/.x.tmp", 5</r/t>, "y", RENAME_NOREPLACE) = 0',
        '7 rename("/r/t/.m.tmp", "/r/t/.rank-0.json") = 0',
        "7 fsync(4</r/t>) = 0",
        '7 link("/r/t/.m.tmp", "/r/t/manifest.json") = 0',
        '7 linkat(3</r>, "a", 3</r>, "b", 0) = 0',
    ])  # fmt: skip
    assert parse_trace(text) == [
        Call("create", "/r/t/model"),
        Call("fsync", "/r/t/model"),
        Call("name", "/r/t/y"),
        Call("name", "/r/t/.rank-0.json"),
        Call("fsync", "/r/t"),
        Call("name", "/r/t/manifest.json"),
        Call("name", "/r/b"),
    ]
