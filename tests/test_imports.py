"""Import boundaries: the CLI's --help stays light; the core never imports the CLI."""

from __future__ import annotations

import json
import subprocess
import sys

import nebulaml
import torch_nebula


def _modules_after(code: str) -> set[str]:
    out = subprocess.run(
        [sys.executable, "-c", f"{code}\nimport sys, json; print(json.dumps(sorted(sys.modules)))"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


def test_cli_help_imports_neither_torch_nor_pandas() -> None:
    code = (
        "import sys\n"
        "from nebula_cli.app import app\n"
        "try:\n"
        "    app(['--help'], standalone_mode=False)\n"
        "except SystemExit:\n"
        "    pass\n"
    )
    modules = _modules_after(code)
    assert "nebula_cli.app" in modules
    assert "torch" not in modules
    assert "pandas" not in modules


def test_core_imports_no_cli_framework() -> None:
    modules = _modules_after("import nebulaml, torch_nebula")
    assert not {"typer", "rich", "click", "nebula_cli"} & modules
    assert "torch" not in modules  # torch is imported when a checkpoint is written or read


def test_public_api_is_exactly_all() -> None:
    import inspect

    public = {
        name
        for name, obj in vars(nebulaml).items()
        if not name.startswith("_") and not inspect.ismodule(obj)
    }
    assert public == set(nebulaml.__all__) - {"__version__"}
    for name in nebulaml.__all__:
        if name == "Checkpoint":  # DeepSpeed's: re-saving a tag replaces it
            assert issubclass(torch_nebula.Checkpoint, nebulaml.Checkpoint)
        elif name == "get_checkpoint":  # DeepSpeed's: warns when the tag is not there
            assert torch_nebula.get_checkpoint.__wrapped__ is nebulaml.get_checkpoint
        else:
            assert getattr(torch_nebula, name) is getattr(nebulaml, name)
        obj = getattr(nebulaml, name)
        if callable(obj):
            assert obj.__doc__, f"{name} has no docstring"
