"""`nebula diff` and `nebula export` on checkpoints written by the library: every status of
a tensor, the differences computed here by hand, and exports read back by safetensors and
by `torch.load(weights_only=True)`."""

from __future__ import annotations

import contextlib
import json
import math
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from cli_helpers import in_a_pipe

import nebulaml as nm

A, B = "global_step100", "global_step200"


def _models() -> tuple[dict, dict]:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(300, 300, generator=g)  # 90k elements: several chunks when shrunk below
    w2 = w.clone()
    w2[0, 0] += 0.5
    w2[299, 299] -= 2.0
    a = {"w": w, "same": torch.ones(7), "emb": torch.ones(10, 4), "ids": torch.arange(5),
         "gone": torch.ones(2), "half": torch.ones(4, dtype=torch.bfloat16),
         "nan": torch.tensor([float("nan"), 1.0]), "counts": torch.tensor([1, 2, 3])}  # fmt: skip
    b = {"w": w2, "same": torch.ones(7), "emb": torch.ones(12, 4), "ids": torch.arange(5).int(),
         "new": torch.ones(3), "half": torch.ones(4, dtype=torch.bfloat16) * 2,
         "nan": torch.tensor([float("nan"), 1.0]), "counts": torch.tensor([1, 5, 3])}  # fmt: skip
    return a, b


@pytest.fixture
def two(root: Path) -> tuple[Path, dict, dict]:
    a, b = _models()
    nm.init(str(root), persistent_time_interval=0)
    for tag, model, lr in ((A, a, 0.1), (B, b, 0.05)):
        ckpt = nm.Checkpoint(tag, 3)
        ckpt.save("model", model)
        ckpt.save("optimizer", {"lr": lr, "state": {0: {"exp_avg": torch.zeros(3)}}})
        ckpt.save("frozen", {"t": torch.arange(6.0)})  # the same bytes in both
        nm.flush_persistence()
    return root, a, b


def test_diff_json_every_status_and_the_numbers(two, monkeypatch) -> None:
    # Catches: a wrong status, differences computed over the wrong elements, NaN == NaN
    # reported as changed, chunking that loses a chunk's maximum.
    from nebulaml.ops import diff as diff_module

    monkeypatch.setattr(diff_module, "_CHUNK_ELEMENTS", 1000)
    root, a, b = two
    run = in_a_pipe("diff", str(root), A, B, "--json")
    assert run.code == 1 and run.stderr == ""  # they differ
    doc = json.loads(run.stdout)
    assert (doc["tag_a"], doc["tag_b"]) == (A, B)
    items = {i["item"]: i for i in doc["items"]}
    assert items["frozen"] == {"item": "frozen", "status": "identical", "entries": []}
    entries = {e["path"]: e for e in items["model"]["entries"]}
    status = {path: e["status"] for path, e in entries.items()}
    assert status == {"w": "changed", "same": "identical", "emb": "shape_changed",
                      "ids": "dtype_changed", "gone": "removed", "half": "changed",
                      "nan": "identical", "counts": "changed", "new": "added"}  # fmt: skip
    w = entries["w"]
    delta = (b["w"].double() - a["w"].double()).reshape(-1)
    assert w["changed_elements"] == 2 and w["max_abs_diff"] == pytest.approx(2.0, rel=1e-6)
    expected_rel = float(delta.norm() / a["w"].double().norm())
    assert w["rel_l2_diff"] == pytest.approx(expected_rel, rel=1e-9)
    assert (w["dtype_a"], w["shape_a"]) == ("float32", [300, 300])
    assert entries["half"]["max_abs_diff"] == 1.0 and entries["half"]["rel_l2_diff"] == 1.0
    assert entries["counts"]["changed_elements"] == 1
    assert entries["counts"]["max_abs_diff"] is None  # not a floating tensor
    assert (entries["emb"]["shape_a"], entries["emb"]["shape_b"]) == ([10, 4], [12, 4])
    assert (entries["ids"]["dtype_a"], entries["ids"]["dtype_b"]) == ("int64", "int32")
    optimizer = {e["path"]: e for e in items["optimizer"]["entries"]}
    # main: "0.1" and "0.05", strings a script had to parse back.
    assert optimizer["lr"]["status"] == "changed"
    assert (optimizer["lr"]["value_a"], optimizer["lr"]["value_b"]) == (0.1, 0.05)
    assert optimizer["state.0.exp_avg"]["status"] == "identical"
    assert doc["summary"]["items"] == 3 and doc["summary"]["items_changed"] == 2
    assert not math.isnan(doc["summary"]["changed"])


def test_diff_table_lists_what_differs(two) -> None:
    root, _, _ = two
    run = in_a_pipe("diff", str(root), A, B)
    assert run.code == 1 and run.stderr == ""
    lines = run.stdout.splitlines()
    assert lines[0] == f"{root}: {A} -> {B}"
    rows = {tuple(line.split()[:3]) for line in lines[2:]}
    assert ("model", "w", "changed") in rows and ("model", "gone", "removed") in rows
    assert not any(line.split()[1:2] == ["same"] for line in lines[2:])  # identical: --all
    assert "0.05" in run.stdout and "[10, 4] -> [12, 4]" in run.stdout
    assert "int64 -> int32" in run.stdout
    assert lines[-1].startswith("2 of 3 item(s) differ;")
    everything = in_a_pipe("diff", str(root), A, B, "--all").stdout
    assert "identical (same bytes)" in everything and " same " in everything


def test_diff_exits_1_when_they_differ_0_when_the_same(two) -> None:
    # main: exit 0 either way, so `nebula diff ... && deploy` could not tell (diff and
    # git diff --exit-code exit 1 when there is a difference).
    root, _, _ = two
    assert in_a_pipe("diff", str(root), A, B, "--item", "frozen").code == 0  # same bytes
    assert in_a_pipe("diff", str(root), A, A, "--json").code == 0
    assert in_a_pipe("diff", str(root), A, B, "--item", "model", "--json").code == 1
    assert in_a_pipe("diff", str(root), A, "global_step9").code == 3  # an error's own


def test_diff_json_values_are_json_values(root: Path) -> None:
    # main: every value was its repr, a string ("3", "True", "'adam'").
    nm.init(str(root), persistent_time_interval=0)
    values = {"step": 3, "lr": 0.1, "amsgrad": True, "name": "adam", "none": None,
              "inf": float("inf"), "long": "x" * 100}  # fmt: skip
    for tag, step in ((A, 3), (B, 4)):
        nm.Checkpoint(tag).save("state", {**values, "step": step})
        nm.flush_persistence()
    run = in_a_pipe("diff", str(root), A, B, "--all", "--json")
    assert run.code == 1, run.stderr
    entries = {e["path"]: e for e in json.loads(run.stdout)["items"][0]["entries"]}
    got = {path: (e["value_a"], e["status"]) for path, e in entries.items()}
    assert got == {"step": (3, "changed"), "lr": (0.1, "identical"),
                   "amsgrad": (True, "identical"), "name": ("adam", "identical"),
                   "none": (None, "identical"), "inf": ("inf", "identical"),
                   "long": ("x" * 57 + "...", "identical")}  # fmt: skip
    assert entries["step"]["value_b"] == 4
    table = in_a_pipe("diff", str(root), A, B, "--all").stdout
    rows = {line.split()[1]: line.split()[2:] for line in table.splitlines()[2:-1]}
    assert rows["step"] == ["changed", "3", "->", "4"] and rows["name"] == ["identical", "adam"]
    assert rows["none"] == ["identical", "None"] and rows["amsgrad"] == ["identical", "True"]


def test_diff_one_item_and_errors(two) -> None:
    root, _, _ = two
    run = in_a_pipe("diff", str(root), A, B, "--item", "optimizer", "--json")
    assert [i["item"] for i in json.loads(run.stdout)["items"]] == ["optimizer"]
    missing = in_a_pipe("diff", str(root), A, B, "--item", "modl")
    assert missing.code == 3 and "did you mean 'model'?" in missing.stderr
    assert in_a_pipe("diff", str(root), A, "global_step9").code == 3


def test_diff_reads_only_what_differs(two, monkeypatch) -> None:
    # Catches: loading items whose committed bytes are the same in both checkpoints.
    from nebulaml.ops import diff as diff_module

    loaded = []
    real = diff_module.load_item
    monkeypatch.setattr(
        diff_module, "load_item", lambda *a, **k: loaded.append(a[2]) or real(*a, **k)
    )
    root, _, _ = two
    nm.diff_checkpoints(str(root), A, B)
    assert sorted(set(loaded)) == ["model", "optimizer"]


def test_export_pt_reads_back_with_weights_only(two, tmp_path: Path) -> None:
    root, _, b = two
    dest = tmp_path / "out"
    run = in_a_pipe("export", str(root), B, str(dest), "--json")
    assert run.code == 0, run.stderr
    doc = json.loads(run.stdout)
    assert sorted(f["item"] for f in doc["files"]) == ["frozen", "model", "optimizer"]
    model = torch.load(dest / "model.pt", weights_only=True)
    assert torch.equal(model["w"], b["w"]) and model["ids"].dtype == torch.int32
    assert (dest / "model.pt").read_bytes() == (root / B / "model").read_bytes()  # as committed
    again = json.loads(in_a_pipe("export", str(root), B, str(dest), "--json").stdout)
    assert all(f["reused"] for f in again["files"])  # a rerun copies nothing
    other = in_a_pipe("export", str(root), A, str(dest))
    assert other.code == 1 and "already exists" in other.stderr and "--overwrite" in other.stderr
    assert in_a_pipe("export", str(root), A, str(dest), "--overwrite").code == 0
    assert torch.load(dest / "model.pt", weights_only=True)["emb"].shape == (10, 4)


def test_export_safetensors_refuses_values_unless_dropped(two, tmp_path: Path) -> None:
    from safetensors import safe_open
    from safetensors.torch import load_file

    root, _, b = two
    dest = tmp_path / "st"
    refused = in_a_pipe("export", str(root), B, str(dest), "--format", "safetensors")
    assert refused.code == 2 and "holds values that are not tensors (lr)" in refused.stderr
    assert "--drop-non-tensors" in refused.stderr
    assert not dest.exists() or not any(dest.iterdir())  # refused before writing anything
    run = in_a_pipe("export", str(root), B, str(dest), "-f", "safetensors", "--drop-non-tensors",
                    "--json")  # fmt: skip
    assert run.code == 0, run.stderr
    files = {f["item"]: f for f in json.loads(run.stdout)["files"]}
    assert files["optimizer"]["dropped"] == ["lr"] and files["optimizer"]["tensors"] == 1
    tensors = load_file(dest / "model.safetensors")
    assert set(tensors) == set(b)
    for name, tensor in b.items():
        assert torch.equal(tensors[name], tensor) or torch.equal(tensors[name].isnan(),
                                                                   tensor.isnan())  # fmt: skip
    assert list(load_file(dest / "optimizer.safetensors")) == ["state.0.exp_avg"]
    with safe_open(str(dest / "model.safetensors"), framework="pt") as f:
        meta = f.metadata()
    assert meta["nebula_tag"] == B and meta["nebula_item"] == "model"
    again = json.loads(
        in_a_pipe(
            "export", str(root), B, str(dest), "-f", "safetensors", "--drop-non-tensors", "--json"
        ).stdout
    )
    assert all(f["reused"] for f in again["files"])


@contextlib.contextmanager
def _umask(mask: int) -> Iterator[None]:
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def _modes(folder: Path) -> dict[str, int]:
    return {p.name: p.stat().st_mode & 0o777 for p in folder.iterdir()}


@pytest.mark.parametrize("form", ["pt", "safetensors"])
def test_exported_files_follow_the_umask_unless_private(
    two, tmp_path: Path, form: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # main: `-f safetensors` files were 0600 (safetensors' own mode) while everything else
    # followed the umask: a serving process of another user could not read the model.
    root, _, _ = two
    args = ["-f", form, "--drop-non-tensors"]
    with _umask(0o027):
        shared = in_a_pipe("export", str(root), B, str(tmp_path / "shared"), *args)
        monkeypatch.setenv("NEBULA_PRIVATE", "1")
        private = in_a_pipe("export", str(root), B, str(tmp_path / "private"), *args)
    assert shared.code == 0 and private.code == 0, shared.stderr + private.stderr
    names = {f"{item}.{form}" for item in ("model", "optimizer", "frozen")}
    assert _modes(tmp_path / "shared") == dict.fromkeys(names, 0o640)
    assert _modes(tmp_path / "private") == dict.fromkeys(names, 0o600)
    assert (tmp_path / "private").stat().st_mode & 0o777 == 0o700


@pytest.mark.parametrize("form", ["pt", "safetensors"])
def test_private_export_under_umask_zero(
    two, tmp_path: Path, form: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # catches: the folders a private export made above its destination followed the umask
    # (0777 under umask 0): only the destination itself was made 0700.
    root, _, _ = two
    monkeypatch.setenv("NEBULA_PRIVATE", "1")
    with _umask(0):
        run = in_a_pipe("export", str(root), B, str(tmp_path / "a" / "b" / "out"), "-f", form,
                        "--drop-non-tensors")  # fmt: skip
    assert run.code == 0, run.stderr
    for folder in (tmp_path / "a", tmp_path / "a" / "b", tmp_path / "a" / "b" / "out"):
        assert folder.stat().st_mode & 0o777 == 0o700, folder
    names = {f"{item}.{form}" for item in ("model", "optimizer", "frozen")}
    assert _modes(tmp_path / "a" / "b" / "out") == dict.fromkeys(names, 0o600)


def test_export_safetensors_of_tied_weights(root: Path, tmp_path: Path) -> None:
    # Catches: safetensors refusing tensors that share memory (tied embeddings, views).
    from safetensors.torch import load_file

    shared = torch.arange(12.0)
    nm.init(str(root), persistent_time_interval=0)
    nm.Checkpoint("global_step1").save("model", {"emb": shared, "head": shared,
                                                 "view": shared[2:6]})  # fmt: skip
    run = in_a_pipe("export", str(root), "global_step1", str(tmp_path / "o"), "-f", "safetensors")
    assert run.code == 0, run.stderr
    tensors = load_file(tmp_path / "o" / "model.safetensors")
    assert torch.equal(tensors["head"], shared) and torch.equal(tensors["view"], shared[2:6])


def test_export_one_item_and_a_corrupt_copy(two, tmp_path: Path) -> None:
    # Catches: exporting bytes that do not match the manifest.
    root, _, _ = two
    run = in_a_pipe("export", str(root), B, str(tmp_path / "one"), "--item", "frozen")
    assert run.code == 0 and sorted(p.name for p in (tmp_path / "one").iterdir()) == ["frozen.pt"]
    nm.shutdown()  # the memory tier's copies go: only the (now damaged) persistent one is left
    item = root / B / "model"
    data = bytearray(item.read_bytes())
    data[len(data) // 2] ^= 0xFF
    item.write_bytes(bytes(data))
    bad = in_a_pipe("export", str(root), B, str(tmp_path / "bad"), "--item", "model")
    assert bad.code == 1 and "expected" in bad.stderr
    assert not (tmp_path / "bad" / "model.pt").exists()
    assert [p.name for p in (tmp_path / "bad").iterdir()] == []  # no temporary left
