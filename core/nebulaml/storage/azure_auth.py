"""How a `Store` connects to Azure Blob Storage and ADLS Gen2 (`az://`, `abfs://`, `abfss://`).

Built on adlfs (imported only when such a root is opened). What nebula adds:

- credentials resolved in the Azure SDK's order, explicit storage options first
  (`resolve_auth`): a connection string; an account name with a key or a SAS token;
  otherwise `DefaultAzureCredential`;
- SDK clients without the SDK's own retries (its default waits 15 s and more between
  tries): the storage boundary retries, bounded and configurable (retry.py);
- the upload settings of item files (`upload_settings`).

The backend that uses this filesystem, with the blob requests nebula needs beyond adlfs
(block uploads, create-only uploads, uncached listings), is azure.py.

Not for: the storage operations (store.py, azure.py) or redaction (redaction.py). May
import: `nebulaml.errors`.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from nebulaml.errors import InvalidArgumentError, StorageError

PROTOCOLS = ("az", "abfs", "abfss")
INSTALL_HINT = "install the Azure extra: pip install 'nebula-checkpoint[azure]'"

OPTION_BLOCK_BYTES = "nebula_block_bytes"
OPTION_CONCURRENCY = "nebula_upload_concurrency"
OPTION_ACCOUNT_URL = "account_url"
DEFAULT_BLOCK_BYTES = 8 << 20
DEFAULT_CONCURRENCY = 8

# Storage options nebula reads itself; everything else is adlfs's.
NEBULA_OPTIONS = (OPTION_BLOCK_BYTES, OPTION_CONCURRENCY, OPTION_ACCOUNT_URL)

_INT_OPTIONS = frozenset(
    {
        "blocksize",
        "max_concurrency",
        "timeout",
        "connection_timeout",
        "read_timeout",
        "max_paths",
        OPTION_BLOCK_BYTES,
        OPTION_CONCURRENCY,
    }
)
_FLOAT_OPTIONS = frozenset({"listings_expiry_time"})
_BOOL_OPTIONS = frozenset(
    {
        "anon",
        "use_listings_cache",
        "assume_container_exists",
        "version_aware",
        "skip_instance_cache",
    }
)
_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")

ENV_CONNECTION_STRING = "AZURE_STORAGE_CONNECTION_STRING"
ENV_ACCOUNT_NAME = "AZURE_STORAGE_ACCOUNT_NAME"
ENV_ACCOUNT_KEY = "AZURE_STORAGE_ACCOUNT_KEY"
ENV_SAS_TOKEN = "AZURE_STORAGE_SAS_TOKEN"
ENV_ANON = "AZURE_STORAGE_ANON"


def is_azure_url(url: str) -> bool:
    """Whether a root URL names Azure Blob Storage or ADLS Gen2.

    Example:
        >>> is_azure_url("az://container/run1"), is_azure_url("abfss://c@a.dfs.core.windows.net/x")
        (True, True)
        >>> is_azure_url("/mnt/ckpt")
        False
    """
    scheme, sep, _ = url.partition("://")
    return bool(sep) and scheme.lower() in PROTOCOLS


def normalize_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """Options as adlfs expects them: text from the command line (`--storage-option
    max_concurrency=4`) becomes the int, float or bool that the option takes."""
    out: dict[str, Any] = {}
    for name, value in options.items():
        if isinstance(value, str):
            try:
                if name in _INT_OPTIONS:
                    value = int(value)
                elif name in _FLOAT_OPTIONS:
                    value = float(value)
                elif name in _BOOL_OPTIONS:
                    value = _parse_bool(value)
            except ValueError:
                raise InvalidArgumentError(
                    f"storage option {name}={value!r} is not a valid value for {name}"
                ) from None
        out[name] = value
    return out


def _parse_bool(text: str) -> bool:
    if text.strip().lower() in _TRUE:
        return True
    if text.strip().lower() in _FALSE:
        return False
    raise ValueError(text)


# credentials ---------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class AzureAuth:
    """How a root authenticates: `kind` is one of "connection_string", "credential",
    "account_key", "sas_token", "service_principal", "anonymous", "default" (the Azure
    SDK's DefaultAzureCredential); `source` is "storage_options" or "environment".
    Secret fields are left out of the repr."""

    kind: str
    source: str
    account_name: str | None = None
    account_url: str | None = None
    connection_string: str | None = field(default=None, repr=False)
    account_key: str | None = field(default=None, repr=False)
    sas_token: str | None = field(default=None, repr=False)
    credential: Any = field(default=None, repr=False)
    client_id: str | None = None
    tenant_id: str | None = None
    client_secret: str | None = field(default=None, repr=False)

    def fingerprint(self) -> str:
        """A digest of every field, secrets included: fsspec reuses a filesystem for the
        same arguments, and the repr (which hides secrets) cannot tell two keys apart."""
        credential = None if self.credential is None else id(self.credential)
        fields = (self.kind, self.account_name, self.account_url, self.connection_string,
                  self.account_key, self.sas_token, self.client_id, self.tenant_id,
                  self.client_secret, credential)  # fmt: skip
        return hashlib.sha256(repr(fields).encode()).hexdigest()


def resolve_auth(options: Mapping[str, Any], env: Mapping[str, str]) -> AzureAuth:
    """The credential a root uses, in the Azure SDK's order, explicit options first.

    1. storage options: `connection_string`; `credential` (a key, SAS or token credential
       object); `account_key`; `sas_token`; `client_id` + `client_secret` + `tenant_id`;
       `anon=True`;
    2. `AZURE_STORAGE_CONNECTION_STRING`;
    3. an account name (option `account_name`, the URL's `container@account.dfs...` host,
       or `AZURE_STORAGE_ACCOUNT_NAME`) with `AZURE_STORAGE_ACCOUNT_KEY` or
       `AZURE_STORAGE_SAS_TOKEN`;
    4. `AZURE_STORAGE_ANON=true`: anonymous (public containers);
    5. otherwise `DefaultAzureCredential` (managed identity, workload identity, Azure CLI,
       `AZURE_CLIENT_ID`/`AZURE_CLIENT_SECRET`/`AZURE_TENANT_ID`, ...).

    The endpoint is `account_url` (e.g. `http://127.0.0.1:10000/devstoreaccount1` for
    Azurite), else `https://<account_host>`, else `https://<account>.blob.core.windows.net`.

    Example:
        >>> resolve_auth({"account_name": "acct"}, {}).kind
        'default'
        >>> resolve_auth({}, {"AZURE_STORAGE_CONNECTION_STRING": "AccountName=a;..."}).source
        'environment'
    """
    account_name = options.get("account_name") or env.get(ENV_ACCOUNT_NAME) or None
    account_url = options.get(OPTION_ACCOUNT_URL) or None
    if account_url is None and options.get("account_host"):
        account_url = f"https://{options['account_host']}"
    if account_url is None and account_name:
        account_url = f"https://{account_name}.blob.core.windows.net"
    base: dict[str, Any] = {"account_name": account_name, "account_url": account_url}

    def opt(name: str) -> Any:
        value = options.get(name)
        return value if value not in (None, "") else None

    if opt("connection_string"):
        return AzureAuth("connection_string", "storage_options",
                         connection_string=opt("connection_string"))  # fmt: skip
    if opt("credential") is not None:
        return AzureAuth("credential", "storage_options", credential=opt("credential"), **base)
    if opt("account_key"):
        return AzureAuth("account_key", "storage_options", account_key=opt("account_key"), **base)
    if opt("sas_token"):
        return AzureAuth("sas_token", "storage_options", sas_token=opt("sas_token"), **base)
    if opt("client_id") and opt("client_secret") and opt("tenant_id"):
        return AzureAuth(
            "service_principal",
            "storage_options",
            client_id=opt("client_id"),
            client_secret=opt("client_secret"),
            tenant_id=opt("tenant_id"),
            **base,
        )
    if options.get("anon") is True:
        return AzureAuth("anonymous", "storage_options", **base)
    if env.get(ENV_CONNECTION_STRING):
        return AzureAuth("connection_string", "environment",
                         connection_string=env[ENV_CONNECTION_STRING])  # fmt: skip
    if account_name and env.get(ENV_ACCOUNT_KEY):
        return AzureAuth("account_key", "environment", account_key=env[ENV_ACCOUNT_KEY], **base)
    if account_name and env.get(ENV_SAS_TOKEN):
        return AzureAuth("sas_token", "environment", sas_token=env[ENV_SAS_TOKEN], **base)
    anon_env = env.get(ENV_ANON, "").strip().lower()
    if options.get("anon") is None and anon_env and anon_env not in _FALSE:
        return AzureAuth("anonymous", "environment", **base)
    return AzureAuth("default", "environment", **base)


def environment_secrets(env: Mapping[str, str]) -> dict[str, str | None]:
    """The secrets the Azure SDK may read from `env`, by the storage option each stands
    for: the storage boundary redacts them from every message, as it does options'.

    Example:
        >>> environment_secrets({ENV_ACCOUNT_KEY: "k"})["account_key"]
        'k'
    """
    return {
        "account_key": env.get(ENV_ACCOUNT_KEY),
        "sas_token": env.get(ENV_SAS_TOKEN),
        "connection_string": env.get(ENV_CONNECTION_STRING),
    }


def _auth_error(url: str) -> StorageError:
    return StorageError(
        f"{url}: no Azure storage account to connect to: set {ENV_CONNECTION_STRING}, or "
        f"{ENV_ACCOUNT_NAME} with {ENV_ACCOUNT_KEY} or {ENV_SAS_TOKEN} (or sign in for "
        f"DefaultAzureCredential), or pass storage_options / --storage-option "
        f"(connection_string, or account_name with account_key, sas_token or credential)"
    )


# the filesystem ------------------------------------------------------------------------------
@functools.cache
def _filesystem_class() -> Any:
    try:
        from adlfs import AzureBlobFileSystem
    except ImportError as exc:
        raise ImportError(f"{exc}; {INSTALL_HINT}") from exc

    class NebulaBlobFileSystem(AzureBlobFileSystem):
        """adlfs with nebula's credential order and endpoint, and without SDK retries."""

        def __init__(
            self, *args: Any, nebula_auth: AzureAuth, nebula_auth_id: str, **kwargs: Any
        ) -> None:
            # nebula_auth_id only tells fsspec's instance cache one credential from another.
            self._nebula_auth = nebula_auth
            super().__init__(*args, **kwargs)

        def _get_default_azure_credential(self, **kwargs: Any) -> tuple[None, None]:
            return None, None  # created by do_connect, when resolve_auth says so

        def _get_credential_from_service_principal(self) -> tuple[None, None]:
            return None, None

        def do_connect(self) -> None:
            from azure.core.credentials import AzureNamedKeyCredential, AzureSasCredential
            from azure.storage.blob.aio import BlobServiceClient

            auth = self._nebula_auth
            # Nebula retries (bounded, short in tests); the SDK's own policy would wait
            # 15 s, 18 s, 24 s ... before nebula even saw the error.
            client_kwargs: dict[str, Any] = {"retry_total": 0, "user_agent": "nebula-checkpoint"}
            if auth.kind == "connection_string":
                self.service_client = BlobServiceClient.from_connection_string(
                    auth.connection_string or "", **client_kwargs
                )
                return
            if not auth.account_url:
                raise ValueError("no account name")
            credential: Any = None
            if auth.kind == "credential":
                credential = auth.credential
            elif auth.kind == "account_key":
                credential = AzureNamedKeyCredential(
                    auth.account_name or "", auth.account_key or ""
                )
            elif auth.kind == "sas_token":
                credential = AzureSasCredential((auth.sas_token or "").lstrip("?"))
            elif auth.kind == "service_principal":
                from azure.identity.aio import ClientSecretCredential

                credential = ClientSecretCredential(
                    auth.tenant_id or "", auth.client_id or "", auth.client_secret or ""
                )
                self.credential = credential  # closed with the filesystem
            elif auth.kind == "default":
                from azure.identity.aio import DefaultAzureCredential

                credential = DefaultAzureCredential()
                self.credential = credential
            self.account_url = auth.account_url
            self.service_client = BlobServiceClient(
                account_url=auth.account_url, credential=credential, **client_kwargs
            )

    return NebulaBlobFileSystem


def open_filesystem(url: str, options: Mapping[str, Any], env: Mapping[str, str]) -> Any:
    """The adlfs filesystem for `url` and the root path inside it.

    Returns (fs, root). Raises `ImportError` without the Azure extra, and `StorageError`
    when no account can be found to connect to.
    """
    cls = _filesystem_class()
    from_url = cls._get_kwargs_from_urls(url)
    kwargs = {**from_url, **normalize_options(options)}
    for name in NEBULA_OPTIONS:
        kwargs.pop(name, None)
    # Listings must never be stale: a tag written a moment ago has to show.
    kwargs.setdefault("use_listings_cache", False)
    auth = resolve_auth({**from_url, **options}, env)
    if auth.kind != "connection_string" and not auth.account_url:
        raise _auth_error(url)
    fs = cls(nebula_auth=auth, nebula_auth_id=auth.fingerprint(), **kwargs)
    root = cls._strip_protocol(url).rstrip("/")
    return fs, root


def endpoint_of(fs: Any) -> str:
    """The account endpoint that an `open_filesystem` filesystem reaches, without secrets:
    `https://acct.blob.core.windows.net`, or Azurite's `http://127.0.0.1:10000/acct`. Two
    accounts with the same container and path are two roots; this tells them apart.

    Example:
        >>> class Fs: _nebula_auth = AzureAuth("connection_string", "environment",
        ...     connection_string="AccountName=a;AccountKey=k;EndpointSuffix=core.windows.net")
        >>> endpoint_of(Fs())
        'https://a.blob.core.windows.net'
    """
    auth: AzureAuth | None = getattr(fs, "_nebula_auth", None)
    if auth is None:
        return str(getattr(fs, "account_url", None) or getattr(fs, "account_name", "") or "")
    if auth.kind == "connection_string":
        fields = {}
        for part in (auth.connection_string or "").split(";"):
            name, sep, value = part.partition("=")
            if sep:
                fields[name.strip().lower()] = value.strip()
        if fields.get("blobendpoint"):
            return fields["blobendpoint"].rstrip("/")
        scheme = fields.get("defaultendpointsprotocol", "https")
        suffix = fields.get("endpointsuffix", "core.windows.net")
        return f"{scheme}://{fields.get('accountname', '')}.blob.{suffix}"
    return (auth.account_url or "").rstrip("/")


def canonical_url(url: str) -> str:
    """The URL of a root as nebula shows and compares it (scheme lower-cased, no
    trailing slash); the account host of `abfss://container@account...` is kept."""
    scheme, _, rest = url.partition("://")
    return f"{scheme.lower()}://{rest.rstrip('/')}"


def upload_settings(options: Mapping[str, Any]) -> tuple[int, int]:
    """(block size in bytes, blocks in flight) for item uploads."""
    opts = normalize_options(options)
    block_bytes = int(opts.get(OPTION_BLOCK_BYTES) or DEFAULT_BLOCK_BYTES)
    concurrency = int(opts.get(OPTION_CONCURRENCY) or DEFAULT_CONCURRENCY)
    if block_bytes < 1 or concurrency < 1:
        raise InvalidArgumentError(f"{OPTION_BLOCK_BYTES} and {OPTION_CONCURRENCY} must be >= 1")
    return block_bytes, concurrency
