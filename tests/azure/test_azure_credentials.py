"""Azure credentials from the usual places, in the Azure SDK's order, explicit first."""

from __future__ import annotations

import uuid

import pytest
from azurite import ACCOUNT, KEY, Azurite

import nebulaml as nm
from nebulaml.storage.azure_auth import resolve_auth
from nebulaml.storage.store import Store

CONTAINER = "nebula-tests"
CS = "DefaultEndpointsProtocol=http;AccountName=a;AccountKey=k;BlobEndpoint=http://x/a;"


@pytest.mark.parametrize(
    ("options", "env", "kind", "source"),
    [
        ({}, {"AZURE_STORAGE_CONNECTION_STRING": CS}, "connection_string", "environment"),
        ({"account_name": "a"}, {"AZURE_STORAGE_ACCOUNT_KEY": "k"}, "account_key", "environment"),
        (
            {},
            {"AZURE_STORAGE_ACCOUNT_NAME": "a", "AZURE_STORAGE_SAS_TOKEN": "sv=1&sig=s"},
            "sas_token",
            "environment",
        ),
        ({"account_name": "a"}, {}, "default", "environment"),
        ({}, {"AZURE_STORAGE_ACCOUNT_NAME": "a"}, "default", "environment"),
        # The connection string in the environment comes before an account key there.
        (
            {},
            {
                "AZURE_STORAGE_CONNECTION_STRING": CS,
                "AZURE_STORAGE_ACCOUNT_NAME": "a",
                "AZURE_STORAGE_ACCOUNT_KEY": "k",
            },
            "connection_string",
            "environment",
        ),
        # Explicit options beat anything in the environment.
        (
            {"account_name": "a", "account_key": "k"},
            {"AZURE_STORAGE_CONNECTION_STRING": CS},
            "account_key",
            "storage_options",
        ),
        (
            {"account_name": "a", "sas_token": "sv=1&sig=s"},
            {"AZURE_STORAGE_ACCOUNT_KEY": "k"},
            "sas_token",
            "storage_options",
        ),
        (
            {"connection_string": CS, "account_key": "k"},
            {},
            "connection_string",
            "storage_options",
        ),
        (
            {"account_name": "a", "client_id": "i", "client_secret": "s", "tenant_id": "t"},
            {},
            "service_principal",
            "storage_options",
        ),
        (
            {"account_name": "a", "anon": True},
            {"AZURE_STORAGE_ACCOUNT_KEY": "k"},
            "anonymous",
            "storage_options",
        ),
        ({"account_name": "a"}, {"AZURE_STORAGE_ANON": "true"}, "anonymous", "environment"),
    ],
)
def test_resolution_order(
    options: dict[str, object], env: dict[str, str], kind: str, source: str
) -> None:
    # Catches: the environment overriding explicit options (adlfs reads each variable
    # as a fallback per field, so an env connection string beat an explicit key), or the
    # SDK's order (connection string; key or SAS; DefaultAzureCredential) not followed.
    auth = resolve_auth(options, env)
    assert (auth.kind, auth.source) == (kind, source)


def test_the_endpoint_is_the_accounts_unless_given() -> None:
    assert resolve_auth({"account_name": "acct"}, {}).account_url == (
        "https://acct.blob.core.windows.net"
    )
    assert resolve_auth({"account_name": "a", "account_url": "http://h:1/a"}, {}).account_url == (
        "http://h:1/a"
    )
    assert "k3y" not in repr(resolve_auth({"account_name": "a", "account_key": "k3y"}, {}))


def _works(url: str, options: dict[str, object] | None = None) -> None:
    store = Store(url, options)
    store.make_dir()
    store.write_bytes(("t", "a"), b"ok")
    assert Store(url, options).read_bytes("t", "a") == b"ok"


def _url() -> str:
    return f"az://{CONTAINER}/cred-{uuid.uuid4().hex[:12]}"


def test_connection_string_from_the_environment(azure_env: Azurite) -> None:
    _works(_url())


def test_explicit_options_win_over_a_wrong_environment(
    azure_env: Azurite, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Catches: the environment's (here: wrong) connection string used despite options.
    broken = azure_env.connection_string.replace(str(azure_env.port), "9")
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", broken)
    _works(_url(), {"connection_string": azure_env.connection_string})
    _works(_url(), azure_env.key_options())
    sas = azure_env.container_sas(CONTAINER)
    _works(_url(), {"account_name": ACCOUNT, "sas_token": sas, "account_url": azure_env.endpoint})
    with pytest.raises(nm.StorageError):  # the broken one alone fails: it was not used above
        Store(_url(), {"nebula_retries": 0}).list_dirs()


def test_account_name_with_key_or_sas_from_the_environment(
    azure_env: Azurite, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("AZURE_STORAGE_CONNECTION_STRING")
    monkeypatch.setenv("AZURE_STORAGE_ACCOUNT_NAME", ACCOUNT)
    monkeypatch.setenv("AZURE_STORAGE_ACCOUNT_KEY", KEY)
    _works(_url(), {"account_url": azure_env.endpoint})
    monkeypatch.delenv("AZURE_STORAGE_ACCOUNT_KEY")
    monkeypatch.setenv("AZURE_STORAGE_SAS_TOKEN", azure_env.container_sas(CONTAINER))
    _works(_url(), {"account_url": azure_env.endpoint})


def test_default_azure_credential_when_nothing_else(monkeypatch: pytest.MonkeyPatch) -> None:
    # Catches: an account with no key, SAS or connection string refused, instead of
    # signing in with DefaultAzureCredential (managed identity, workload identity, CLI).
    # (Only built here, never asked for a token: that would leave this machine.)
    for var in (
        "AZURE_STORAGE_CONNECTION_STRING",
        "AZURE_STORAGE_ACCOUNT_KEY",
        "AZURE_STORAGE_SAS_TOKEN",
        "AZURE_STORAGE_ANON",
    ):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AZURE_STORAGE_ACCOUNT_NAME", "someaccount")
    store = Store("az://container/run1")
    assert type(store.fs.credential).__name__ == "DefaultAzureCredential"
    assert store.fs.account_url == "https://someaccount.blob.core.windows.net"
    abfss = Store("abfss://container@other.dfs.core.windows.net/run1")
    assert abfss.fs.account_url == "https://other.blob.core.windows.net"
    assert abfss.url == "abfss://container@other.dfs.core.windows.net/run1"


def test_no_account_at_all_says_what_to_set(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("AZURE_STORAGE_CONNECTION_STRING", "AZURE_STORAGE_ACCOUNT_NAME"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(nm.StorageError, match="AZURE_STORAGE_CONNECTION_STRING, or"):
        Store("az://container/run1")
