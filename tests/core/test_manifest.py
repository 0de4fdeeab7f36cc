"""manifest.json: round trip, strict parsing, and every released schema still reads."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import nebulaml as nm
from nebulaml.format.manifest import ItemEntry, Manifest, Producer, parse_manifest

FIXTURES = Path(__file__).parent.parent / "fixtures" / "manifests"


def _manifest(**overrides) -> Manifest:
    fields = dict(
        tag="global_step5",
        step=5,
        created_at="2026-01-01T00:00:00.000000Z",
        committed_at="2026-01-01T00:00:01.000000Z",
        world_size=1,
        items=(ItemEntry("model", "model", 0, 10, "xxh3_64", "00ff", 8),),
        producer=Producer("0.1.0", "2.13.0", "host"),
        labels=("best",),
    )
    fields.update(overrides)
    return Manifest(**fields)


@pytest.mark.parametrize(
    "edit",
    [
        lambda d: d.update(committed_at=d["committed_at"].replace("1", "2")),
        lambda d: d["producer"].update(host="elsewhere"),
        lambda d: d.update(labels=[]),
        lambda d: d.update(chdcksum=d.pop("checksum")),  # a flipped bit in a key
        lambda d: d.pop("checksum"),
    ],
    ids=["time", "producer", "labels", "renamed-key", "no-checksum"],
)
def test_a_manifest_altered_in_any_field_is_refused(edit) -> None:
    doc = json.loads(_manifest().to_bytes())
    edit(doc)
    with pytest.raises(nm.ManifestError):
        parse_manifest(json.dumps(doc).encode(), "m")


def test_round_trip() -> None:
    manifest = _manifest()
    assert parse_manifest(manifest.to_bytes(), "x") == manifest
    doc = json.loads(manifest.to_bytes())
    assert doc["total_bytes"] == 10 and doc["schema_version"] == 2 and doc["sequence"] == 0
    assert doc["items"][0]["checksum"] == {"algo": "xxh3_64", "value": "00ff"}


def _doc() -> dict:
    return json.loads(_manifest().to_bytes())


def _broken(mutate) -> bytes:
    doc = _doc()
    mutate(doc)
    return json.dumps(doc).encode()


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (b"", "not valid JSON"),
        (b"{truncated", "not valid JSON"),
        (b"\xff\xfe", "not valid JSON"),
        (b"[]", "not a JSON object"),
        (_broken(lambda d: d.pop("items")), "no 'items'"),
        (_broken(lambda d: d.update(total_bytes=11)), "total_bytes"),
        (_broken(lambda d: d.update(world_size=0)), "world_size"),
        (_broken(lambda d: d.update(world_size=True)), "wrong type"),
        (_broken(lambda d: d.update(tag="../up")), "unsafe tag"),
        (_broken(lambda d: d["items"][0].update(file="../../etc/passwd")), "unsafe item"),
        (_broken(lambda d: d["items"][0].update(file="/etc/passwd")), "unsafe item"),
        (_broken(lambda d: d["items"][0].update(size_bytes=-1)), "negative"),
        (_broken(lambda d: d["items"][0].update(size_bytes="10")), "wrong type"),
        (_broken(lambda d: d["items"][0].pop("checksum")), "no 'checksum'"),
        (_broken(lambda d: d["items"].append(dict(d["items"][0]))), "twice"),
        (_broken(lambda d: d.update(labels="best")), "labels"),
        (_broken(lambda d: d.pop("sequence")), "no 'sequence'"),
        (_broken(lambda d: d.update(sequence=-1)), "'sequence' is negative"),
        (_broken(lambda d: d.update(sequence=True)), "wrong type"),
        (_broken(lambda d: d.update(sequence="3")), "wrong type"),
        (_broken(lambda d: d.update(schema_version=1)), "schema 1 manifest has no 'sequence'"),
        (b"[" * 5000 + b"]" * 5000, "nested more than 32 deep"),
    ],
)
def test_malformed_manifests_are_refused(data: bytes, match: str) -> None:
    with pytest.raises(nm.ManifestError, match=match):
        parse_manifest(data, "somewhere/manifest.json")


@pytest.mark.parametrize("version", [3, 99])
def test_newer_schema_version_asks_for_an_upgrade(version: object) -> None:
    data = _broken(lambda d: d.update(schema_version=version))
    with pytest.raises(nm.UnsupportedSchemaError, match="upgrade nebula-checkpoint"):
        parse_manifest(data, "m")


@pytest.mark.parametrize("version", [0, -1, "1", None, True, 1.0])
def test_malformed_schema_version_is_corruption(version: object) -> None:
    # Not "a newer nebula": a damaged manifest, so another tier's copy can be used.
    data = _broken(lambda d: d.update(schema_version=version))
    with pytest.raises(nm.ManifestError, match="no valid schema_version") as err:
        parse_manifest(data, "m")
    assert not isinstance(err.value, nm.UnsupportedSchemaError)


def test_a_newer_schema_on_one_tier_falls_back_to_the_other(root: Path) -> None:
    import os

    nm.init(str(root), persistent_time_interval=0, keep_memory_tier=True)
    nm.Checkpoint("global_step1").save("model", {"w": torch.ones(3)})
    nm.flush_persistence()
    nm.shutdown()
    memory = Path(os.environ["NEBULA_MEMORY_TIER_PATH"])
    (manifest,) = memory.rglob("manifest.json")
    doc = json.loads(manifest.read_text())
    doc["schema_version"] = 3  # a bit flip of the "1", or a damaged copy
    manifest.write_text(json.dumps(doc))
    latest = nm.get_latest_checkpoint(str(root))
    assert latest is not None and torch.equal(latest.load("model")["w"], torch.ones(3))
    # Every tier unreadable: the error, never a silent skip.
    disk = root / "global_step1" / "manifest.json"
    disk.write_text(json.dumps(doc))
    with pytest.raises(nm.UnsupportedSchemaError):
        nm.get_latest_checkpoint(str(root))
    with pytest.raises(nm.UnsupportedSchemaError):
        nm.get_checkpoint("global_step1", str(root))


def test_manifest_has_no_absolute_paths_or_pickles(root: Path) -> None:
    nm.init(str(root), persistent_time_interval=0)
    nm.Checkpoint("global_step1").save("model", {"w": torch.ones(3)})
    nm.flush_persistence()
    text = (root / "global_step1" / "manifest.json").read_text()
    assert str(root) not in text and str(Path.home()) not in text
    doc = json.loads(text)
    assert set(doc) == {
        "schema_version", "tag", "step", "created_at", "committed_at", "world_size",
        "items", "total_bytes", "producer", "labels", "checksum", "sequence",
    }  # fmt: skip
    assert doc["committed_at"] >= doc["created_at"]


def test_a_manifest_too_large_is_refused_unparsed(monkeypatch: pytest.MonkeyPatch) -> None:
    from nebulaml.format import manifest as manifest_module

    data = _manifest().to_bytes()
    monkeypatch.setattr(manifest_module, "MAX_MANIFEST_BYTES", len(data) - 1)
    with pytest.raises(nm.ManifestError, match="manifest is too large"):
        parse_manifest(data, "m")


def test_a_schema_1_manifest_reads_with_no_sequence() -> None:
    manifest = _manifest(schema_version=1)
    doc = json.loads(manifest.to_bytes())
    assert doc["schema_version"] == 1 and "sequence" not in doc
    assert parse_manifest(manifest.to_bytes(), "m").sequence == 0
    newer = parse_manifest(_manifest(sequence=1).to_bytes(), "m")
    assert newer.sort_key > manifest.sort_key  # same tag and time: any sequence is newer


@pytest.mark.parametrize("version_dir", sorted(p.name for p in FIXTURES.iterdir()))
def test_every_released_schema_still_loads(version_dir: str, tmp_path: Path) -> None:
    root = tmp_path / "root"
    shutil.copytree(FIXTURES / version_dir, root)
    for tag_dir in root.iterdir():
        parse_manifest((tag_dir / "manifest.json").read_bytes(), str(tag_dir))
    latest = nm.get_latest_checkpoint(persist_path=str(root))
    assert latest is not None and latest.tag == "global_step500"
    model = latest.load("model")
    assert torch.equal(model["w"], torch.arange(6.0).reshape(2, 3))
    assert torch.equal(model["b"], torch.tensor([1, 2]))
    assert latest.load("optimizer") == {"step": 500, "lr": 0.001}
    assert nm.list_checkpoints(str(root))[0]["labels"] == ["best"]
