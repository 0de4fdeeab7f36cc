"""Shared fixtures of the test suite (the autouse isolation fixture is in ../conftest.py)."""

from __future__ import annotations

import os
import signal
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import azurite as azurite_server
import gcsserver
import pytest
import s3server
import schedule
import shared_setup
import warm
from azurite import Azurite


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The longest tests first, shared out between pytest-xdist's workers (tests/schedule.py)."""
    schedule.order(config, items)


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: unknown without it
def pytest_configure_node(node: Any) -> None:
    """The controller's --dist, for each worker's `schedule.order` (a worker's is "no")."""
    node.workerinput[schedule.DIST_KEY] = node.config.getvalue("dist")


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """A persistent root on the local filesystem (not created: nebula creates it)."""
    return tmp_path / "persistent"


@pytest.fixture(scope="session", autouse=True)
def zygote(scratch_folder: str) -> Iterator[None]:
    """Children of the suite's that run nebula and torch start warm (tests/warm.py): the
    worker's zygote listens in its scratch folder, and ends with the worker."""
    warm.place(scratch_folder)
    yield
    warm.stop()


@pytest.fixture(scope="session")
def shared_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder of the set-up the run's workers share (tests/shared_setup.py)."""
    return shared_setup.shared_root(tmp_path_factory.getbasetemp())


# Azure Blob Storage: one real Azurite per test session, started on first use -------------
AZURE_CONTAINER = "nebula-tests"


@pytest.fixture(scope="session")
def azurite(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Azurite]:
    """A running Azurite on 127.0.0.1 (its data in a session temporary folder).

    Not installed: the test fails under CI (CI=true), and is skipped elsewhere.
    """
    if azurite_server.binary() is None:
        if os.environ.get("CI", "").strip().lower() in ("1", "true", "yes"):
            pytest.fail(azurite_server.MISSING, pytrace=False)
        pytest.skip(azurite_server.MISSING)
    base = tmp_path_factory.mktemp("azurite")
    server = Azurite(base / "data", log_path=base / "azurite.log").start()
    server.create_container(AZURE_CONTAINER)
    yield server
    server.stop()


@pytest.fixture
def point_at_azurite(monkeypatch: pytest.MonkeyPatch) -> Callable[[Azurite], Azurite]:
    """Put an Azurite's credentials in the environment (AZURE_STORAGE_CONNECTION_STRING),
    with short retries, as a job on Azure would have them (undone after the test)."""

    def point(server: Azurite) -> Azurite:
        for var in ("AZURE_STORAGE_ACCOUNT_NAME", "AZURE_STORAGE_ACCOUNT_KEY",
                    "AZURE_STORAGE_SAS_TOKEN", "AZURE_STORAGE_ANON"):  # fmt: skip
            monkeypatch.delenv(var, raising=False)
        monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", server.connection_string)
        monkeypatch.setenv("NEBULA_STORAGE_RETRIES", "3")
        monkeypatch.setenv("NEBULA_STORAGE_RETRY_BASE_S", "0.05")
        monkeypatch.setenv("NEBULA_STORAGE_RETRY_MAX_S", "0.2")
        return server

    return point


@pytest.fixture
def own_azurite(
    tmp_path: Path, point_at_azurite: Callable[[Azurite], Azurite]
) -> Iterator[Azurite]:
    """An Azurite for this test alone (the test takes it away: outage_kit.store_away), its
    container "outage" made and its credentials in the environment."""
    if azurite_server.binary() is None:
        if os.environ.get("CI", "").strip().lower() in ("1", "true", "yes"):
            pytest.fail(azurite_server.MISSING, pytrace=False)
        pytest.skip(azurite_server.MISSING)
    server = Azurite(tmp_path / "azurite", log_path=tmp_path / "azurite.log").start()
    server.create_container(OUTAGE_CONTAINER)
    yield point_at_azurite(server)
    if server.proc is not None and server.proc.poll() is None:
        os.killpg(server.proc.pid, signal.SIGCONT)
    server.stop()


OUTAGE_CONTAINER = "outage"


@pytest.fixture
def azure_env(azurite: Azurite, point_at_azurite: Callable[[Azurite], Azurite]) -> Azurite:
    """The session's Azurite, its credentials in the environment (`point_at_azurite`)."""
    return point_at_azurite(azurite)


@pytest.fixture
def az_url(azure_env: Azurite) -> str:
    """A fresh root in Azurite's test container, e.g. az://nebula-tests/5f0c.../"""
    return f"az://{AZURE_CONTAINER}/{uuid.uuid4().hex[:16]}"


# S3: one real moto server per test session, started on first use ------------------------
S3_BUCKET = "nebula-tests"


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[s3server.MotoServer]:
    """A running moto S3 server on 127.0.0.1, its `S3_BUCKET` created.

    Not installed: the test fails under CI (CI=true), and is skipped elsewhere.
    """
    if not s3server.installed():
        if os.environ.get("CI", "").strip().lower() in ("1", "true", "yes"):
            pytest.fail(s3server.MISSING, pytrace=False)
        pytest.skip(s3server.MISSING)
    base = tmp_path_factory.mktemp("moto")
    server = s3server.MotoServer(base / "moto.log").start()
    try:
        server.create_bucket(S3_BUCKET)
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3_url(s3_server: s3server.MotoServer) -> str:
    """A fresh root in the moto server's test bucket, e.g. s3://nebula-tests/5f0c...;
    reach it with `s3_server.options()`."""
    return f"s3://{S3_BUCKET}/{uuid.uuid4().hex[:16]}"


# GCS: one gcp-storage-emulator per test session, started on first use -------------------
GCS_BUCKET = "nebula-tests"


@pytest.fixture(scope="session")
def gcs_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[gcsserver.GCSEmulator]:
    """A running gcp-storage-emulator on 127.0.0.1, its `GCS_BUCKET` created.

    Not installed: the test fails under CI (CI=true), and is skipped elsewhere.
    """
    if not gcsserver.installed():
        if os.environ.get("CI", "").strip().lower() in ("1", "true", "yes"):
            pytest.fail(gcsserver.MISSING, pytrace=False)
        pytest.skip(gcsserver.MISSING)
    base = tmp_path_factory.mktemp("gcs")
    server = gcsserver.GCSEmulator(base / "gcs.log", GCS_BUCKET).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def gcs_url(gcs_server: gcsserver.GCSEmulator) -> str:
    """A fresh root in the emulator's test bucket, e.g. gs://nebula-tests/5f0c...; reach it
    with `gcs_server.options()`."""
    return f"gs://{GCS_BUCKET}/{uuid.uuid4().hex[:16]}"
