"""The commands agree with each other: names of options, not-found answers, exit codes,
typed JSON. Each test failed on main before this change (the comment says how)."""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch
import warm
from cli_helpers import TAGS, in_a_pipe, populate

import nebulaml as nm

CONNECTION_STRING = (
    "DefaultEndpointsProtocol=https;AccountName=acct;AccountKey=c2VjcmV0LWtleQ==;"
    "EndpointSuffix=core.windows.net"
)


@pytest.fixture
def populated(root: Path) -> Path:
    populate(root)
    return root


def test_history_tag_with_no_rows_is_not_found(populated: Path) -> None:
    # main: `history --tag nosuch` printed an empty table and exited 0.
    nm.shutdown()
    run = in_a_pipe("history", str(populated), "--tag", "global_step40")
    assert (run.code, run.stdout) == (3, "")
    assert run.stderr == (
        f"nebula: error: {populated}: no history rows of tag 'global_step40'; "
        "did you mean 'global_step400'?\n"
    )
    since = in_a_pipe("history", str(populated), "--tag", TAGS[0], "--since", "2026-01-01Z")
    assert since.code == 0  # the tag has rows, just not since then: an empty answer
    assert in_a_pipe("history", str(populated), "--tag", TAGS[0], "--since", "1s").code == 0


@pytest.mark.parametrize("command", ["inspect", "verify", "copy", "export", "diff"])
def test_a_tag_typo_suggests_the_close_tags(populated: Path, tmp_path: Path, command: str) -> None:
    # main: an item typo listed the items, a tag typo suggested nothing.
    typo = "epoch=2-step=300-val_loss=0.3"
    args = {
        "inspect": ["inspect", str(populated), typo],
        "verify": ["verify", str(populated), typo],
        "copy": ["copy", str(populated), typo, str(tmp_path / "d")],
        "export": ["export", str(populated), typo, str(tmp_path / "d")],
        "diff": ["diff", str(populated), TAGS[0], typo],
    }[command]
    run = in_a_pipe(*args)
    assert run.code == 3 and run.stdout == ""
    assert run.stderr.startswith(f"nebula: error: {populated}: no checkpoint {typo!r} found; ")
    assert f"did you mean {TAGS[2]!r}" in run.stderr and len(run.stderr.splitlines()) == 1


def test_an_item_typo_suggests_the_close_item(populated: Path) -> None:
    run = in_a_pipe("inspect", str(populated), TAGS[0], "--item", "modle")
    assert run.code == 3
    assert run.stderr.endswith("its items: 'model', 'optimizer'; did you mean 'model'?\n")


def test_item_is_named_alike_everywhere(populated: Path) -> None:
    # main: `latest --path NAME` but `inspect --item NAME`.
    by_item = in_a_pipe("latest", str(populated), "--item", "model")
    by_path = in_a_pipe("latest", str(populated), "--path", "model")
    assert by_item.code == 0 and by_item.stdout == by_path.stdout
    assert by_item.stdout == f"{populated / TAGS[3] / 'model'}\n"
    for args in (["inspect", str(populated), TAGS[3]], ["diff", str(populated), *TAGS[:2]],
                 ["export", str(populated), TAGS[3], "/tmp/unused"]):  # fmt: skip
        help_text = in_a_pipe(*args, "--help").stdout
        assert "--item NAME" in help_text


def test_flush_of_a_file_fails_as_ls_does(tmp_path: Path) -> None:
    # main: `flush /etc/passwd` said "Nothing to flush" (exit 0) where `ls` failed.
    not_a_root = tmp_path / "passwd"
    not_a_root.write_text("root:x:0:0\n")
    ls = in_a_pipe("ls", str(not_a_root))
    flush = in_a_pipe("flush", str(not_a_root))
    assert ls.code == flush.code == 1
    assert flush.stdout == "" and flush.stderr == ls.stderr
    assert "Not a directory" in flush.stderr


@pytest.mark.parametrize("given", [CONNECTION_STRING, f"AccountName=acct;{CONNECTION_STRING}"])
def test_a_connection_string_without_its_key_is_refused(given: str) -> None:
    # main: `--storage-option "$CS"` became the option DefaultEndpointsProtocol=..., silently.
    run = in_a_pipe("ls", "az://container/run1", "--storage-option", given)
    assert run.code == 2 and run.stdout == ""
    assert run.stderr.startswith("nebula: error: invalid value for --storage-option: ")
    assert "connection_string=" in run.stderr and "c2VjcmV0" not in run.stderr
    assert len(run.stderr.splitlines()) == 1


def test_verify_json_expected_and_actual_are_objects(populated: Path) -> None:
    # main: `expected` and `actual` were prose ("1829 bytes with xxh3_64_tree_1m 9f3c...").
    (populated / TAGS[1] / "optimizer").unlink()
    run = in_a_pipe("verify", str(populated), TAGS[1], "--json")
    assert run.code == 1
    results = {(r["tier"], r["item"]): r for r in json.loads(run.stdout)["results"]}
    ok = results[("persistent", "model")]
    assert set(ok["expected"]) == {"size_bytes", "algo", "checksum"}
    assert ok["expected"] == ok["actual"] and ok["detail"] is None
    assert isinstance(ok["expected"]["size_bytes"], int)
    missing = results[("persistent", "optimizer")]
    assert missing["status"] == "missing" and missing["actual"] is None
    assert missing["detail"].endswith("found no such file")


def test_prune_json_keeps_kept_and_protected_apart(populated: Path) -> None:
    # main: `kept` was the kept-by-count and the protected together.
    run = in_a_pipe("prune", str(populated), "--keep", "2", "--dry-run", "--json")
    doc = json.loads(run.stdout)
    assert [d["tag"] for d in doc["kept"]] == [TAGS[2]]  # one of the 2 newest, by count
    protected = {d["tag"]: d["reason"] for d in doc["protected"]}
    assert protected == {TAGS[3]: "the newest committed checkpoint", TAGS[1]: "labelled best"}
    assert [d["tag"] for d in doc["delete"]] == [TAGS[0]]


def test_plot_format_follows_the_suffix(populated: Path, tmp_path: Path) -> None:
    # main: `--plot h.svg` wrote a PNG named h.svg.
    pytest.importorskip("matplotlib")
    nm.shutdown()
    svg = tmp_path / "h.svg"
    assert in_a_pipe("history", str(populated), "--plot", str(svg)).code == 0
    assert svg.read_bytes().lstrip().startswith((b"<?xml", b"<svg"))
    png = tmp_path / "h.png"
    assert in_a_pipe("history", str(populated), "--plot", str(png)).code == 0
    assert png.read_bytes().startswith(b"\x89PNG")
    run = in_a_pipe("history", str(populated), "--plot", str(tmp_path / "h.txt"))
    assert run.code == 2 and "name a .png, .svg or .pdf file" in run.stderr
    assert not (tmp_path / "h.txt").exists()


def test_sizes_are_iec_everywhere(populated: Path, tmp_path: Path, monkeypatch) -> None:
    # main: `copy` said 200.8 MiB and `verify` 210.5 MB for the same bytes.
    from nebula_cli import progress

    monkeypatch.setattr(progress, "PROGRESS_INTERVAL_S", 0.0)
    runs = [
        in_a_pipe("verify", str(populated)),
        in_a_pipe("copy", str(populated), TAGS[3], str(tmp_path / "d")),
        in_a_pipe("ls", str(populated)),
        in_a_pipe("history", str(populated)),
    ]
    for run in runs:
        assert run.code == 0, run.stderr
        text = run.stdout + run.stderr
        assert "KiB" in text and not re.search(r"\d (kB|MB|GB)\b", text)
    # Rates: a copy's progress in MiB/s, like its sizes; the history's throughput in MB/s,
    # the unit of throughput_mb_s in its file, --json and --csv (#31: the table said MiB/s).
    assert "MiB/s" in runs[1].stderr and "MB/s" not in runs[1].stderr.replace("MiB/s", "")
    assert "MB/s" in runs[3].stdout and "MiB/s" not in runs[3].stdout


def test_init_refuses_an_unknown_option(tmp_path: Path) -> None:
    # main: nm.init(path="/x"), as the README's table wrote it, warned and ran memory-only:
    # nothing was ever made durable.
    with pytest.raises(TypeError, match="path"):
        nm.init(path="/x")
    with pytest.raises(TypeError, match="persistent_time_intervall"):
        nm.init(str(tmp_path / "root"), persistent_time_intervall=5)
    assert not (tmp_path / "root").exists()


def test_latest_of_a_remote_root_downloads_with_local(tmp_path: Path, monkeypatch) -> None:
    # main: `torch.load("$(nebula latest az://... --path model)")` got a URL it cannot open.
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    url = "memory://nebula-tests/latest-local"
    nm.init(url, persistent_time_interval=0)
    nm.Checkpoint("global_step1").save("model", {"w": torch.full((3,), 7.0)})
    nm.flush_persistence()
    nm.shutdown()
    plain = in_a_pipe("latest", url, "--item", "model")
    assert plain.code == 0 and plain.stdout.startswith("memory://")
    assert "add --local to download it" in plain.stderr
    local = in_a_pipe("latest", url, "--item", "model", "--local")
    assert local.code == 0, local.stderr
    path = Path(local.stdout.strip())
    assert path.is_relative_to(tmp_path / "cache" / "nebula") and path.name == "model.pt"
    assert torch.load(path, weights_only=True)["w"].tolist() == [7.0, 7.0, 7.0]
    again = in_a_pipe("latest", url, "--item", "model", "--local", "--json")
    doc = json.loads(again.stdout)
    assert doc["local_path"] == str(path) and doc["path"].startswith("memory://")
    assert in_a_pipe("latest", url, "--local").code == 2  # needs --item


def _as_a_user_without_override() -> list[str]:
    """The command prefix under which permissions apply: none for a user; for root, its
    capabilities to override them dropped (setpriv), as a user has none."""
    if os.geteuid() != 0:
        return []
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("needs setpriv (util-linux) to run without root's overrides")
    return [setpriv, "--bounding-set=-dac_override,-dac_read_search,-fowner"]


def test_permission_denied_is_one_line_naming_the_path_once(
    populated: Path, tmp_path: Path, memory_tier: Path
) -> None:
    # main: "nebula: error: /x: [Errno 13] Permission denied: '/x'" (the path twice, the raw
    # errno), and a traceback for an export into a folder it may not write.
    nm.shutdown()
    shut, read_only = tmp_path / "shut", tmp_path / "read-only"
    copy = read_only / "copy"
    shut.mkdir(mode=0o000)
    read_only.mkdir(mode=0o555)
    env = dict(os.environ, NEBULA_MEMORY_TIER_PATH=str(memory_tier))
    exe = [*_as_a_user_without_override(), str(Path(sys.executable).parent / "nebula")]
    cases = {
        str(shut): ["ls", str(shut)],
        str(read_only / "out"): ["export", str(populated), TAGS[3], str(read_only / "out")],
        str(read_only): ["export", str(populated), TAGS[3], str(read_only)],
        str(read_only / "copy" / TAGS[3]): ["copy", str(populated), TAGS[3], str(copy)],
    }
    try:
        for path, args in cases.items():
            out = warm.run([*exe, *args], capture_output=True, text=True, env=env,
                                 timeout=60)  # fmt: skip
            assert out.returncode == 1, out.stderr
            [line] = out.stderr.splitlines()
            assert line.startswith(f"nebula: error: {path}: permission denied"), line
            assert "Errno" not in line and "ask for access" in line, line
            assert ".nebula-mode" not in line  # nebula's own probe is not the user's business
    finally:
        shut.chmod(0o700)
        read_only.chmod(0o700)
