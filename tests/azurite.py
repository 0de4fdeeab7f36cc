"""A real Azurite (the Azure Blob Storage emulator) for the tests and the benchmark.

`make test` installs the pinned npm package into .azurite/ when it is missing. Azurite
listens on 127.0.0.1 only, on a port the OS picks (`--blobPort 0`, read back from its
output) unless one is given (a restart reuses its port and data folder). Telemetry is
off: nothing leaves the machine.

Not for: fixtures (tests/conftest.py builds them on this).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

VERSION = "3.35.0"  # the suite's Azurite
# The first with Put Block From URL (a persist's unchanged ranges staged from the previous
# blob; 3.35.0 answers 501): the tests of those ranges run it, beside the suite's.
STAGING_VERSION = "3.37.0"
REPO = Path(__file__).resolve().parents[1]
ACCOUNT = "devstoreaccount1"
# Azurite's well-known development key (public, documented by Microsoft).
KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
BIN_ENV = "NEBULA_AZURITE_BIN"
STAGING_BIN_ENV = "NEBULA_AZURITE_STAGING_BIN"
MISSING = (
    f"Azurite is not installed (looked for {REPO / '.azurite/node_modules/.bin/azurite-blob'} "
    f"and ${BIN_ENV}): run `make test`, which installs it, or "
    f"`npm install --prefix .azurite azurite@{VERSION}`"
)


def missing(version: str) -> str:
    """Why Azurite `version` cannot start, and how to install it."""
    return (
        f"Azurite {version} is not installed (looked for "
        f"{REPO / f'.azurite-{version}/node_modules/.bin/azurite-blob'} and "
        f"${STAGING_BIN_ENV}): run `make azurite`"
    )


_LISTENING = re.compile(rb"listens on https?://127\.0\.0\.1:(\d+)")


def binary(version: str = VERSION) -> Path | None:
    """The azurite-blob executable of `version` (the suite's, or `STAGING_VERSION`), or
    None when it is not installed (`make azurite` installs both)."""
    override = os.environ.get(BIN_ENV if version == VERSION else STAGING_BIN_ENV)
    folder = REPO / (".azurite" if version == VERSION else f".azurite-{version}")
    path = Path(override) if override else folder / "node_modules" / ".bin" / "azurite-blob"
    return path if path.exists() else None


class Azurite:
    """One Azurite blob service process on a data folder (`location`).

    Example (not run here: it needs the npm package):
        az = Azurite(tmp_path / "data"); az.start(); ...; az.stop()
    """

    def __init__(
        self,
        location: Path,
        *,
        port: int = 0,
        log_path: Path | None = None,
        version: str = VERSION,
    ) -> None:
        self.location = Path(location)
        self.version = version
        self.port = port
        self.log_path = log_path or self.location.with_name(self.location.name + ".log")
        self.proc: subprocess.Popen[bytes] | None = None

    # lifecycle ---------------------------------------------------------------------------
    def start(self, timeout_s: float = 60.0) -> Azurite:
        """Start Azurite and wait (bounded) until it listens; sets `port`."""
        exe = binary(self.version)
        if exe is None:
            raise FileNotFoundError(MISSING if self.version == VERSION else missing(self.version))
        self.location.mkdir(parents=True, exist_ok=True)
        offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [
                    str(exe),
                    "--blobHost",
                    "127.0.0.1",
                    "--blobPort",
                    str(self.port),
                    "--location",
                    str(self.location),
                    "--skipApiVersionCheck",
                    "--loose",
                    "--disableTelemetry",
                    "--silent",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            found = _LISTENING.search(self.log_path.read_bytes()[offset:])
            if found:
                self.port = int(found.group(1))
                return self
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        tail = self.log_path.read_bytes()[offset:][-2000:].decode(errors="replace")
        self.stop()
        raise RuntimeError(f"Azurite did not start within {timeout_s} s:\n{tail}")

    def kill(self) -> None:
        """SIGKILL: no shutdown, whatever Azurite held in memory is lost (a crash)."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)

    def stop(self) -> None:
        """Stop Azurite (SIGTERM, then SIGKILL after 10 s)."""
        stop_group(self.proc)

    def restart(self, timeout_s: float = 60.0) -> Azurite:
        """Start again on the same data folder and the same port."""
        assert self.port, "start() first"
        return self.start(timeout_s)

    # how to reach it ---------------------------------------------------------------------
    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}/{ACCOUNT}"

    @property
    def connection_string(self) -> str:
        return (
            f"DefaultEndpointsProtocol=http;AccountName={ACCOUNT};AccountKey={KEY};"
            f"BlobEndpoint={self.endpoint};"
        )

    def key_options(self) -> dict[str, Any]:
        """Storage options for an account name with its key (no connection string)."""
        return {"account_name": ACCOUNT, "account_key": KEY, "account_url": self.endpoint}

    def container_sas(self, container: str, *, write: bool = True, hours: float = 2) -> str:
        """A SAS token (without '?') for `container`: read and list, and write if asked."""
        from datetime import datetime, timedelta, timezone

        from azure.storage.blob import ContainerSasPermissions, generate_container_sas

        permission = ContainerSasPermissions(
            read=True, list=True, write=write, create=write, add=write, delete=write
        )
        return generate_container_sas(
            ACCOUNT,
            container,
            account_key=KEY,
            permission=permission,
            expiry=datetime.now(timezone.utc) + timedelta(hours=hours),
        )

    def create_container(self, name: str) -> None:
        from azure.storage.blob import BlobServiceClient

        with BlobServiceClient.from_connection_string(self.connection_string) as client:
            names = {c.name for c in client.list_containers(name_starts_with=name)}
            if name not in names:
                client.create_container(name)


def stop_group(proc: subprocess.Popen[bytes] | None) -> None:
    """Stop a server started in a process group of its own (Azurite, moto): SIGTERM, then
    SIGKILL after 10 s."""
    if proc is None or proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
