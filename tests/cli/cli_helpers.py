"""Shared by the CLI tests: a root with long tags written by the library, and ways to run
`nebula` in a pipe, on a simulated terminal and on a real pseudo-terminal."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import struct
import subprocess
import sys
import termios
from dataclasses import dataclass
from pathlib import Path

import torch
from typer.testing import CliRunner

import nebulaml as nm
from nebula_cli.app import app

EXE = Path(sys.executable).parent / "nebula"
# Tags as Lightning names them: long, and what a user must type next.
TAGS = [f"epoch=2-step={s}-val_loss=0.{s // 100}23" for s in (100, 200, 300)] + ["global_step400"]
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def populate(root: Path) -> None:
    """Four checkpoints with long tags, two items each (tensors, nested, a learning rate),
    persisted, and the newest kept in the memory tier too (this process's session stays
    open: `memory, persistent`)."""
    nm.init(str(root), persistent_time_interval=0, num_of_version_in_retention=10)
    g = torch.Generator().manual_seed(0)
    for i, tag in enumerate(TAGS):
        ckpt = nm.Checkpoint(tag, 2, labels=["best"] if i == 1 else [])
        model = {
            "encoder.layer.0.attention.weight": torch.randn(64, 64, generator=g) * (1 + i),
            "encoder.layer.0.attention.bias": torch.zeros(64),
            "layers": [torch.ones(8, 8), torch.arange(4)],
        }
        ckpt.save("model", model)
        ckpt.save("optimizer", {"lr": 0.1 / (i + 1), "step": i})
        nm.flush_persistence()


@dataclass
class Run:
    code: int
    stdout: str
    stderr: str


def in_a_pipe(*args: str, columns: int = 80, **env: str) -> Run:
    """`nebula ARGS` in-process, its stdout and stderr not terminals, COLUMNS set."""
    result = CliRunner().invoke(app, list(args), env={"COLUMNS": str(columns), **env})
    return Run(result.exit_code, result.stdout, result.stderr)


def on_a_simulated_terminal(*args: str, columns: int = 80) -> Run:
    """`nebula ARGS` in-process with rich told it writes to a terminal `columns` wide."""
    env = {"COLUMNS": str(columns), "TTY_COMPATIBLE": "1", "NO_COLOR": "1", "TERM": "xterm"}
    run = in_a_pipe(*args, columns=columns, **env)
    return Run(run.code, ANSI.sub("", run.stdout), ANSI.sub("", run.stderr))


def on_a_terminal(args: list[str], memory_tier: Path, columns: int = 80) -> Run:
    """The real `nebula` on a pseudo-terminal `columns` wide (stdout and stderr both);
    its output uncoloured, in `stdout`."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, columns, 0, 0))
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES", "NO_COLOR")}
    env.update(NEBULA_MEMORY_TIER_PATH=str(memory_tier), TERM="xterm")
    proc = subprocess.Popen([EXE, *args], stdin=slave, stdout=slave, stderr=slave, env=env)
    os.close(slave)
    chunks = []
    try:
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: the child closed the terminal
                break
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(master)
        code = proc.wait(timeout=60)
    text = b"".join(chunks).decode().replace("\r\n", "\n")
    return Run(code, ANSI.sub("", text), "")


def whole_on_a_line(text: str, *values: str) -> list[str]:
    """The values that no line of `text` holds whole (empty: all are there, uncut)."""
    lines = text.splitlines()
    return [v for v in values if not any(v in line for line in lines)]
