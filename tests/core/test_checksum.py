"""Item checksums: the piece-wise xxh3 (`xxh3_64_tree_1m`) every fill, write, copy, load
and verify computes the same way, and the plain xxh3 of older checkpoints still verifying."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch
import xxhash

import nebulaml as nm
from nebulaml.format import checksum
from nebulaml.format.checksum import (
    CHECKSUM_ALGO,
    LEAF_BYTES,
    LEGACY_CHECKSUM_ALGO,
    TreeHasher,
    checksum_of,
    hash_stream,
    new_hasher,
)
from nebulaml.format.manifest import seal
from nebulaml.runtime.slots import SlotPool
from nebulaml.runtime.snapshot import fill, plan_layout
from nebulaml.storage.store import Store

FIXTURE_V1 = Path(__file__).parents[1] / "fixtures" / "manifests" / "v1"
SIZES = [0, 1, LEAF_BYTES - 1, LEAF_BYTES, LEAF_BYTES + 1, 3 * LEAF_BYTES + 12_345]


def _by_definition(data: bytes) -> str:
    """The algorithm as the format defines it, written here without nebula's code: xxh3-64
    of the concatenated big-endian xxh3-64 digests of the 1 MiB pieces, in order."""
    pieces = [data[i : i + (1 << 20)] for i in range(0, len(data), 1 << 20)]
    return xxhash.xxh3_64(b"".join(xxhash.xxh3_64(p).digest() for p in pieces)).hexdigest()


@pytest.mark.parametrize("size", SIZES)
def test_every_way_of_hashing_gives_the_defined_checksum(size: int) -> None:
    # Catches: a piece boundary off by one, a short last piece dropped or padded, pieces
    # hashed by threads put back in the wrong order, a stream split that changes the digest.
    data = random.Random(size).randbytes(size)
    want = _by_definition(data)
    for workers in (1, 2, 3):
        assert checksum_of(data, workers=workers) == want
    hasher = TreeHasher()
    rng, pos = random.Random(7), 0
    while pos < size:  # odd chunks, some across a piece boundary, some whole pieces
        n = rng.choice([1, 4095, LEAF_BYTES, LEAF_BYTES + 3, 2 * LEAF_BYTES])
        hasher.update(memoryview(data)[pos : pos + n])
        pos += n
    assert hasher.hexdigest() == want
    assert hasher.hexdigest() == want  # reading the digest does not change the state
    assert CHECKSUM_ALGO == "xxh3_64_tree_1m"
    assert checksum_of(data, LEGACY_CHECKSUM_ALGO) == xxhash.xxh3_64(data).hexdigest()


def test_a_digest_depends_on_every_piece_and_its_place() -> None:
    # Catches: a tree that skips pieces, or whose top hash ignores their order.
    a, b = b"a" * LEAF_BYTES, b"b" * LEAF_BYTES
    digests = {checksum_of(x) for x in (a + b, b + a, a + a, a + b + a, a + b[:-1])}
    assert len(digests) == 5


def test_an_unknown_algorithm_is_refused() -> None:
    with pytest.raises(nm.InvalidArgumentError, match="does not know \\('sha1'\\)"):
        new_hasher("sha1")


@pytest.mark.parametrize("workers", [1, 2, 3])
def test_a_fill_across_many_pieces_hashes_what_it_wrote(tmp_path: Path, workers: int) -> None:
    # Real 1 MiB pieces; storages of odd sizes start and end inside pieces, and one spans
    # several. Catches: a copy clipped at a piece boundary, a piece hashed before its last
    # part is copied, or by two workers at once.
    torch.manual_seed(3)
    state = {
        "a": torch.randn(100_003),
        "b": torch.randn(3, 500_001),
        "c": torch.arange(77, dtype=torch.int16),
        "d": torch.randn(262_144),
    }
    layout = plan_layout(state)
    assert layout is not None and layout.size_bytes > 7 * LEAF_BYTES
    pool = SlotPool(Store(tmp_path, durable=False))
    mapped = pool.open_item(".", "item", layout.size_bytes)
    digest = fill(mapped.tensor, mapped.view, layout, workers=workers)
    pool.close()
    data = (tmp_path / "item").read_bytes()
    assert digest == _by_definition(data)
    loaded = torch.load(tmp_path / "item", weights_only=True)
    assert all(torch.equal(loaded[k], state[k]) for k in state)


def test_saved_items_carry_the_piece_checksum_on_every_tier(root: Path) -> None:
    nm.init(str(root), persistent_time_interval=0)
    ckpt = nm.Checkpoint("global_step1", 1)
    ckpt.save("model", {"w": torch.randn(600_000)})  # 2.4 MB: three pieces
    nm.flush_persistence()
    for base in (root, Path(nm.memory_tier_path(str(root)))):
        manifest = json.loads((base / "global_step1" / "manifest.json").read_text())
        (item,) = manifest["items"]
        data = (base / "global_step1" / "model").read_bytes()
        assert item["checksum"] == {"algo": CHECKSUM_ALGO, "value": _by_definition(data)}
        assert manifest["checksum"]["algo"] == "xxh3_64"  # the seal is unchanged
    with (root / "global_step1" / "model").open("rb") as f:
        assert hash_stream(f, 4099)[1] == item["checksum"]["value"]


def test_checkpoints_with_plain_xxh3_still_verify_load_and_copy(tmp_path: Path) -> None:
    # The released v1 fixture was written with plain xxh3. Catches: a reader that hashes
    # every item with the new algorithm (all of them would look corrupt).
    root, dest = tmp_path / "root", tmp_path / "copy"
    shutil.copytree(FIXTURE_V1, root)
    results = nm.verify_checkpoints(str(root))
    assert {r["status"] for r in results} == {"ok"} and len(results) == 2
    assert all(f"with {LEGACY_CHECKSUM_ALGO} " in r["actual"] for r in results)
    report = nm.copy_checkpoint(str(root), "global_step500", str(dest))
    assert report["tag"] == "global_step500"
    copied = json.loads((dest / "global_step500" / "manifest.json").read_text())
    assert {i["checksum"]["algo"] for i in copied["items"]} == {LEGACY_CHECKSUM_ALGO}
    assert {r["status"] for r in nm.verify_checkpoints(str(dest))} == {"ok"}
    model = nm.get_checkpoint("global_step500", persist_path=str(dest)).load("model")
    assert torch.equal(model["w"], torch.arange(6.0).reshape(2, 3))
    # ... and a flipped byte is still found with the plain xxh3.
    path = dest / "global_step500" / "model"
    data = bytearray(path.read_bytes())
    data[-30] ^= 0xFF
    path.write_bytes(bytes(data))
    (bad,) = [r for r in nm.verify_checkpoints(str(dest)) if r["status"] != "ok"]
    assert bad["item"] == "model" and bad["status"] == "corrupt"
    with pytest.raises(nm.CorruptCheckpointError, match=f"with {LEGACY_CHECKSUM_ALGO} "):
        nm.get_checkpoint("global_step500", persist_path=str(dest)).load("model")


def test_an_item_with_an_unknown_algorithm_is_not_loaded(tmp_path: Path) -> None:
    # A checkpoint from a newer nebula: refused by name, never unpickled unchecked.
    root = tmp_path / "root"
    shutil.copytree(FIXTURE_V1, root)
    path = root / "global_step500" / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["items"][0]["checksum"]["algo"] = "blake9"
    path.write_bytes(seal({k: v for k, v in manifest.items() if k != "checksum"}))
    handle = nm.get_checkpoint("global_step500", persist_path=str(root))
    with pytest.raises(nm.CorruptCheckpointError, match="does not know \\('blake9'\\)"):
        handle.load("model")
    assert handle.load("optimizer") == {"step": 500, "lr": 0.001}
    (bad,) = [r for r in nm.verify_checkpoints(str(root)) if r["status"] != "ok"]
    assert "does not know ('blake9')" in bad["actual"]


def test_leaf_size_is_the_one_the_algorithm_names() -> None:
    assert checksum.LEAF_BYTES == 1 << 20
