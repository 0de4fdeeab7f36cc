"""Import boundaries: the CLI's --help stays light; the core never imports the CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import nebulaml
import nebulaml.ops
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
    # Catches: a name added to the package's namespace but not to __all__ (or the other
    # way), an operator function's older name that is a different object from nebulaml.ops's,
    # a public name without a docstring, torch_nebula drifting from nebulaml.
    import inspect

    public = {
        name
        for name, obj in vars(nebulaml).items()
        if not name.startswith("_") and not inspect.ismodule(obj)
    }
    aliases = set(nebulaml._OPS_ALIASES)
    assert public == set(nebulaml.__all__) - {"__version__", "ops"} | aliases
    assert nebulaml.ops is vars(nebulaml)["ops"] and "ops" in nebulaml.__all__
    for name in aliases:
        assert name in nebulaml.ops.__all__ and name not in nebulaml.__all__, name
        assert getattr(nebulaml, name) is getattr(nebulaml.ops, name), name
    for name in nebulaml.__all__:
        if name == "Checkpoint":  # DeepSpeed's: re-saving a tag replaces it
            assert issubclass(torch_nebula.Checkpoint, nebulaml.Checkpoint)
        elif name == "get_checkpoint":  # DeepSpeed's: warns when the tag is not there
            assert torch_nebula.get_checkpoint.__wrapped__ is nebulaml.get_checkpoint
        elif name == "init":  # DeepSpeed's: also reads the ds_config's "nebula" block
            assert torch_nebula.init.__wrapped__ is nebulaml.init
        else:
            assert getattr(torch_nebula, name) is getattr(nebulaml, name)
        obj = getattr(nebulaml, name)
        if callable(obj):
            assert obj.__doc__, f"{name} has no docstring"


def test_operator_functions_live_in_ops() -> None:
    # Catches: an operator function listed beside init again, a name of nebulaml.ops that
    # is not there or has no docstring, a submodule of ops that nebulaml.ops does not name.
    import inspect

    ops_all = set(nebulaml.ops.__all__)
    errors = {n for n in ops_all if isinstance(getattr(nebulaml.ops, n), type)
              and issubclass(getattr(nebulaml.ops, n), nebulaml.NebulaError)}  # fmt: skip
    assert errors == {"HistoryFormatError", "HistoryNotFoundError"}
    assert ops_all & set(nebulaml.__all__) == errors  # errors are found at the top too
    assert {"plan_prune", "execute_prune", "verify_checkpoints", "copy_checkpoint"} <= ops_all
    for name in nebulaml.ops.__all__:
        obj = getattr(nebulaml.ops, name)
        assert callable(obj) and obj.__doc__, f"nebulaml.ops.{name} has no docstring"
    public = {
        name
        for name, obj in vars(nebulaml.ops).items()
        if not name.startswith("_") and not inspect.ismodule(obj)
    }
    assert public == ops_all


# The CLI's rule (docs/architecture.md): it imports only the modules documented for users,
# and uses only their public names. Every other module of nebulaml is internal.
PUBLIC_MODULES = (
    "nebulaml",
    "nebulaml.ops",
    "nebulaml.dcp",
    "nebulaml.lightning",
    "nebulaml.pytorch_lightning",
    "nebulaml.transformers",
    "nebulaml.accelerate",
    "nebulaml.backends",
    "nebulaml.testing",
    "torch_nebula",
)
LIBRARY_PACKAGES = ("nebulaml", "torch_nebula")
CLI = Path(__file__).resolve().parents[1] / "nebula_cli"


def _public_names(module: str) -> set[str]:
    """What `module` offers the CLI: its __all__; for nebulaml also the integrations it
    resolves on first use and `ops`, but not the operator functions' older names (users
    keep them; the CLI calls nebulaml.ops's: `older_name`)."""
    import importlib

    if module == "nebulaml":
        return {*nebulaml.__all__, *nebulaml._LIGHTNING_NAMES, "dcp"}
    if module == "nebulaml.ops":
        return set(nebulaml.ops.__all__)
    if module == "torch_nebula":
        return set(torch_nebula.__all__)
    return set(importlib.import_module(module).__all__)


def older_name(module: str, name: str) -> str:
    """`module.name`, and where it is an operator function's older name in nebulaml's
    namespace (`nm.plan_prune`), the name to use instead (`nm.ops.plan_prune`)."""
    if module == "nebulaml" and name in nebulaml._OPS_ALIASES:
        return f"{module}.{name} (an older name: use nebulaml.ops.{name})"
    return f"{module}.{name}"


def private_uses(source: str, where: str) -> list[str]:
    """Each import of an internal module of nebulaml or torch_nebula in `source`, and each
    name used from a public module that is not one of its public names (an operator
    function's older name included: `older_name`): `file:line: what`."""
    import ast

    found = []
    bound: dict[str, str] = {}  # a local name -> the public module it stands for
    tree = ast.parse(source, where)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] not in LIBRARY_PACKAGES:
                    continue
                if alias.name not in PUBLIC_MODULES:
                    found.append(f"{where}:{node.lineno}: import {alias.name}")
                elif alias.asname:
                    bound[alias.asname] = alias.name
                else:
                    bound[alias.name.split(".")[0]] = alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            if node.module.split(".")[0] not in LIBRARY_PACKAGES:
                continue
            if node.module not in PUBLIC_MODULES:
                found.append(f"{where}:{node.lineno}: from {node.module} import ...")
                continue
            for alias in node.names:
                submodule = f"{node.module}.{alias.name}"
                if submodule in PUBLIC_MODULES:
                    bound[alias.asname or alias.name] = submodule
                elif alias.name not in _public_names(node.module):
                    found.append(f"{where}:{node.lineno}: {older_name(node.module, alias.name)}")
    for node in ast.walk(tree):
        # nm.X, nm.ops.X: X must be public in the module the name stands for.
        if isinstance(node, ast.Attribute):
            chain = [node.attr]
            value = node.value
            while isinstance(value, ast.Attribute):
                chain.append(value.attr)
                value = value.value
            if not isinstance(value, ast.Name) or value.id not in bound:
                continue
            module = bound[value.id]
            for attr in reversed(chain):
                if f"{module}.{attr}" in PUBLIC_MODULES:
                    module = f"{module}.{attr}"
                    continue
                if attr not in _public_names(module):
                    found.append(f"{where}:{node.lineno}: {older_name(module, attr)}")
                break
    return sorted(found, key=lambda f: int(f.split(":")[1]))


def test_the_cli_uses_only_public_modules_and_names() -> None:
    # Catches: the CLI importing an internal module (nebulaml.protocol.memory_tier,
    # nebulaml._version, nebulaml.ops.pruning), using a name nebulaml does not offer, or
    # an operator function's older name (nm.plan_prune: nm.ops.plan_prune is its home).
    found = []
    files = sorted(CLI.rglob("*.py"))
    assert len(files) > 10
    for path in files:
        found += private_uses(path.read_text(encoding="utf-8"), str(path.relative_to(CLI.parent)))
    assert not found, "nebula_cli uses internal modules or names:\n" + "\n".join(found)


def test_private_uses_finds_each_kind() -> None:
    # The check above must be able to fail: each way of reaching inside is reported.
    source = (
        "import nebulaml as nm\n"
        "from nebulaml._version import __version__\n"
        "from nebulaml.protocol.memory_tier import memory_base\n"
        "import nebulaml.runtime.session\n"
        "from nebulaml import api, ops, __version__, plan_prune\n"
        "from nebulaml.ops import PrunePlan, memory_base\n"
        "nm.check_root, nm.ops.plan_prune, nm.plan_prune, nm.api, nm.ops.pruning\n"
        "ops.advise_nothing\n"
    )
    assert private_uses(source, "x.py") == [
        "x.py:2: from nebulaml._version import ...",
        "x.py:3: from nebulaml.protocol.memory_tier import ...",
        "x.py:4: import nebulaml.runtime.session",
        "x.py:5: nebulaml.api",
        "x.py:5: nebulaml.plan_prune (an older name: use nebulaml.ops.plan_prune)",
        "x.py:6: nebulaml.ops.memory_base",
        "x.py:7: nebulaml.plan_prune (an older name: use nebulaml.ops.plan_prune)",
        "x.py:7: nebulaml.api",
        "x.py:7: nebulaml.ops.pruning",
        "x.py:8: nebulaml.ops.advise_nothing",
    ]
