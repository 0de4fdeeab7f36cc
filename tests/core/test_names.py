"""Tags and item names are refused before any I/O when they could escape their folder."""

from __future__ import annotations

from pathlib import Path

import pytest

import nebulaml as nm
from nebulaml.format.names import order_key, step_of, validate_name

HOSTILE = [
    "",
    ".",
    "..",
    "../escape",
    "a/../../b",
    "/etc/passwd",
    "a/b",
    "a\\b",
    "nul\x00byte",
    "new\nline",
    "tab\there",
    "del\x7f",
    ".hidden",
    ".rank-0.json",
    "x" * 256,
    "é" * 128,  # 256 bytes in UTF-8
    " padded",
    "padded ",
]


@pytest.mark.parametrize("name", HOSTILE)
def test_hostile_names_are_refused(name: str) -> None:
    with pytest.raises(nm.InvalidNameError):
        validate_name("tag", name)
    with pytest.raises(nm.InvalidNameError):
        validate_name("item", name)


@pytest.mark.parametrize("name", [None, 5, b"bytes", ["a"]])
def test_non_strings_are_refused(name: object) -> None:
    with pytest.raises(nm.InvalidNameError, match="must be a str"):
        validate_name("tag", name)


@pytest.mark.parametrize(
    "name", ["global_step500", "epoch=3-step=100.ckpt", "mp_rank_00_model_states.pt", "x" * 255]
)
def test_ordinary_names_pass(name: str) -> None:
    assert validate_name("item", name) == name


def test_manifest_name_is_reserved_for_items_only() -> None:
    with pytest.raises(nm.InvalidNameError, match="reserved"):
        validate_name("item", "manifest.json")
    assert validate_name("tag", "manifest.json") == "manifest.json"


@pytest.mark.parametrize("name", ["../outside", "/abs", "a/b", "\x00", ".."])
def test_api_refuses_before_any_io(root: Path, tmp_path: Path, name: str) -> None:
    nm.init(str(root))
    before = sorted(str(p) for p in tmp_path.rglob("*"))
    with pytest.raises(nm.InvalidNameError):
        nm.Checkpoint(name)
    with pytest.raises(nm.InvalidNameError):
        nm.Checkpoint("global_step1", -2).save(name, {"x": 1})
    with pytest.raises(nm.InvalidNameError):
        nm.get_checkpoint(name)
    with pytest.raises(nm.InvalidNameError):
        nm.get_latest_checkpoint_path(name)
    assert sorted(str(p) for p in tmp_path.rglob("*")) == before


def test_step_and_order() -> None:
    assert step_of("global_step42") == 42
    assert step_of("epoch3") is None
    tags = ["global_step100", "global_step9", "global_step10", "best"]
    assert sorted(tags, key=lambda t: order_key(t, "")) == [
        "best",
        "global_step9",
        "global_step10",
        "global_step100",
    ]
    # The same step: the later commit is newer.
    assert order_key("global_step5", "2026-01-02T00:00:00Z") > order_key(
        "global_step5", "2026-01-01T00:00:00Z"
    )


@pytest.mark.parametrize(
    ("tag", "step"),
    [
        ("global_step12", 12),
        ("global_step007", 7),
        ("global_step12_best", 12),
        ("global_step12.pt", 12),
        ("epoch=1-step=200", 200),
        ("epoch=1-step=200.ckpt", 200),
        # A number that holds a digit other than ASCII's is no step, not its ASCII head.
        ("global_step12\u00b2", None),  # superscript two
        ("global_step1\u0662", None),  # Arabic-Indic two
        ("global_step\u0661\u0662", None),
        ("global_step12\u00bd", None),  # vulgar one half
        ("global_step\uff11\uff12", None),  # full-width digits
        ("epoch=1-step=200\u00b2", None),
        ("best", None),
    ],
)
def test_step_is_ascii_digits_alone(tag: str, step: int | None) -> None:
    assert step_of(tag) == step


def test_a_step_with_a_foreign_digit_sorts_among_tags_without_one() -> None:
    tags = ["global_step12\u00b2", "global_step3", "best"]
    assert sorted(tags, key=order_key) == ["best", "global_step12\u00b2", "global_step3"]
