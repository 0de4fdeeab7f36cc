"""S3 as a persistent tier, against a real S3 server (moto's, tests/s3server.py): a
checkpoint commits to s3:// and loads back from it alone, the commit's manifest is
create-only on the server, a root is listed with one paged request, the `nebula` commands
read it, and its credentials are never printed."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import s3server
import torch
from typer.testing import CliRunner

import nebulaml as nm
from nebula_cli.app import app
from nebulaml.protocol.catalog import list_committed
from nebulaml.protocol.commit import begin_tag, commit_rank, write_item
from nebulaml.storage.store import Store


def _state(step: int) -> dict[str, torch.Tensor]:
    return {"w": torch.full((2048,), float(step)), "b": torch.arange(16.0) * step}


def _requests(server: s3server.MotoServer, since: int) -> list[str]:
    """The request lines moto logged after byte `since` of its log."""
    lines = server.log_path.read_bytes()[since:].decode(errors="replace").splitlines()
    return [line.split('"')[1] for line in lines if line.count('"') >= 2]


def test_a_checkpoint_commits_to_s3_and_loads_back_from_it(
    s3_url: str, s3_server: s3server.MotoServer, caplog: pytest.LogCaptureFixture
) -> None:
    # Catches: a persist that never reaches s3:// (the memory tier answering every load),
    # or a manifest published where the listing does not find it.
    caplog.set_level(logging.DEBUG)
    options = s3_server.options()
    nm.init(s3_url, storage_options=options, persistent_time_interval=0)
    for step in (1, 2):
        ckpt = nm.Checkpoint(f"global_step{step}", 1)
        ckpt.save("model", _state(step))
        assert nm.flush_persistence()  # each persisted (a newer commit supersedes one queued)
    nm.shutdown()  # the memory tier released: only s3:// holds them now
    store = Store(s3_url, options)
    assert sorted(store.list_dirs()) == ["global_step1", "global_step2"]
    assert "manifest.json" in store.list_files("global_step2")
    with nm.using_storage_options(options):
        listed = nm.list_checkpoints(s3_url)
        assert [c["tiers"] for c in listed] == [["persistent"], ["persistent"]]
        latest = nm.get_latest_checkpoint(s3_url)
        assert latest is not None and latest.tag == "global_step2"
        loaded = latest.load("model")
    for name, tensor in _state(2).items():
        assert torch.equal(loaded[name], tensor)
    assert s3server.SECRET not in caplog.text


def test_a_root_is_listed_with_one_paged_request(
    s3_url: str, s3_server: s3server.MotoServer
) -> None:
    # Catches: a listing that asks the server for each tag folder in turn (a request per
    # checkpoint), or one that reads every manifest again although none changed.
    store = Store(s3_url, s3_server.options())
    store.make_dir()
    tags = [f"global_step{n}" for n in range(1, 13)]
    for tag in tags:
        begin_tag(store, tag, rank=0, overwrite=False)
        items = [write_item(store, tag, "model", {"w": torch.ones(2)}, rank=0)]
        commit_rank(store, tag, rank=0, world_size=1, items=items, created_at="t")
    first = list_committed(store)
    since = s3_server.log_path.stat().st_size
    again = list_committed(store)
    assert [i.tag for i in again] == [i.tag for i in first] == tags
    requests = _requests(s3_server, since)
    lists = [r for r in requests if "list-type=2" in r]
    assert len(lists) == 1 and len(requests) == 1, requests


def test_nebula_ls_and_verify_on_an_s3_root(
    s3_url: str, s3_server: s3server.MotoServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Catches: a command that cannot open an s3:// root with --storage-option, a verify
    # that passes a damaged item, or a secret in a command's output.
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    nm.init(s3_url, storage_options=s3_server.options(), persistent_time_interval=0)
    nm.Checkpoint("global_step3", 1).save("model", _state(3))
    assert nm.flush_persistence()
    nm.shutdown()
    opts = s3_server.cli_options()
    runner = CliRunner()
    ls = runner.invoke(app, ["ls", s3_url, "--json", *opts])
    assert ls.exit_code == 0, ls.output
    assert [c["tag"] for c in json.loads(ls.stdout)["checkpoints"]] == ["global_step3"]
    ok = runner.invoke(app, ["verify", s3_url, *opts])
    assert ok.exit_code == 0, ok.output
    inspected = runner.invoke(app, ["inspect", s3_url, "global_step3", "--json", *opts])
    assert inspected.exit_code == 0, inspected.output
    assert "model" in inspected.stdout
    # The history's rows are objects of their own on S3 (appends): read back in one table.
    history = runner.invoke(app, ["history", s3_url, "--csv", *opts])
    assert history.exit_code == 0, history.output
    rows = [line for line in history.stdout.splitlines() if "global_step3" in line]
    assert any(",persistent," in r and ",ok," in r for r in rows), history.stdout
    # One byte of the item changed on the server: verify fails, naming the file.
    store = Store(s3_url, s3_server.options())
    item = next(n for n in store.list_files("global_step3") if n.startswith("model"))
    data = bytearray(store.read_bytes("global_step3", item))
    data[-100] ^= 0xFF
    store.write_bytes(("global_step3", item), bytes(data))
    bad = runner.invoke(app, ["verify", s3_url, *opts])
    assert bad.exit_code == 1 and item in bad.output, bad.output
    for result in (ls, ok, inspected, history, bad):
        assert s3server.SECRET not in result.output


def test_credentials_in_an_error_are_masked(
    s3_server: s3server.MotoServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Catches: a secret shown by an error message: the option's, and the AWS chain's from
    # the environment (here pasted into a root's path, where a message names it).
    from_env = "env-secret-9c1d"
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", from_env)
    store = Store(f"s3://nebula-tests/{s3server.SECRET}/{from_env}", s3_server.options())
    with pytest.raises(nm.StorageError) as caught:
        store.read_bytes("missing")
    assert "s3://nebula-tests/***/***/missing" in str(caught.value)
    assert s3server.SECRET not in str(caught.value) and from_env not in str(caught.value)
    # The AWS chain alone (the environment's key, only the endpoint given) reaches it too.
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "env-key")
    chained = Store("s3://nebula-tests/chain", {"endpoint_url": s3_server.endpoint})
    chained.write_bytes(("t", "a"), b"1")
    assert chained.list_files("t") == {"a": 1}


def test_s3_failures_that_may_pass_are_retried_and_others_are_not() -> None:
    # Catches: a 503 SlowDown or a dropped connection to S3 failing a persist at once, or
    # an AccessDenied retried for minutes.
    import botocore.exceptions as boto

    from nebulaml.storage.retry import is_transient

    def answer(code: str, status: int) -> boto.ClientError:
        return boto.ClientError(
            {"Error": {"Code": code}, "ResponseMetadata": {"HTTPStatusCode": status}}, "PutObject"
        )

    wrapped = OSError(5, "as s3fs says it")
    wrapped.__cause__ = answer("SlowDown", 503)
    assert is_transient(wrapped) and is_transient(answer("InternalError", 500))
    assert is_transient(boto.EndpointConnectionError(endpoint_url="http://127.0.0.1:9"))
    assert not is_transient(answer("AccessDenied", 403))


def test_nebula_copy_to_s3_and_prune_there(
    s3_url: str, s3_server: s3server.MotoServer, root: Path
) -> None:
    # Catches: a copy between a local root and an s3:// one that commits nothing there,
    # or a prune that cannot delete on S3 (or deletes the newest).
    nm.init(str(root), persistent_time_interval=0)
    for step in (1, 2):
        nm.Checkpoint(f"global_step{step}", 1).save("model", _state(step))
        assert nm.flush_persistence()
    nm.shutdown()
    opts, runner = s3_server.cli_options(), CliRunner()
    for tag in ("global_step1", "global_step2"):
        done = runner.invoke(app, ["copy", str(root), tag, s3_url, *opts])
        assert done.exit_code == 0, done.output
    pruned = runner.invoke(app, ["prune", s3_url, "--keep", "1", "--yes", *opts])
    assert pruned.exit_code == 0, pruned.output
    store = Store(s3_url, s3_server.options())
    assert store.list_dirs() == ["global_step2"]
    with nm.using_storage_options(s3_server.options()):
        loaded = nm.get_checkpoint("global_step2", s3_url).load("model")
    assert torch.equal(loaded["w"], _state(2)["w"])


def test_an_abandoned_upload_never_commits_an_object(
    s3_url: str, s3_server: s3server.MotoServer
) -> None:
    # Catches: a failed write's object committed (a truncated item, however briefly) and
    # removed after: the writer closed instead of discarded.
    store = Store(s3_url, s3_server.options())
    store.make_dir()
    since = s3_server.log_path.stat().st_size
    with pytest.raises(RuntimeError), store.open_write("t", "item") as f:
        f.write(b"x" * (1 << 20))
        raise RuntimeError("the caller failed mid-write")
    key = s3_url.split("/", 3)[3] + "/t/item"
    assert not [
        r for r in _requests(s3_server, since) if key in r and r.startswith(("PUT", "POST"))
    ]
    assert store.list_files("t") == {}


def test_a_dropped_handle_never_stalls_the_stores_event_loop(
    s3_url: str, s3_server: s3server.MotoServer
) -> None:
    # Catches: a handle's holds released by the collector on the thread it interrupted,
    # here fsspec's event loop: the removal waited there for the loop itself, and every
    # request of the process stalled until the call's deadline (30 s).
    import gc
    import time

    from fsspec.asyn import sync

    options = s3_server.options()
    nm.init(s3_url, storage_options=options, persistent_time_interval=0)
    nm.Checkpoint("global_step1", 1).save("model", _state(1))
    assert nm.flush_persistence()
    nm.shutdown()
    store = Store(s3_url, options)
    with nm.using_storage_options(options):
        handle = nm.get_latest_checkpoint(s3_url)
    assert handle is not None
    assert [n for n in store.list_files("global_step1") if n.startswith(".lease")]
    handle._cycle = handle  # type: ignore[attr-defined]  # only the collector frees it
    del handle

    async def collect() -> None:
        gc.collect()  # on the loop's thread, as the collector may run anywhere

    started = time.monotonic()
    sync(store.fs.loop, collect)
    assert store.list_files("global_step1") and time.monotonic() - started < 5
    while [n for n in store.list_files("global_step1") if n.startswith(".lease")]:
        assert time.monotonic() - started < 10, "the dropped handle's hold was never removed"
        time.sleep(0.05)
