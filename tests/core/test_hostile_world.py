"""Issue #18, "Hostile world, second round": cases 1, 5, 6 and 7, one group each.

1. The clock steps: "newest" (latest, retention, listings) follows the step a tag names,
   then the commit sequence, never the wall clock. The clock is moved by patching the one
   function that stamps `committed_at` (commit.py's `utc_now`), never the system's.
5. JSON too deep or too large (a manifest, a writer marker) is corruption like any other:
   the tag is ignored with a warning, `corrupt` in verify, an error in inspect; never a
   `RecursionError` from `init`, a listing or the CLI.
6. A `committed_at` that is not a time: the CLI shows it as written, its age as "?".
7. Names that display as other names (bidi, zero-width, separators, a BOM) are refused,
   and steps are ASCII digits only.
"""

from __future__ import annotations

import json
import logging
import os
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import nebulaml as nm
from nebula_cli.app import app
from nebulaml.format.manifest import parse_manifest, seal
from nebulaml.format.names import order_key, step_of, validate_name
from nebulaml.protocol import commit
from nebulaml.protocol.commit_index import record_begun
from nebulaml.storage.store import Store


class Clock:
    """The time commits stamp, moved by hand (`offset`); the system clock is untouched."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.offset = timedelta(0)
        monkeypatch.setattr(commit, "utc_now", self.now)

    def now(self) -> str:
        return (datetime.now(timezone.utc) + self.offset).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    return Clock(monkeypatch)


def _save(tag: str, value: float) -> None:
    nm.Checkpoint(tag).save("model", {"w": torch.full((4,), float(value))})
    nm.flush_persistence()


def _latest() -> tuple[str, float]:
    latest = nm.get_latest_checkpoint()
    assert latest is not None
    return latest.tag, float(latest.load("model")["w"][0])


def _on_disk(root: Path) -> list[str]:
    """The tags the persistent root holds committed (retention's doing)."""
    return sorted(p.parent.name for p in root.glob("*/manifest.json"))


# 1. clock steps ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "tags",
    [("epoch=0-step=100", "epoch=1-step=200"), ("before", "after"), ("zz-first", "aa-second")],
    ids=["lightning", "no-step", "no-step-names-backwards"],
)
def test_1_a_clock_stepped_back_reorders_nothing(root: Path, clock: Clock, tags) -> None:
    # Reproduced on main: latest was the first, and retention 1 deleted the second.
    nm.init(str(root), persistent_time_interval=0, num_of_version_in_retention=1)
    _save(tags[0], 0)
    clock.offset = -timedelta(hours=1)
    _save(tags[1], 1)
    assert _latest() == (tags[1], 1.0)
    assert [c["tag"] for c in nm.list_checkpoints()] == [tags[1]]
    assert _on_disk(root) == [tags[1]]


def test_1_a_checkpoint_from_a_clock_a_day_ahead_is_not_newest_for_ever(
    root: Path, clock: Clock
) -> None:
    # Reproduced on main: "warmup" stayed latest, and retention deleted the newer ones.
    nm.init(str(root), persistent_time_interval=0, num_of_version_in_retention=2)
    clock.offset = timedelta(days=1)
    _save("warmup", 0)
    clock.offset = timedelta(0)
    for i in range(1, 4):
        _save(f"run-{i}", i)
        assert _latest() == (f"run-{i}", float(i))
    assert _on_disk(root) == ["run-2", "run-3"]
    manifests = [json.loads((root / t / "manifest.json").read_text()) for t in _on_disk(root)]
    assert [m["sequence"] for m in manifests] == [3, 4]  # warmup 1, run-1 2: deleted


def test_1_the_order_holds_across_a_restart_with_the_clock_behind(root: Path, clock: Clock) -> None:
    # The new session's memory tier is empty: its first commit still comes after what the
    # persistent tier holds (the persister's sequence floor), on both tiers.
    nm.init(str(root), persistent_time_interval=0, num_of_version_in_retention=3)
    _save("first", 1)
    _save("second", 2)
    nm.shutdown()
    clock.offset = -timedelta(days=2)
    nm.init(str(root), persistent_time_interval=3600, num_of_version_in_retention=3)
    nm.Checkpoint("third").save("model", {"w": torch.full((4,), 3.0)})
    assert _latest() == ("third", 3.0)  # the memory tier's copy, not yet persisted
    nm.flush_persistence()
    assert [c["tag"] for c in nm.list_checkpoints()] == ["third", "second", "first"]
    assert json.loads((root / "third" / "manifest.json").read_text())["sequence"] == 3


def test_1_a_copy_into_a_root_comes_after_what_it_holds(root: Path, tmp_path: Path) -> None:
    from nebulaml.protocol.catalog import read_committed
    from nebulaml.protocol.transfer import copy_checkpoint

    other = tmp_path / "other"
    nm.init(str(other), persistent_time_interval=0)
    _save("best", 1)
    nm.init(str(root), persistent_time_interval=0, num_of_version_in_retention=5)
    for tag in ("a", "b", "c"):
        _save(tag, 2)
    info = read_committed(Store(str(other)), "best")
    assert info is not None and info.sequence == 1
    copied = copy_checkpoint(info, Store(str(root)))
    assert copied.manifest.sequence == 4
    assert nm.list_checkpoints(str(root))[0]["tag"] == "best"


def test_1_a_persist_keeps_the_order_of_the_commits(root: Path, tmp_path: Path) -> None:
    # The persister copies between tiers of one root (one numbering): an older checkpoint
    # persisted after a newer one stays older there. A copy from another root comes last.
    from nebulaml.protocol.catalog import list_committed, read_committed
    from nebulaml.protocol.transfer import copy_checkpoint
    from nebulaml.storage.store import Store

    nm.init(str(root), persistent_time_interval=0, num_of_version_in_retention=5)
    _save("zz-older", 1)
    _save("aa-newer", 2)
    nm.shutdown()
    older, newer = (read_committed(Store(str(root)), t) for t in ("zz-older", "aa-newer"))
    assert older is not None and newer is not None
    for same_root, newest in ((True, "aa-newer"), (False, "zz-older")):
        dst = Store(str(tmp_path / f"dst-{same_root}"))
        copy_checkpoint(newer, dst, same_root=same_root)
        copy_checkpoint(older, dst, same_root=same_root)
        assert list_committed(dst)[-1].tag == newest


# 5. deep or huge JSON --------------------------------------------------------------------------
DEEP = b"[" * 3000 + b"]" * 3000  # a few KB: Python's parser raises RecursionError on it


def test_5_bounds_before_parsing() -> None:
    from nebulaml.format.jsonbounds import JsonBoundsError, load_json, nesting_depth

    assert nesting_depth(b'{"items": [{"checksum": {"value": "[[[[\\"]"}}]}') == 4
    for data in (DEEP, b'{"a": ' * 5000, b"[" * 60_000):
        with pytest.raises(JsonBoundsError, match="nested more than 32 deep"):
            load_json(data)
    with pytest.raises(JsonBoundsError, match="too large"):
        load_json(b" " * (64 << 10) + b"{}")
    with pytest.raises(JsonBoundsError, match="not valid JSON"):
        load_json(b'{"n": ' + b"9" * 5000 + b"}")  # past Python's integer digit limit
    assert load_json('{"ok": ["[{"]}') == {"ok": ["[{"]}


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (DEEP, "manifest is nested more than"),
        (b'{"schema_version": ' + b"1" * 5000 + b"}", "manifest is not valid JSON"),
    ],
    ids=["deep", "huge-int"],
)
def test_5_a_manifest_too_deep_or_unreadable_is_a_manifest_error(data: bytes, match: str) -> None:
    with pytest.raises(nm.ManifestError, match=match):
        parse_manifest(data, "somewhere/manifest.json")


def _root_with_a_deep_manifest(root: Path) -> None:
    nm.init(str(root), persistent_time_interval=0)
    _save("global_step1", 1)
    nm.shutdown()
    bad = root / "global_step2"
    bad.mkdir()
    (bad / "manifest.json").write_bytes(DEEP)


def test_5_a_deep_manifest_is_ignored_with_a_warning(
    root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Reproduced on main: init, list_checkpoints and get_latest_checkpoint raised
    # RecursionError.
    _root_with_a_deep_manifest(root)
    caplog.set_level(logging.WARNING, logger="nebulaml")
    nm.init(str(root), persistent_time_interval=0)
    assert [c["tag"] for c in nm.list_checkpoints()] == ["global_step1"]
    assert _latest() == ("global_step1", 1.0)
    assert "ignoring checkpoint 'global_step2'" in caplog.text and "nested" in caplog.text
    rows = [r for r in nm.verify_checkpoints(str(root)) if r["tag"] == "global_step2"]
    assert [r["status"] for r in rows] == ["corrupt"]
    with pytest.raises(nm.ManifestError, match="nested more than 32 deep"):
        nm.inspect_checkpoint(str(root), "global_step2")


def test_5_the_cli_reports_a_deep_manifest(root: Path) -> None:
    _root_with_a_deep_manifest(root)
    runner = CliRunner()
    ls = runner.invoke(app, ["ls", str(root), "--json"])
    assert ls.exit_code == 0, ls.output
    assert [c["tag"] for c in json.loads(ls.stdout)["checkpoints"]] == ["global_step1"]
    verify = runner.invoke(app, ["verify", str(root)])
    assert verify.exit_code == 1 and "RecursionError" not in verify.output
    assert "global_step2" in verify.stdout
    inspect = runner.invoke(app, ["inspect", str(root), "global_step2"])
    assert inspect.exit_code == 1 and inspect.stdout == ""
    assert "manifest is nested more than 32 deep" in inspect.stderr
    assert "Traceback" not in inspect.output


def test_5_a_deep_writer_marker_is_ignored(root: Path) -> None:
    # Reproduced on main: 10 KB of brackets in an uncommitted tag's writer marker made
    # `nebula ls --all` and init (the dead writers' cleanup) raise RecursionError.
    nm.init(str(root), persistent_time_interval=0)
    _save("global_step1", 1)
    nm.shutdown()
    left = root / "global_step2"
    # As a writer leaves it: its begun record first (commit.begin_tag), by which a
    # restart finds the folders at the top (commit_index.py).
    record_begun(Store(str(root)), "global_step2")
    left.mkdir()
    (left / ".writer-0.json").write_bytes(b"[" * 10_000)
    (left / "model").write_bytes(b"half")
    (incomplete,) = nm.list_incomplete(str(root))
    assert incomplete["tag"] == "global_step2" and incomplete["writers"] == []
    ls = CliRunner().invoke(app, ["ls", str(root), "--all"])
    assert ls.exit_code == 0, ls.output
    assert "global_step2" in ls.stdout
    # As any unreadable writer marker: no live writer named, the leftover is removed.
    nm.init(str(root), persistent_time_interval=0)
    assert _latest() == ("global_step1", 1.0)
    assert not left.exists()


# 6. a committed_at that is not a time ----------------------------------------------------------
def test_6_an_unparseable_committed_at_is_shown_not_a_crash(root: Path) -> None:
    # Reproduced on main: `nebula ls` and `nebula inspect` raised ValueError.
    nm.init(str(root), persistent_time_interval=0)
    _save("global_step1", 1)
    nm.shutdown()
    path = root / "global_step1" / "manifest.json"
    doc = json.loads(path.read_text())
    del doc["checksum"]
    doc["committed_at"] = "the day after tomorrow"
    path.write_bytes(seal(doc))  # sealed: a valid manifest, with a time no one can read
    assert nm.list_checkpoints(str(root))[0]["committed_at"] == "the day after tomorrow"
    runner = CliRunner()
    ls = runner.invoke(app, ["ls", str(root)], env={"COLUMNS": "200"})
    assert ls.exit_code == 0, ls.output
    (row,) = [line for line in ls.stdout.splitlines() if "global_step1" in line]
    assert row.split()[-1] == "?"  # the age column (no labels after it)
    inspect = runner.invoke(app, ["inspect", str(root), "global_step1"], env={"COLUMNS": "200"})
    assert inspect.exit_code == 0, inspect.output
    assert "the day after tomorrow (? ago)" in inspect.stdout


# 7. names that look like other names -----------------------------------------------------------
LOOKALIKES = [
    "global_step\u202e005",  # RIGHT-TO-LEFT OVERRIDE: shows as global_step500
    "global_step\u2066100\u2069",  # LEFT-TO-RIGHT ISOLATE ... POP DIRECTIONAL ISOLATE
    "global_step1\u200b00",  # ZERO WIDTH SPACE: shows as global_step100, is step 1
    "global_step1\u200d00",  # ZERO WIDTH JOINER
    "global_step1\u00ad00",  # SOFT HYPHEN
    "line\u2028separator",  # LINE SEPARATOR (Zl)
    "paragraph\u2029separator",  # PARAGRAPH SEPARATOR (Zp)
    "next\u0085line",  # NEXT LINE (a C1 control)
    "\ufeffglobal_step100",  # a BOM
    "global_step100\ufeff",
]


@pytest.mark.parametrize("name", LOOKALIKES)
def test_7_names_that_look_like_other_names_are_refused(name: str) -> None:
    for kind in ("tag", "item"):
        with pytest.raises(nm.InvalidNameError, match="must not contain"):
            validate_name(kind, name)


def test_7_refused_by_the_api_and_in_a_manifest(root: Path) -> None:
    nm.init(str(root), persistent_time_interval=0)
    with pytest.raises(nm.InvalidNameError, match="U\\+200B"):
        nm.Checkpoint("global_step1\u200b00")
    with pytest.raises(nm.InvalidNameError, match="U\\+202E"):
        nm.Checkpoint("global_step1").save("model\u202e", {"w": 1})
    _save("global_step2", 2)
    path = root / "global_step2" / "manifest.json"
    doc = json.loads(path.read_text())
    del doc["checksum"]
    doc["items"][0]["name"] = "mod\u2066el"
    with pytest.raises(nm.ManifestError, match="unsafe item"):
        parse_manifest(seal(doc), str(path))


@pytest.mark.parametrize(
    "tag",
    [
        "global_step\u0661\u0660\u0660",  # Arabic-Indic digits: 100 to the eye
        "global_step\uff11\uff10\uff10",  # full-width digits
        "epoch=1-step=\u0662\u0660\u0660",
    ],
)
def test_7_steps_are_ascii_digits_only(tag: str) -> None:
    # Reproduced on main: global_step with Arabic-Indic 100 counted as step 100, newest.
    assert validate_name("tag", tag) == tag  # a name like any other, without a step
    assert step_of(tag) is None
    assert order_key(tag, "2099-01-01T00:00:00Z", 99) < order_key("global_step1")


def test_7_steps_of_deepspeed_and_lightning_tags() -> None:
    assert step_of("global_step100") == 100
    assert step_of("epoch=1-step=200") == 200
    assert step_of("epoch=2-step=300-val_loss=0.323") == 300
    assert step_of("global_step=7") == 7  # Lightning's {global_step}
    assert step_of("epoch=3") is None and step_of("laststep=4") is None


def test_an_ignored_checkpoint_is_said_once_per_process(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Bug caught: an altered manifest's "ignoring checkpoint" warning came 3 times per
    `nebula ls` (a listing reads a tier up to three times), 3-6 times per command."""
    root = tmp_path / "root"
    nm.init(str(root), persistent_time_interval=0)
    for step in (1, 2):
        nm.Checkpoint(f"global_step{step}").save("model", {"w": torch.ones(2)})
        assert nm.flush_persistence() is True
    nm.shutdown()
    manifest = root / "global_step1" / "manifest.json"
    doc = json.loads(manifest.read_text())
    doc["labels"] = ["forged"]  # its checksum no longer matches
    manifest.write_text(json.dumps(doc))
    for _ in range(3):
        nm.list_checkpoints(str(root), hold=False)
    said = [
        r
        for r in caplog.records
        if "ignoring checkpoint 'global_step1'" in r.getMessage() and r.levelno >= logging.WARNING
    ]
    assert len(said) == 1, [r.getMessage() for r in said]


def test_a_private_root_is_this_users_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Bug caught (#29): the persistent tier followed the umask (items 0644, folders 0755)
    and nothing let a user ask otherwise: another local user copied a root's weights.
    private=True (or NEBULA_PRIVATE=1): the root 0700, everything nebula writes in it
    0600 and 0700, a root that existed with wider modes tightened."""
    import stat as stat_

    def modes(root: Path) -> set[tuple[str, int]]:
        out = {("root", stat_.S_IMODE(root.stat().st_mode))}
        for path in root.rglob("*"):
            kind = "dir" if path.is_dir() else "file"
            out.add((kind, stat_.S_IMODE(path.lstat().st_mode)))
        return out

    old = os.umask(0o022)
    try:
        for run, how in enumerate(("argument", "environment")):
            root = tmp_path / f"root{run}"
            root.mkdir(mode=0o755)
            root.chmod(0o755)
            if how == "environment":
                monkeypatch.setenv("NEBULA_PRIVATE", "1")
                nm.init(str(root), persistent_time_interval=0)
            else:
                nm.init(str(root), persistent_time_interval=0, private=True)
            nm.Checkpoint("global_step1").save("model", {"w": torch.ones(4)})
            nm.flush_persistence()
            nm.shutdown()
            assert (root / "global_step1" / "manifest.json").exists()
            assert (root / "checkpointHistories.csv").exists()
            assert modes(root) == {("root", 0o700), ("dir", 0o700), ("file", 0o600)}, how
        monkeypatch.delenv("NEBULA_PRIVATE")
        public = tmp_path / "public"
        nm.init(str(public), persistent_time_interval=0)
        nm.Checkpoint("global_step1").save("model", {"w": torch.ones(4)})
        nm.flush_persistence()
        nm.shutdown()
        assert ("file", 0o644) in modes(public)  # the default follows the umask
        with pytest.raises(nm.InvalidArgumentError, match="private must be True or False"):
            nm.init(str(public), private="yes")
    finally:
        os.umask(old)


@pytest.mark.parametrize("planted", ["symlink", "fifo", "shorter"])
def test_an_item_file_replaced_is_said_as_what_it_is(
    tmp_path: Path, planted: str, caplog: pytest.LogCaptureFixture
) -> None:
    # Catches: a checkpoint whose item was swapped for a link or a FIFO ignored as
    # "missing or has the wrong size", neither of which it is.
    root = tmp_path / "ckpt"
    nm.init(str(root), persistent_time_interval=0)
    nm.Checkpoint("global_step1").save("model", {"w": torch.ones(1000)})
    assert nm.flush_persistence()
    nm.shutdown()
    path = root / "global_step1" / "model"
    size = path.stat().st_size
    path.unlink()
    if planted == "symlink":
        path.symlink_to(tmp_path / "elsewhere")
    elif planted == "fifo":
        os.mkfifo(path)
    else:
        path.write_bytes(b"x" * (size - 1))
    with caplog.at_level("WARNING", logger="nebulaml"):
        assert nm.list_checkpoints(str(root)) == []
    said = {
        "symlink": "is not a regular file",
        "fifo": "is not a regular file",
        "shorter": f"has {size - 1} bytes, not {size}",
    }[planted]
    assert any(f"item file 'model' {said}" in r.getMessage() for r in caplog.records), [
        r.getMessage() for r in caplog.records
    ]
