"""A GCS server for the tests: gcp-storage-emulator (a dev extra), in a process of its own
on 127.0.0.1, on a free port, its objects in the process's memory (stopping it forgets
them).

The emulator answers GCS's JSON API for what nebula uses (media, multipart and resumable
uploads, objects.list with a prefix and a delimiter, gets, deletes), and logs each request
line (method, path and query), which the tests read. It does not check credentials (the
tests give `token=anon`: nothing reaches Google, and no credential of the machine is
read) and it ignores preconditions: `ifGenerationMatch=0` creates or replaces alike, so a
root on it is not probed atomic (tests/gcs/test_gcs.py records it).

Not for: fixtures (tests/conftest.py builds them on this).
"""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from azurite import stop_group

PROJECT = "nebula-test"
MISSING = (
    "gcp-storage-emulator is not installed: pip install gcp-storage-emulator gcsfs "
    "(both in the dev extra: pip install -e 'core/..[dev]')"
)
_STARTED = b"[SERVER] All services started"
_PORT_TAKEN = b"Address already in use"
# The emulator's server answers one connection at a time, with the standard library's
# listen backlog of 5: the connections of a batch of concurrent reads (fsspec's `cat` of
# an append log's objects) beyond it are dropped and tried again by the client's kernel a
# second later. A longer backlog queues them instead; requests are still served one by one.
_MAIN = (
    "import http.server, sys; http.server.HTTPServer.request_queue_size = 256; "
    "from gcp_storage_emulator.__main__ import main; main(sys.argv[1:])"
)


def installed() -> bool:
    """Whether the emulator and gcsfs can be imported here."""
    return all(importlib.util.find_spec(m) is not None for m in ("gcp_storage_emulator", "gcsfs"))


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class GCSEmulator:
    """One gcp-storage-emulator process, its bucket `bucket` made at start; its output in
    `log_path`.

    Example (not run here: it starts a process):
        server = GCSEmulator(tmp_path / "gcs.log", "ckpt").start(); ...; server.stop()
    """

    def __init__(self, log_path: Path, bucket: str) -> None:
        self.log_path = Path(log_path)
        self.bucket = bucket
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 30.0, tries: int = 3) -> GCSEmulator:
        """Start the server on a free port and wait (bounded) until it listens; a port
        taken between the pick and the bind is picked again (up to `tries` times)."""
        for _ in range(tries):
            if self._start_on(_free_port(), timeout_s):
                return self
        raise RuntimeError(f"gcp-storage-emulator found no free port in {tries} tries")

    def _start_on(self, port: int, timeout_s: float) -> bool:
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("GOOGLE_", "STORAGE_", "GCSFS_"))}  # fmt: skip
        env["PYTHONUNBUFFERED"] = "1"
        since = self.log_path.stat().st_size if self.log_path.exists() else 0
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", _MAIN, "start", "-H", "127.0.0.1", "--port", str(port),
                 "--in-memory", "--default-bucket", self.bucket],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                cwd=self.log_path.parent,  # in memory: nothing is written there
                env=env,
            )  # fmt: skip
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            out = self.log_path.read_bytes()[since:]
            if _STARTED in out:
                self.port = port
                return True
            if _PORT_TAKEN in out:  # its server thread failed: the process would wait on
                self.stop()
                return False
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        tail = self.log_path.read_bytes()[-2000:].decode(errors="replace")
        self.stop()
        raise RuntimeError(f"gcp-storage-emulator did not start within {timeout_s} s:\n{tail}")

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL after 10 s)."""
        stop_group(self.proc)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def options(self) -> dict[str, Any]:
        """Storage options that reach this server (the `nebula --storage-option` form is
        `cli_options`)."""
        return {"endpoint_url": self.endpoint, "token": "anon", "project": PROJECT}

    def cli_options(self) -> list[str]:
        """`--storage-option KEY=VALUE` arguments of the `nebula` commands for it."""
        out = []
        for name, value in self.options().items():
            out += ["--storage-option", f"{name}={value}"]
        return out

    def requests(self, since: int) -> list[str]:
        """The request lines (`POST /upload/...?...`) the server logged after byte `since`
        of its log."""
        lines = self.log_path.read_bytes()[since:].decode(errors="replace").splitlines()
        return [line.split('"')[1] for line in lines if line.count('"') >= 2]

    def log_size(self) -> int:
        return self.log_path.stat().st_size
