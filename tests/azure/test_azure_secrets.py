"""No secret in logs, exceptions, manifests, the history, or CLI output.

Everything runs with every logger at DEBUG (nebula's, adlfs's, the Azure SDK's with its
HTTP logging, aiohttp's, fsspec's); then all of that text, every exception's message and
traceback, every file written (on Azurite and in the memory tier) and the CLI's stdout
and stderr are searched for the account key and the SAS signature.
"""

from __future__ import annotations

import logging
import traceback
import urllib.parse
import uuid
from pathlib import Path

import pytest
import torch
from azure.storage.blob import BlobServiceClient
from azurite import ACCOUNT, KEY, Azurite
from typer.testing import CliRunner

import nebulaml as nm
from nebula_cli.app import app
from nebulaml.storage.redaction import redact, scrub_exception, secrets_in
from nebulaml.storage.store import Store

CONTAINER = "nebula-tests"


def _sig(sas: str) -> str:
    return dict(urllib.parse.parse_qsl(sas))["sig"]


@pytest.mark.slow
def test_no_secret_anywhere(
    azurite: Azurite,
    tmp_path: Path,
    memory_tier: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Catches: a storage option, connection string or SAS token echoed by an error
    # message (ours or the SDK's), a log line, a chained exception's traceback, the
    # history's error column, a manifest or marker, or the CLI.
    for var in (
        "AZURE_STORAGE_CONNECTION_STRING",
        "AZURE_STORAGE_ACCOUNT_NAME",
        "AZURE_STORAGE_ACCOUNT_KEY",
        "AZURE_STORAGE_SAS_TOKEN",
    ):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("NEBULA_STORAGE_RETRIES", "1")
    monkeypatch.setenv("NEBULA_STORAGE_RETRY_BASE_S", "0.01")
    caplog.set_level(logging.DEBUG)
    for name in ("azure", "adlfs", "aiohttp", "fsspec", "nebulaml", "urllib3"):
        logging.getLogger(name).setLevel(logging.DEBUG)
    sas = azurite.container_sas(CONTAINER)
    read_only_sas = azurite.container_sas(CONTAINER, write=False)
    secrets = [KEY, _sig(sas), urllib.parse.quote(_sig(sas), safe=""), _sig(read_only_sas)]
    texts: list[str] = []

    def record(exc: BaseException) -> None:
        texts.append(str(exc))
        texts.append("".join(traceback.format_exception(exc)))

    root = f"az://{CONTAINER}/secrets-{uuid.uuid4().hex[:10]}"
    key_options = azurite.key_options()
    sas_options = {"account_name": ACCOUNT, "sas_token": sas, "account_url": azurite.endpoint}

    # 1. The API with an account key, including a failed persist (its error goes to the
    #    history's error column) and a failed read.
    nm.init(root, persistent_time_interval=3600, storage_options=key_options)
    for step in (1, 2):
        nm.Checkpoint(f"global_step{step}").save("model", {"w": torch.ones(1000) * step})
        nm.flush_persistence()
    assert nm.get_latest_checkpoint().load("model")["w"][0] == 2
    nm.shutdown()
    nm.init(
        f"{root}-denied",
        persistent_time_interval=3600,
        on_persist_error="raise",  # raised once, then shut down quietly
        storage_options={
            "account_name": ACCOUNT,
            "sas_token": read_only_sas,
            "account_url": azurite.endpoint,
        },
    )
    nm.Checkpoint("global_step3").save("model", {"w": torch.ones(10)})
    with pytest.raises(nm.PersistError) as denied:
        nm.flush_persistence()
    record(denied.value)
    assert "403" in str(denied.value)
    nm.shutdown()
    for options in (key_options, sas_options):
        with pytest.raises(nm.StorageError) as missing:
            Store(root, options).read_bytes("global_step9", "model")
        record(missing.value)
    # A connection refused, with the key in the connection string.
    refused = azurite.connection_string.replace(str(azurite.port), "9")
    with pytest.raises(nm.StorageError) as down:
        Store(root, {"connection_string": refused}).list_dirs()
    record(down.value)
    assert "gave up after 2 tries" in str(down.value)

    # 2. Every CLI command with a SAS token, and a failing one.
    flags = [
        "--storage-option",
        f"account_name={ACCOUNT}",
        "--storage-option",
        f"sas_token={sas}",
        "--storage-option",
        f"account_url={azurite.endpoint}",
    ]
    local = tmp_path / "copy"
    commands = [
        ["ls", root, "--all"],
        ["ls", root, "--json"],
        ["latest", root],
        ["inspect", root, "global_step2"],
        ["inspect", root, "global_step2", "--item", "model"],
        ["verify", root],
        ["history", root],
        ["history", root, "--csv"],
        ["copy", root, "global_step1", str(local)],
        ["copy", str(local), "global_step1", f"{root}-copy"],
        ["prune", root, "--keep", "1", "--yes"],
        ["flush", root],
    ]
    for args in commands:
        result = CliRunner().invoke(app, [*args, *flags])
        assert result.exit_code == 0, (args, result.stderr)
        texts += [result.stdout, result.stderr]
    denied_flags = [f.replace(sas, read_only_sas) for f in flags]
    result = CliRunner().invoke(
        app,
        [
            "prune",
            f"{root}-copy",
            "--keep",
            "1",
            "--yes",
            *denied_flags,
            "--storage-option",
            "nebula_retries=0",
        ],
    )
    texts += [result.stdout, result.stderr]
    result = CliRunner().invoke(app, ["ls", root, "--storage-option", f"account_key{KEY}"])
    assert result.exit_code == 2
    texts += [result.stdout, result.stderr]

    # 3. Every file nebula wrote: on Azurite, in the memory tier, in the local copy.
    with BlobServiceClient.from_connection_string(azurite.connection_string) as client:
        container = client.get_container_client(CONTAINER)
        for blob in container.list_blobs(name_starts_with=root.split("/", 3)[3]):
            texts.append(container.download_blob(blob.name).readall().decode("latin-1"))
    for folder in (memory_tier, local):
        for path in folder.rglob("*"):
            if path.is_file():
                texts.append(path.read_bytes().decode("latin-1"))

    texts.append(caplog.text)
    assert "Request URL" in caplog.text  # the SDK's HTTP logging was on
    everything = "\n".join(texts)
    for secret in secrets:
        assert secret not in everything, f"a secret leaked: ...{secret[-6:]}"


def test_redact_masks_each_kind_of_secret() -> None:
    # Catches: a credential format that redact does not know.
    cases = {
        f"AccountName=a;AccountKey={KEY};": KEY,
        "https://a.blob.core.windows.net/c/b?sv=2024&sr=c&sig=AbC%2Bd%3D&se=1": "AbC%2Bd%3D",
        "SharedAccessSignature=sv=1&sig=xyz123;BlobEndpoint=x": "xyz123",
        "Authorization: SharedKey devstoreaccount1:Zm9vYmFy": "Zm9vYmFy",
        "Authorization: Bearer eyJ0eXAiOi.abc.def": "eyJ0eXAiOi.abc.def",
        "{'account_key': 'k3y-value', 'account_name': 'a'}": "k3y-value",
        'storage_options={"client_secret": "s3cr3t!"}': "s3cr3t!",
        "sas_token=sv=1&ss=b&sig=q1w2e3": "q1w2e3",
        "credential=abcdef123456": "abcdef123456",
    }
    for text, secret in cases.items():
        assert secret not in redact(text), text
    assert redact("plain az://c/run1/global_step5/model: not found") == (
        "plain az://c/run1/global_step5/model: not found"
    )


def test_secrets_are_scrubbed_from_chained_exceptions() -> None:
    # Catches: a StorageError whose own message is clean but whose __cause__ (printed in
    # every traceback) still holds the connection string.
    options = {"connection_string": f"AccountName=a;AccountKey={KEY};"}
    try:
        try:
            raise ValueError(f"unable to connect with {options['connection_string']}")
        except ValueError as inner:
            raise RuntimeError("wrapper") from inner
    except RuntimeError as outer:
        scrub_exception(outer, secrets_in(options))
        assert KEY not in "".join(traceback.format_exception(outer))
