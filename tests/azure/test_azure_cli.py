"""Every `nebula` command on an az:// root, credentials given only by --storage-option."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import warm
from azurite import ACCOUNT, KEY, Azurite
from typer.testing import CliRunner

import nebulaml as nm
from nebula_cli.app import app

CONTAINER = "nebula-tests"


@pytest.fixture
def no_azure_env(azurite: Azurite, monkeypatch: pytest.MonkeyPatch) -> Azurite:
    """No credentials in the environment: only what a command is given reaches Azurite."""
    for var in ("AZURE_STORAGE_CONNECTION_STRING", "AZURE_STORAGE_ACCOUNT_NAME",
                "AZURE_STORAGE_ACCOUNT_KEY", "AZURE_STORAGE_SAS_TOKEN"):  # fmt: skip
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("NEBULA_STORAGE_RETRIES", "1")
    monkeypatch.setenv("NEBULA_STORAGE_RETRY_BASE_S", "0.05")
    return azurite


def _state(step: int) -> dict[str, torch.Tensor]:
    return {"w": torch.full((1000,), float(step))}


CRASHING_JOB = """
import json, os, sys, torch, nebulaml as nm
nm.init(sys.argv[1], persistent_time_interval=3600, num_of_version_in_retention=5,
        storage_options=json.loads(sys.argv[2]))
for step in (1, 2, 3, 4):
    nm.Checkpoint(f"global_step{step}").save("model", {"w": torch.full((1000,), float(step))})
    if step < 4:
        nm.flush_persistence()
nm.wait_for_snapshot()  # its lazy copy taken (the default): a crash keeps it
os._exit(0)  # a crash: global_step4 stays in the memory tier only
"""


def crash_a_job(root: str, options: dict[str, str]) -> None:
    warm.run([sys.executable, "-c", CRASHING_JOB, root, json.dumps(options)],
                   check=True, timeout=120)  # fmt: skip


def run(*args: str, opts: list[str]) -> tuple[int, str, str]:
    flags = [x for o in opts for x in ("--storage-option", o)]
    result = CliRunner().invoke(app, [*args, *flags])
    return result.exit_code, result.stdout, result.stderr


@pytest.mark.slow
def test_every_command_on_an_azure_root(no_azure_env: Azurite, tmp_path: Path) -> None:
    # Catches: a command that does not accept --storage-option, or accepts it and does not
    # pass it on to the roots it opens (it then finds no credentials and exits 1).
    azurite = no_azure_env
    root = f"az://{CONTAINER}/cli-{tmp_path.name[-12:].lower().replace('_', '-')}"
    sas = azurite.container_sas(CONTAINER)
    opts = [f"account_name={ACCOUNT}", f"sas_token={sas}", f"account_url={azurite.endpoint}"]
    crash_a_job(root, {"account_name": ACCOUNT, "account_key": KEY,
                       "account_url": azurite.endpoint})  # fmt: skip

    code, out, err = run("ls", root, "--json", opts=[])
    assert code == 1 and "no Azure storage account" in err  # nothing in the environment

    code, out, err = run("ls", root, "--json", opts=opts)
    assert code == 0, err
    assert [c["tag"] for c in json.loads(out)["checkpoints"]] == [
        "global_step4", "global_step3", "global_step2", "global_step1"
    ]  # fmt: skip

    code, out, err = run("latest", root, "--json", opts=opts)
    assert code == 0 and json.loads(out)["tag"] == "global_step4", err

    code, out, err = run("inspect", root, "global_step2", "--json", opts=opts)
    assert code == 0, err
    assert [i["name"] for i in json.loads(out)["manifest"]["items"]] == ["model"]

    code, out, err = run("verify", root, "--json", opts=opts)
    assert code == 0, err
    verified = json.loads(out)
    assert verified["ok"] and len(verified["results"]) >= 4

    code, out, err = run("history", root, "--json", opts=opts)
    assert code == 0, err
    persists = [r["tag"] for r in json.loads(out)["rows"] if r["tier"] == "persistent"]
    assert persists == ["global_step1", "global_step2", "global_step3"]

    local = tmp_path / "local-copy"
    code, out, err = run("copy", root, "global_step2", str(local), "--json", opts=opts)
    assert code == 0, err
    assert torch.equal(torch.load(local / "global_step2" / "model")["w"], _state(2)["w"])

    other = f"{root}-back"
    code, out, err = run("copy", str(local), "global_step2", other, "--json", opts=opts)
    assert code == 0, err
    with nm.using_storage_options({"connection_string": azurite.connection_string}):
        back = nm.get_checkpoint("global_step2", persist_path=other)
        assert back is not None and torch.equal(back.load("model")["w"], _state(2)["w"])

    code, out, err = run("flush", root, "--json", opts=opts)
    assert code == 0, err
    assert json.loads(out)["persisted"] == ["global_step4"]

    code, out, err = run("prune", root, "--keep", "1", "--yes", "--json", opts=opts)
    assert code == 0, err
    code, out, err = run("ls", root, "--json", opts=opts)
    tags = {c["tag"]: c["tiers"] for c in json.loads(out)["checkpoints"]}
    assert [t for t, tiers in tags.items() if "persistent" in tiers] == ["global_step4"]


def test_a_malformed_storage_option_is_a_usage_error_that_echoes_nothing(
    no_azure_env: Azurite,
) -> None:
    # Catches: the offending text (often a key pasted without its name) shown in the error.
    code, out, err = run("ls", f"az://{CONTAINER}/x", opts=[KEY])
    assert code == 2 and "--storage-option" in err
    assert KEY not in out + err and KEY[:20] not in out + err
