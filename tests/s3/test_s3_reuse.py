"""A persist to S3 sends what changed: the ranges of an item equal to its previous
version's object are copied by the server (UploadPartCopy, pinned to that version's ETag),
only the changed parts are uploaded (counted where they land: a relay in front of moto's
server), and every version stays a whole object that torch.load reads, whatever happened
to the older one. S3's parts are at least 5 MiB, so the layout puts what changes together
(an item's small records after its large ones): the rules of the parts are tested alone."""

from __future__ import annotations

import io
import itertools
import logging
import random
from collections.abc import Iterator
from typing import Any

import pytest
import s3server
import torch
from wirecount import CountingRelay

import nebulaml as nm
from nebulaml.storage.s3_parts import MAX_PART_BYTES, MIN_PART_BYTES, Part, lay_out_parts
from nebulaml.storage.store import Store

MiB = 1 << 20
FROZEN_ELEMENTS = 4 << 20  # 16 MiB of float32 per layer: a record the layout counts large
ADAPTER_ELEMENTS = 384 << 10  # 1.5 MiB per layer: the part that trains
LAYERS = 4  # 6 MiB of adapters change per step, each alone under S3's 5 MiB part


@pytest.fixture
def relay(s3_server: s3server.MotoServer) -> Iterator[CountingRelay]:
    server = CountingRelay(s3_server.port)
    yield server
    server.close()


def _through(s3_server: s3server.MotoServer, relay: CountingRelay) -> dict[str, Any]:
    return {**s3_server.options(), "endpoint_url": relay.endpoint}


def _model() -> dict[str, torch.Tensor]:
    """A LoRA-like state, as PEFT orders it: each layer's frozen weight, then its adapter."""
    g = torch.Generator().manual_seed(13)
    model = {}
    for layer in range(LAYERS):
        model[f"l{layer}.base"] = torch.randn(FROZEN_ELEMENTS, generator=g)
        model[f"l{layer}.adapter"] = torch.randn(ADAPTER_ELEMENTS, generator=g)
    return model


def _train(model: dict[str, torch.Tensor]) -> None:
    for layer in range(LAYERS):
        model[f"l{layer}.adapter"].add_(1.0)  # in place, as an optimizer step does


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _load(store: Store, tag: str) -> dict[str, torch.Tensor]:
    loaded = torch.load(io.BytesIO(store.read_bytes(tag, "model")), weights_only=True)
    assert isinstance(loaded, dict)
    return loaded


def _persist_rows(url: str, options: dict[str, Any]) -> list[dict[str, Any]]:
    df = nm.read_history(url, storage_options=options)
    return df[(df["tier"] == "persistent") & (df["status"] == "ok")].to_dict("records")


def _etag(store: Store, tag: str) -> str:
    info = store.fs.info(store.path(tag, "model"))
    return str(info["ETag"])


def test_a_second_persist_sends_what_changed_counted_at_the_server(
    s3_url: str, s3_server: s3server.MotoServer, relay: CountingRelay
) -> None:
    # Catches: a persist that uploads the frozen bases again (the bytes the server
    # receives are the item's size), small changed tensors each dragging a 5 MiB part
    # (records laid out in torch's order: ~3x), parts copied from the wrong offsets (the
    # version does not load bit-identical), and copies not pinned to the version the book
    # recorded (no x-amz-copy-source-if-match naming its ETag).
    options = _through(s3_server, relay)
    nm.init(s3_url, persistent_time_interval=0, num_of_version_in_retention=5,
            storage_options=options)  # fmt: skip
    model = _model()
    nm.Checkpoint("global_step1").save("model", model)
    assert nm.flush_persistence()
    first_at, first_heads = relay.sent, len(relay.heads)
    _train(model)
    nm.Checkpoint("global_step2").save("model", model)
    assert nm.flush_persistence()
    sent = relay.sent - first_at
    heads = relay.heads[first_heads:]
    nm.shutdown()
    changed = LAYERS * ADAPTER_ELEMENTS * 4
    print(f"second persist: the server received {sent} bytes for {changed} changed "
          f"({sent / changed:.3f}x)")  # fmt: skip
    assert changed >= MIN_PART_BYTES and sent <= 1.3 * changed
    store = Store(s3_url, s3_server.options())
    copies = [h for h in heads if "x-amz-copy-source-range" in h.lower()]
    assert copies, "no part was copied by the server"
    base = _etag(store, "global_step1")
    pins = [line for h in copies for line in h.split("\r\n")
            if line.lower().startswith("x-amz-copy-source-if-match:")]  # fmt: skip
    assert len(pins) == len(copies) and all(p.split(":", 1)[1].strip() == base for p in pins)
    rows = _persist_rows(s3_url, options)
    assert [r["tag"] for r in rows] == ["global_step1", "global_step2"]
    assert rows[1]["bytes_reused"] >= LAYERS * FROZEN_ELEMENTS * 4
    assert rows[1]["bytes_written"] + rows[1]["bytes_reused"] == rows[1]["size_bytes"]
    assert _same(_load(store, "global_step2"), model)
    with nm.using_storage_options(s3_server.options()):
        assert _same(nm.get_checkpoint("global_step2", s3_url).load("model"), model)
        report = nm.verify_checkpoints(s3_url)
    assert [r["status"] for r in report] == ["ok", "ok"], report


def test_a_previous_version_rewritten_since_is_never_copied_from(
    s3_url: str,
    s3_server: s3server.MotoServer,
    relay: CountingRelay,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Catches: parts copied from an object that is no longer the one this process wrote
    # (a byte of its frozen base rewritten under its still-valid manifest): moto ignores
    # the copy's own condition, so without the version asked first the new version would
    # carry that byte and fail to load bit-identical. The persist uploads the item
    # instead, says so in a debug line, and counts it.
    options = _through(s3_server, relay)
    nm.init(s3_url, persistent_time_interval=0, num_of_version_in_retention=5,
            storage_options=options)  # fmt: skip
    model = _model()
    nm.Checkpoint("global_step1").save("model", model)
    assert nm.flush_persistence()
    direct = Store(s3_url, s3_server.options())
    data = bytearray(direct.read_bytes("global_step1", "model"))
    data[len(data) // 3] ^= 0xFF  # inside a frozen base
    with direct.open_write("global_step1", "model") as f:
        f.write(bytes(data))
    _train(model)
    caplog.set_level(logging.DEBUG, logger="nebulaml")
    nm.Checkpoint("global_step2").save("model", model)
    assert nm.flush_persistence()
    nm.shutdown()
    assert "could not be copied from the previous version" in caplog.text
    last = _persist_rows(s3_url, options)[-1]
    assert last["tag"] == "global_step2" and last["bytes_reused"] == 0
    assert last["bytes_written"] == last["size_bytes"]
    assert _same(_load(direct, "global_step2"), model)


def test_a_failed_write_aborts_its_upload_and_leaves_no_object(
    s3_url: str, s3_server: s3server.MotoServer
) -> None:
    # Catches: a write by ranges that fails midway leaving its multipart upload open (its
    # parts kept, and billed, on the server) or an object committed from what was sent.
    store = Store(s3_url, {**s3_server.options(), "nebula_retries": 0})
    store.make_dir()
    size = 24 * MiB + 5
    old = bytearray(random.Random(3).randbytes(size))
    first = store.write_ranges(("t1", "item"), memoryview(old), [(0, size, False)], None)
    new = bytearray(old)
    new[12 * MiB : 13 * MiB] = bytes(MiB)
    ranges = [(0, 12 * MiB, True), (12 * MiB, MiB, False), (13 * MiB, size - 13 * MiB, True)]

    def fail(_n: int) -> None:
        raise RuntimeError("the write failed after its first part")

    with pytest.raises(Exception, match="after its first part"):
        store.write_ranges(("t2", "item"), memoryview(new), ranges, ("t1", "item"), fail,
                           base_stamp=first.stamp)  # fmt: skip
    assert store.list_files("t2") == {}
    bucket, key = store.path("t2", "item").split("/", 1)
    uploads = store.fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=key)
    assert uploads.get("Uploads", []) == []
    # The same write, not failing, gives the whole object from a copy and an upload.
    done = store.write_ranges(("t2", "item"), memoryview(new), ranges, ("t1", "item"),
                              base_stamp=first.stamp)  # fmt: skip
    assert store.read_bytes("t2", "item") == bytes(new)
    assert done.reused >= size - 6 * MiB and done.written + done.reused == size
    assert done.stamp == store.fs.info(store.path("t2", "item"))["ETag"]


def _check_parts(ranges: list[tuple[int, int, bool]], parts: list[Part], **limits: int) -> None:
    """S3's rules and the caller's ranges: the parts cover the file once, in order; every
    part but the last is at least the minimum, none over 5 GiB, no more parts
    than allowed; a copied byte is an equal one."""
    size = sum(n for _, n, _ in ranges)
    assert parts[0].offset == 0 and sum(p.length for p in parts) == size
    assert all(a.offset + a.length == b.offset for a, b in itertools.pairwise(parts))
    assert all(p.length >= limits.get("min_bytes", MIN_PART_BYTES) for p in parts[:-1])
    assert all(p.length <= MAX_PART_BYTES for p in parts)
    assert len(parts) <= limits.get("max_parts", 10_000)
    equal: list[list[int]] = []  # the equal runs, neighbours joined
    for o, n, e in ranges:
        if e and equal and equal[-1][1] == o:
            equal[-1][1] = o + n
        elif e:
            equal.append([o, o + n])
    for p in parts:
        if p.copy:
            assert any(lo <= p.offset and p.offset + p.length <= hi for lo, hi in equal), p


@pytest.mark.parametrize("seed", range(12))
def test_parts_follow_s3s_rules_whatever_the_ranges(seed: int) -> None:
    # Catches: a part under 5 MiB that is not the last (S3 refuses to complete the
    # upload), a copy over the server's limit, bytes skipped or sent twice, a changed
    # byte copied from the previous version, or more parts than an upload may have.
    rng = random.Random(seed)
    block = 16 << 10
    ranges, at = [], 0
    for _ in range(rng.randrange(1, 400)):
        n = block * rng.choice([1, 3, 40, 200, 320, 700, 5000])
        ranges.append((at, n, rng.random() < 0.7))
        at += n
    ranges.append((at, rng.randrange(1, block), rng.random() < 0.5))  # a short last run
    _check_parts(ranges, lay_out_parts(ranges))
    small = {"min_bytes": MiB, "upload_bytes": 2 * MiB, "copy_bytes": 4 * MiB, "max_parts": 20}
    _check_parts(ranges, lay_out_parts(ranges, **small), **small)


def test_a_small_changed_run_costs_one_minimum_part_and_copies_the_rest() -> None:
    # Catches: a layout that uploads all of an item whose change is small (no copy), or
    # one that uploads more than the minimum part around it, or a short unchanged run
    # copied as a part of its own.
    M = MiB
    small = 64 << 10
    parts = lay_out_parts(
        [(0, 100 * M, True), (100 * M, small, False), (100 * M + small, 100 * M, True)]
    )
    uploaded = sum(p.length for p in parts if not p.copy)
    assert uploaded == MIN_PART_BYTES
    # Changed runs 1 MiB apart: the unchanged MiB between them is sent, not a part.
    parts = lay_out_parts([(0, 3 * M, False), (3 * M, M, True), (4 * M, 3 * M, False),
                           (7 * M, 40 * M, True)])  # fmt: skip
    assert [(p.offset, p.copy) for p in parts] == [(0, False), (7 * M, True)]
    # Changed records at the end of the file (the layout's small ones): the last part,
    # as short as they are, even with a short unchanged run after them.
    parts = lay_out_parts([(0, 40 * M, True), (40 * M, 2 * M, False), (42 * M, 4096, True)])
    assert [(p.length, p.copy) for p in parts] == [(40 * M, True), (2 * M + 4096, False)]
