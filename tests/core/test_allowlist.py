"""Framework classes allowed under weights_only=True: only while their framework loads,
only for the load, and never at the cost of what the caller allowed."""

from __future__ import annotations

import argparse
import io
import threading
from dataclasses import dataclass

import pytest
import torch

import nebulaml as nm
from nebulaml.format.allowlist import FrameworkAllowlist, active_classes, allowed
from nebulaml.format.serialization import read_item


@dataclass
class Plain:
    """Stands for a framework's plain-data class (DeepSpeed's fragment_address)."""

    numel: int
    start: int


@dataclass
class Other:
    numel: int


HERE = FrameworkAllowlist("tests", __name__, ((__name__, "Plain"), (__name__, "Missing")))


def _pickled(obj: object) -> bytes:
    out = io.BytesIO()
    torch.save({"x": obj}, out)
    return out.getvalue()


def _weights_only_load(data: bytes) -> object:
    return torch.load(io.BytesIO(data), weights_only=True)["x"]


def test_classes_are_active_only_while_the_trigger_module_is_imported() -> None:
    """Bug caught: allowing a framework's classes in a process that does not run it."""
    assert active_classes((HERE,)) == [Plain]  # "Missing" does not exist: skipped
    elsewhere = FrameworkAllowlist("x", "no_such_module_imported", ((__name__, "Plain"),))
    assert active_classes((elsewhere,)) == []


def test_allowed_covers_the_load_only_and_nothing_else() -> None:
    """Bugs caught: an allowlist that outlives the load (process-wide trust), or one that
    lets other classes through."""
    data = _pickled(Plain(3, 4))
    with pytest.raises(Exception, match="Plain"):
        _weights_only_load(data)
    with allowed([Plain]):
        assert _weights_only_load(data) == Plain(3, 4)
        with pytest.raises(Exception, match="Other"):
            _weights_only_load(_pickled(Other(1)))
    with pytest.raises(Exception, match="Plain"):
        _weights_only_load(data)


def test_what_the_caller_allowed_stays_allowed() -> None:
    """torch's own context manager removes on exit what it added, also what the caller
    had added before. Bug caught: a nebula load that revokes the caller's allowlist."""
    torch.serialization.add_safe_globals([Plain])
    try:
        with allowed([Plain]):
            pass
        assert Plain in torch.serialization.get_safe_globals()
    finally:
        torch.serialization.clear_safe_globals()


def test_overlapping_loads_keep_the_class_until_the_last_ends() -> None:
    """Bug caught: one thread's load ending revokes the class in the middle of another's."""
    data = _pickled(Plain(1, 2))
    inside, release = threading.Event(), threading.Event()

    def other_load() -> None:
        with allowed([Plain]):
            inside.set()
            release.wait(10)

    thread = threading.Thread(target=other_load)
    thread.start()
    assert inside.wait(10)
    with allowed([Plain]):
        release.set()
        thread.join(10)  # the other load has ended; this one goes on
        assert _weights_only_load(data) == Plain(1, 2)
    assert Plain not in torch.serialization.get_safe_globals()


def test_weights_only_none_means_true(monkeypatch: pytest.MonkeyPatch) -> None:
    """Lightning passes weights_only=None. Bug caught: None handed to torch.load, where
    TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD turns it into False and the pickle runs."""
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    data = _pickled(argparse.Namespace(a=1))
    with pytest.raises(nm.UnsafeCheckpointError, match="Namespace"):
        read_item(data, "item", weights_only=None)
    with pytest.raises(nm.InvalidArgumentError, match="True or False"):
        read_item(data, "item", weights_only="no")  # type: ignore[arg-type]
    assert read_item(data, "item", weights_only=False)["x"].a == 1
