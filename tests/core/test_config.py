"""Every `NEBULA_*` setting parsed strictly: a value outside its documented set raises
`InvalidArgumentError` naming the variable and what it accepts, never a quiet default."""

from __future__ import annotations

from pathlib import Path

import pytest

import nebulaml as nm
from nebulaml.config import private_default, resolve_config
from nebulaml.storage.retry import RetryPolicy

BOOLEANS = ("NEBULA_LAZY_SNAPSHOT", "NEBULA_KEEP_MEMORY_TIER", "NEBULA_REUSE_UNCHANGED")
FIELDS = {
    "NEBULA_LAZY_SNAPSHOT": "lazy_snapshot",
    "NEBULA_KEEP_MEMORY_TIER": "keep_memory_tier",
    "NEBULA_REUSE_UNCHANGED": "reuse_unchanged",
    "NEBULA_PRIVATE": "private",
}


@pytest.mark.parametrize("name", sorted(FIELDS))
@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("1", True),
        ("true", True),
        ("TRUE", True),
        (" Yes ", True),
        ("on", True),
        ("0", False),
        ("False", False),
        ("no", False),
        ("OFF", False),
    ],
)
def test_boolean_variables_accept_the_documented_words(
    name: str, value: str, expected: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(name, value)
    assert getattr(resolve_config("/ckpt", None, None, {}), FIELDS[name]) is expected
    if name == "NEBULA_PRIVATE":
        assert private_default() is expected


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("NEBULA_PRIVATE", "y"),
        ("NEBULA_PRIVATE", "private"),
        ("NEBULA_LAZY_SNAPSHOT", "maybe"),
        ("NEBULA_KEEP_MEMORY_TIER", "2"),
        ("NEBULA_REUSE_UNCHANGED", "disable"),
        ("NEBULA_EXIT_TIMEOUT_S", "soon"),
        ("NEBULA_RANK_TIMEOUT_S", "-1"),
        ("NEBULA_ON_PERSIST_ERROR", "ignore"),
        ("NEBULA_PERSISTENT_TIME_INTERVAL", "nan"),
        ("NEBULA_NUM_OF_VERSION_IN_RETENTION", "two"),
        ("NEBULA_PEER_REPLICAS", "2"),
    ],
)
def test_a_bad_value_is_refused_naming_the_variable_and_what_it_accepts(
    name: str, value: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Catches: a boolean read as off (or on) for any word outside the set (NEBULA_PRIVATE=y
    # leaving files readable), an error naming the option instead of the variable.
    monkeypatch.setenv(name, value)
    with pytest.raises(nm.InvalidArgumentError) as raised:
        resolve_config("/ckpt", None, None, {})
    message = str(raised.value)
    assert name in message and repr(value) in message
    if name in FIELDS:
        for word in ("1", "true", "yes", "on", "0", "false", "no", "off"):
            assert word in message
    if name == "NEBULA_PRIVATE":  # what the CLI asks when it writes to a local root
        with pytest.raises(nm.InvalidArgumentError, match=name):
            private_default()


def test_an_empty_boolean_variable_is_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [*BOOLEANS, "NEBULA_PRIVATE"]:
        monkeypatch.setenv(name, "")
    config = resolve_config("/ckpt", None, None, {})
    assert (config.lazy_snapshot, config.keep_memory_tier, config.private) == ("auto", False, False)
    assert config.reuse_unchanged is True


def test_an_argument_wins_over_a_bad_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NEBULA_LAZY_SNAPSHOT", "maybe")
    assert resolve_config("/ckpt", None, None, {"lazy_snapshot": True}).lazy_snapshot is True


def test_init_refuses_a_bad_variable_before_touching_the_root(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "root"
    monkeypatch.setenv("NEBULA_PRIVATE", "y")
    with pytest.raises(nm.InvalidArgumentError, match="NEBULA_PRIVATE"):
        nm.init(str(root))
    assert not root.exists()


@pytest.mark.parametrize(
    "name",
    ["NEBULA_STORAGE_RETRY_BASE_S", "NEBULA_STORAGE_RETRY_MAX_S", "NEBULA_STORAGE_CALL_TIMEOUT_S"],
)
def test_a_storage_time_that_is_not_a_number_is_refused(name: str) -> None:
    # Catches: float("nan") passing the "not negative" check (every comparison with NaN is
    # False): a backoff of NaN seconds, a deadline that never comes or always has.
    with pytest.raises(nm.InvalidArgumentError, match=name):
        RetryPolicy.from_options({}, {name: "nan"})
    assert RetryPolicy.from_options({}, {name: "2.5"}) is not None
