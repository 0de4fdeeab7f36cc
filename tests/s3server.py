"""A real S3 server for the tests: moto's server mode (`moto[server]`, a dev extra), in a
process of its own on 127.0.0.1, on a port the OS picks (read back from its output).

moto answers the S3 API as AWS does for what nebula uses (PutObject with If-None-Match,
ListObjectsV2, multipart uploads, deletes); its objects live in the process's memory, so
stopping it forgets them. Credentials are fixed test values, given as storage options:
nothing reaches AWS, and no AWS credential of the machine is read.

Not for: fixtures (tests/conftest.py builds them on this).
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from azurite import stop_group

KEY, SECRET = "nebula-test-key", "nebula-test-secret-3f9a"  # fake: moto takes any
MISSING = (
    "moto's server is not installed: pip install 'moto[server]' s3fs "
    "(both in the dev extra: pip install -e 'core/..[dev]')"
)
_LISTENING = re.compile(rb"Running on http://127\.0\.0\.1:(\d+)")


def installed() -> bool:
    """Whether moto's server and s3fs can be imported here."""
    return all(importlib.util.find_spec(m) is not None for m in ("moto", "flask", "s3fs"))


class MotoServer:
    """One moto server process; its output in `log_path`.

    Example (not run here: it starts a process):
        server = MotoServer(tmp_path / "moto.log").start(); ...; server.stop()
    """

    def __init__(self, log_path: Path) -> None:
        self.log_path = Path(log_path)
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 60.0) -> MotoServer:
        """Start the server and wait (bounded) until it listens; sets `port`."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        env["PYTHONUNBUFFERED"] = "1"
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", "0"],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                env=env,
            )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            found = _LISTENING.search(self.log_path.read_bytes())
            if found:
                self.port = int(found.group(1))
                return self
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        tail = self.log_path.read_bytes()[-2000:].decode(errors="replace")
        self.stop()
        raise RuntimeError(f"moto's server did not start within {timeout_s} s:\n{tail}")

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL after 10 s)."""
        stop_group(self.proc)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def options(self) -> dict[str, Any]:
        """Storage options that reach this server (the `nebula --storage-option` form is
        `cli_options`)."""
        return {
            "endpoint_url": self.endpoint,
            "key": KEY,
            "secret": SECRET,
        }

    def cli_options(self) -> list[str]:
        """`--storage-option KEY=VALUE` arguments of the `nebula` commands for it."""
        out = []
        for name, value in (("endpoint_url", self.endpoint), ("key", KEY), ("secret", SECRET)):
            out += ["--storage-option", f"{name}={value}"]
        return out

    def create_bucket(self, name: str) -> None:
        import s3fs

        fs = s3fs.S3FileSystem(skip_instance_cache=True, **self.options())
        fs.makedirs(name, exist_ok=True)
