"""GCS as a persistent tier: the create-only publish asks the server with
`ifGenerationMatch=0` (checked on the request itself, no server needed), and against a
real gcp-storage-emulator (tests/gcsserver.py) a checkpoint commits to gs:// and loads
back from it alone, a root is listed with one paged request, the `nebula` commands read
and write it, and its credentials are never printed.

The emulator ignores `ifGenerationMatch` (tests/gcs/test_gcs_contract.py records it), so
nebula's probe at init rightly refuses a root there: the first test below shows that, and
the others run the emulator in single-writer mode (the storage option
`nebula_single_writer`), which is what that refusal asks for; one test runs at a time on
each root, so the promise holds.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gcsserver
import pytest
import torch
from typer.testing import CliRunner

import nebulaml as nm
from nebula_cli.app import app
from nebulaml.protocol.catalog import list_committed
from nebulaml.protocol.commit import begin_tag, commit_rank, write_item
from nebulaml.storage.gcs import GCSBackend, token_secrets
from nebulaml.storage.store import Store


def _state(step: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    return {"w": torch.randn(4096, generator=generator), "b": torch.arange(16.0) * step}


def _single_writer(server: gcsserver.GCSEmulator) -> dict[str, Any]:
    """The emulator's options in single-writer mode (its create-only is not atomic)."""
    return {**server.options(), "nebula_single_writer": True}


class _Recorder:
    """A stand-in for gcsfs's filesystem: records each request, answers as told."""

    _location = "https://storage.example"

    def __init__(self, taken: bytes | None = None) -> None:
        self.calls: list[tuple[str, str, dict[str, Any]]] = []
        self.taken = taken

    def call(self, method: str, path: str, *args: Any, **kwargs: Any) -> dict[str, Any]:
        self.calls.append((method, path, kwargs))
        if self.taken is not None and kwargs.get("ifGenerationMatch") == "0":
            raise FileExistsError(path)  # gcsfs's answer to a 412
        return {"name": kwargs.get("name"), "generation": "1"}

    def cat_file(self, path: str) -> bytes:
        assert self.taken is not None
        return self.taken

    def unstrip_protocol(self, path: str) -> str:
        return f"gs://{path}"


def test_the_create_only_publish_sends_if_generation_match_0() -> None:
    # Catches: a create-only publish sent without the server's condition (a plain upload,
    # or gcsfs's `xb` should it check first and then write): two writers committing one
    # tag would both succeed, the second replacing the first's manifest.
    fs = _Recorder()
    backend = GCSBackend(fs, "bucket/run1")
    backend.publish(("global_step5", "manifest.json"), b"{}", create_only=True)
    backend.publish(("global_step5", "history.csv"), b"x", create_only=False)
    (method, url, create), (_, _, plain) = [(m, p, k) for m, p, k in fs.calls]
    assert method == "POST" and url == "https://storage.example/upload/storage/v1/b/bucket/o"
    assert create["ifGenerationMatch"] == "0"
    assert create["name"] == "run1/global_step5/manifest.json"
    assert create["data"] == b"{}" and create["uploadType"] == "media"
    assert "ifGenerationMatch" not in plain


def test_a_taken_name_is_a_conflict_unless_it_holds_the_same_bytes() -> None:
    # Catches: a retried create whose first answer was lost reported as a conflict (its
    # own manifest there), or a name taken by another writer's bytes reported as done.
    own = GCSBackend(_Recorder(taken=b"mine"), "bucket/run1")
    own.publish(("t", "manifest.json"), b"mine", create_only=True)
    other = GCSBackend(_Recorder(taken=b"theirs"), "bucket/run1")
    with pytest.raises(FileExistsError):
        other.publish(("t", "manifest.json"), b"mine", create_only=True)


def test_secrets_in_a_token_are_found_and_methods_are_not() -> None:
    # Catches: a service account's private key or an access token shown in a message, or
    # `anon` masked in every path that happens to hold the word.
    from google.oauth2.credentials import Credentials

    account = {"type": "service_account", "private_key": "-----KEY-----", "client_email": "a@b"}
    assert token_secrets(account) == ["-----KEY-----"]
    assert token_secrets("anon") == token_secrets("google_default") == token_secrets(None) == []
    assert token_secrets("ya29.access") == ["ya29.access"]
    credential = Credentials(token="ya29.from-object", refresh_token="1//refresh")
    assert token_secrets(credential) == ["ya29.from-object", "1//refresh"]


def test_gcs_failures_that_may_pass_are_retried_and_others_are_not() -> None:
    # Catches: a 503 or a 429 from GCS failing a persist at once (gcsfs's own retries are
    # off: nebula's are the only ones), or a 403 retried for minutes.
    from gcsfs.retry import HttpError

    from nebulaml.storage.retry import is_transient

    assert is_transient(HttpError({"code": 503, "message": "backend"}))
    assert is_transient(HttpError({"code": 429, "message": "slow down"}))
    assert not is_transient(HttpError({"code": 401, "message": "no"}))
    assert not is_transient(OSError("Forbidden: b/o"))


def test_the_emulator_root_is_refused_at_init_unless_single_writer(
    gcs_url: str, gcs_server: gcsserver.GCSEmulator, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Catches: a root whose server lets a second create through trusted with commits (the
    # probe not run on gs://, or its verdict ignored), or single-writer mode not honoured.
    monkeypatch.delenv("NEBULA_SINGLE_WRITER", raising=False)
    with pytest.raises(nm.InvalidArgumentError) as refused:
        nm.init(gcs_url, storage_options=gcs_server.options(), persistent_time_interval=0)
    message = str(refused.value)
    assert "\n" not in message and gcs_url in message and "showed otherwise" in message
    assert "nebula_single_writer" in message
    store = Store(gcs_url, gcs_server.options())
    assert not [n for n in store.list_files() if n.startswith(".nebula-probe-")]
    monkeypatch.setenv("NEBULA_SINGLE_WRITER", "1")
    nm.init(gcs_url, storage_options=gcs_server.options(), persistent_time_interval=0)
    nm.shutdown()


def test_a_checkpoint_commits_to_gcs_and_loads_back_bit_exact(
    gcs_url: str, gcs_server: gcsserver.GCSEmulator
) -> None:
    # Catches: a persist that never reaches gs:// (the memory tier answering every load),
    # a manifest published where the listing does not find it, or bytes changed on the way.
    options = _single_writer(gcs_server)
    nm.init(gcs_url, storage_options=options, persistent_time_interval=0)
    for step in (1, 2):
        nm.Checkpoint(f"global_step{step}", 1).save("model", _state(step))
        assert nm.flush_persistence()
    nm.shutdown()  # the memory tier released: only gs:// holds them now
    store = Store(gcs_url, options)
    assert sorted(store.list_dirs()) == ["global_step1", "global_step2"]
    assert "manifest.json" in store.list_files("global_step2")
    with nm.using_storage_options(options):
        listed = nm.list_checkpoints(gcs_url)
        assert [c["tiers"] for c in listed] == [["persistent"], ["persistent"]]
        latest = nm.get_latest_checkpoint(gcs_url)
        assert latest is not None and latest.tag == "global_step2"
        loaded = latest.load("model")
    for name, tensor in _state(2).items():
        assert loaded[name].dtype == tensor.dtype
        assert loaded[name].numpy().tobytes() == tensor.numpy().tobytes()


def test_a_root_is_listed_with_one_paged_request(
    gcs_url: str, gcs_server: gcsserver.GCSEmulator
) -> None:
    # Catches: a listing that asks the server for each tag folder in turn (a request per
    # checkpoint), or a cached one.
    store = Store(gcs_url, gcs_server.options())
    store.make_dir()
    tags = [f"global_step{n}" for n in range(1, 9)]
    for tag in tags:
        begin_tag(store, tag, rank=0, overwrite=False)
        items = [write_item(store, tag, "model", {"w": torch.ones(2)}, rank=0)]
        commit_rank(store, tag, rank=0, world_size=1, items=items, created_at="t")
    first = list_committed(store)
    since = gcs_server.log_size()
    again = list_committed(store)
    assert [i.tag for i in again] == [i.tag for i in first] == tags
    key = gcs_url.split("/", 3)[3]  # another test's requests (a lease let go) may be logged
    requests = [r for r in gcs_server.requests(since) if key in r]
    assert len(requests) == 1 and requests[0].startswith("GET /storage/v1/b/nebula-tests/o?")
    assert "delimiter" not in requests[0], requests


def test_nebula_ls_verify_copy_and_prune_on_a_gcs_root(
    gcs_url: str, gcs_server: gcsserver.GCSEmulator, root: Path
) -> None:
    # Catches: a command that cannot open a gs:// root with --storage-option, a copy that
    # commits nothing there, a verify that passes a damaged item, or a prune that cannot
    # delete on GCS (or deletes the newest).
    nm.init(str(root), persistent_time_interval=0)
    for step in (1, 2):
        nm.Checkpoint(f"global_step{step}", 1).save("model", _state(step))
        assert nm.flush_persistence()
    nm.shutdown()
    opts, runner = gcs_server.cli_options(), CliRunner()
    for tag in ("global_step1", "global_step2"):
        done = runner.invoke(app, ["copy", str(root), tag, gcs_url, *opts])
        assert done.exit_code == 0, done.output
    ls = runner.invoke(app, ["ls", gcs_url, "--json", *opts])
    assert ls.exit_code == 0, ls.output
    tags = [c["tag"] for c in json.loads(ls.stdout)["checkpoints"]]
    assert sorted(tags) == ["global_step1", "global_step2"]
    ok = runner.invoke(app, ["verify", gcs_url, *opts])
    assert ok.exit_code == 0, ok.output
    pruned = runner.invoke(app, ["prune", gcs_url, "--keep", "1", "--yes", *opts])
    assert pruned.exit_code == 0, pruned.output
    store = Store(gcs_url, gcs_server.options())
    assert store.list_dirs() == ["global_step2"]
    with nm.using_storage_options(gcs_server.options()):
        loaded = nm.get_checkpoint("global_step2", gcs_url).load("model")
    assert torch.equal(loaded["w"], _state(2)["w"])
    # One byte of the item changed on the server: verify fails, naming the file.
    item = next(n for n in store.list_files("global_step2") if n.startswith("model"))
    data = bytearray(store.read_bytes("global_step2", item))
    data[-100] ^= 0xFF
    store.write_bytes(("global_step2", item), bytes(data))
    bad = runner.invoke(app, ["verify", gcs_url, *opts])
    assert bad.exit_code == 1 and item in bad.output, bad.output


def test_a_credential_in_an_error_is_masked(gcs_server: gcsserver.GCSEmulator) -> None:
    # Catches: an access token shown by an error message (here pasted into a root's path,
    # where a message names it).
    from google.oauth2.credentials import Credentials

    secret = "ya29.nebula-test-token-7b2e"
    options = {**gcs_server.options(), "token": Credentials(token=secret)}
    store = Store(f"gs://nebula-tests/{secret}", options)
    with pytest.raises(nm.StorageError) as caught:
        store.read_bytes("missing")
    assert "gs://nebula-tests/***/missing" in str(caught.value)
    assert secret not in str(caught.value)


def test_an_abandoned_upload_never_commits_an_object(
    gcs_url: str, gcs_server: gcsserver.GCSEmulator
) -> None:
    # Catches: a failed write's object committed (a truncated item, however briefly) and
    # removed after: the writer closed instead of discarded, or left for the collector
    # to close (fsspec's writer uploads what it holds when it is freed).
    import gc

    store = Store(gcs_url, gcs_server.options())
    store.make_dir()
    since = gcs_server.log_size()
    with pytest.raises(RuntimeError), store.open_write("t", "item") as f:
        f.write(b"x" * (1 << 20))
        raise RuntimeError("the caller failed mid-write")
    del f
    gc.collect()
    key = gcs_url.split("/", 3)[3]
    assert not [r for r in gcs_server.requests(since) if r.startswith("POST") and key in r]
    assert store.list_files("t") == {}


def test_gcsfs_tries_each_request_once_and_nebula_retries() -> None:
    # Catches: gcsfs's own retries left on (six tries, backing off up to 32 s) under
    # nebula's: a server that refuses connections held each call past its deadline, and
    # init's first look (asked without retries) waited half a minute instead of failing.
    import socket
    import time

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = Store("gs://nebula-tests/down", {"endpoint_url": f"http://127.0.0.1:{port}",
                                             "token": "anon", "nebula_retries": 0})  # fmt: skip
    started = time.monotonic()
    with pytest.raises(nm.StorageError, match="Cannot connect"):
        store.read_bytes("x")
    assert time.monotonic() - started < 2
