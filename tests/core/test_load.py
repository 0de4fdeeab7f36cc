"""Loading: verified before unpickling, fallback between tiers, no code execution."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import pytest
import torch

import nebulaml as nm
from nebulaml.format.checksum import CHECKSUM_ALGO, checksum_of
from nebulaml.format.manifest import seal
from nebulaml.runtime.session import current

STATE = {"w": torch.arange(64, dtype=torch.float32), "step": 3}


def _save_and_persist(root: Path) -> tuple[Path, Path]:
    nm.init(str(root), persistent_time_interval=0)
    nm.Checkpoint("global_step3").save("model", STATE)
    nm.flush_persistence()
    memory = Path(current("test").tiers.memory.root)
    return memory / "global_step3" / "model", root / "global_step3" / "model"


def _flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x40
    path.write_bytes(bytes(data))


def _assert_state(loaded: dict) -> None:
    assert torch.equal(loaded["w"], STATE["w"]) and loaded["step"] == 3


def test_bit_flip_in_memory_copy_falls_back_to_persistent(root: Path) -> None:
    mem_item, _ = _save_and_persist(root)
    _flip_byte(mem_item, mem_item.stat().st_size // 2)
    _assert_state(nm.get_latest_checkpoint().load("model"))


def test_truncated_memory_copy_falls_back_to_persistent(root: Path) -> None:
    mem_item, _ = _save_and_persist(root)
    mem_item.write_bytes(mem_item.read_bytes()[:100])
    _assert_state(nm.get_checkpoint("global_step3").load("model"))


def test_corruption_on_every_tier_raises_naming_file_expected_actual(root: Path) -> None:
    mem_item, disk_item = _save_and_persist(root)
    handle = nm.get_latest_checkpoint()
    for item in (mem_item, disk_item):
        _flip_byte(item, item.stat().st_size - 30)
    with pytest.raises(nm.CorruptCheckpointError) as err:
        handle.load("model")
    message = str(err.value)
    assert str(mem_item) in message
    manifest = json.loads((root / "global_step3" / "manifest.json").read_text())
    expected = manifest["items"][0]["checksum"]["value"]
    actual = checksum_of(mem_item.read_bytes())
    assert f"expected {mem_item.stat().st_size} bytes with {CHECKSUM_ALGO} {expected}" in message
    assert f"found {mem_item.stat().st_size} bytes with {CHECKSUM_ALGO} {actual}" in message


def test_zeroed_range_is_detected(root: Path) -> None:
    _, disk_item = _save_and_persist(root)
    nm.shutdown()
    data = bytearray(disk_item.read_bytes())
    data[200:264] = bytes(64)
    disk_item.write_bytes(bytes(data))
    handle = nm.get_checkpoint("global_step3", persist_path=str(root))
    # The memory copy is intact and read first; remove it to force the disk copy.
    for path in Path(os.environ["NEBULA_MEMORY_TIER_PATH"]).rglob("model"):
        path.unlink()
    with pytest.raises(nm.CorruptCheckpointError, match="corrupt item"):
        handle.load("model")


class _Canary:
    """A pickle payload that would create a file if it were ever executed."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (Path.touch, (self.path,))


def test_pickle_that_needs_code_execution_is_refused(root: Path, tmp_path: Path) -> None:
    canary = tmp_path / "canary"
    nm.init(str(root), persistent_time_interval=0)
    nm.Checkpoint("global_step1").save("evil", {"state": [1, 2, _Canary(canary)]})
    nm.flush_persistence()
    with pytest.raises(nm.UnsafeCheckpointError) as err:
        nm.get_latest_checkpoint().load("evil")
    assert not canary.exists()
    message = str(err.value)
    assert "weights_only=False" in message and "global_step1" in message
    # Plain torch.load with weights_only=True refuses the same file: the item is honest.
    with pytest.raises(Exception, match="Weights only load failed"):
        torch.load(root / "global_step1" / "evil", weights_only=True)
    assert not canary.exists()
    # Only an explicit opt-in executes it.
    nm.get_latest_checkpoint().load("evil", weights_only=False)
    assert canary.exists()


def test_a_whole_module_pickle_written_by_hand_is_refused(root: Path) -> None:
    # A checkpoint whose item is a pickled nn.Module (what torch.save(model) writes):
    # loading it would import and run class code, so it is refused by default.
    nm.init(str(root), persistent_time_interval=0)
    nm.Checkpoint("global_step1").save("model", {"w": torch.ones(2)})
    nm.flush_persistence()
    nm.shutdown()
    item = root / "global_step1" / "model"
    buf = io.BytesIO()
    torch.save(torch.nn.Linear(2, 2), buf)
    item.write_bytes(buf.getvalue())
    manifest_path = root / "global_step1" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["items"][0]["size_bytes"] = len(buf.getvalue())
    manifest["total_bytes"] = len(buf.getvalue())
    manifest["items"][0]["checksum"]["value"] = checksum_of(buf.getvalue())
    manifest_path.write_bytes(seal(manifest))  # the attacker re-seals the manifest too
    for path in Path(os.environ["NEBULA_MEMORY_TIER_PATH"]).rglob("manifest.json"):
        path.unlink()  # the memory copy would be read first
    handle = nm.get_checkpoint("global_step1", persist_path=str(root))
    with pytest.raises(nm.UnsafeCheckpointError, match="Linear"):
        handle.load("model")


@pytest.mark.parametrize(
    "map_location",
    ["cpu", torch.device("cpu"), lambda storage, loc: storage, {"cpu": "cpu"}],
    ids=["str", "device", "callable", "dict"],
)
def test_map_location_forms(root: Path, map_location: object) -> None:
    _save_and_persist(root)
    _assert_state(nm.get_latest_checkpoint().load("model", map_location=map_location))


def test_missing_tag_on_a_handle(root: Path) -> None:
    _save_and_persist(root)
    handle = nm.get_latest_checkpoint()
    nm.shutdown()
    for base in (root, Path(os.environ["NEBULA_MEMORY_TIER_PATH"])):
        for manifest in base.rglob("manifest.json"):
            manifest.unlink()
    with pytest.raises(nm.CheckpointNotFoundError, match="global_step3"):
        handle.load("model")


def test_unknown_schema_is_an_error_not_a_skip(root: Path) -> None:
    _save_and_persist(root)
    nm.shutdown()
    for base in (root, Path(os.environ["NEBULA_MEMORY_TIER_PATH"])):
        for manifest in base.rglob("manifest.json"):
            doc = json.loads(manifest.read_text())
            doc["schema_version"] = 99
            manifest.write_text(json.dumps(doc))
    with pytest.raises(nm.UnsupportedSchemaError, match="schema_version 99"):
        nm.get_latest_checkpoint(persist_path=str(root))
    with pytest.raises(nm.UnsupportedSchemaError):
        nm.list_checkpoints(str(root))
