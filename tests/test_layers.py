"""The import direction of nebulaml's layers (docs/architecture.md), and no import cycle.

    base (errors, _version, _threads, config) < format < storage < protocol < runtime < ops
        < the public API (api, checkpoint) < integrations < the package's namespace (and
        nebulaml.backends, nebulaml.testing: the storage plugins' modules)

A module may import its own layer and the layers below it, never one above: storage never
knows what a checkpoint is, ops never reach into the public API, and nothing but the
integrations and the public modules built on them imports a training framework. Imports
under `if TYPE_CHECKING:` count too (they are a design dependency); a function-level import
counts as well. The test reads the source (ast), so it sees every import, run or not.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "core" / "nebulaml"

LAYERS = {
    "errors": 0,
    "_version": 0,
    "_threads": 0,
    "config": 0,
    "format": 1,
    "storage": 2,
    "protocol": 3,
    "runtime": 4,
    "ops": 5,
    "api": 6,
    "checkpoint": 6,
    "integrations": 7,
    "lightning": 7,
    "pytorch_lightning": 7,
    "transformers": 7,
    "accelerate": 7,
    "dcp": 7,
    "__init__": 8,  # the package's own namespace re-exports all of the above
    # Public modules for storage plugins, beside the namespace: nothing in the library
    # imports them (the backend seam and the backend contract).
    "backends": 8,
    "testing": 8,
}
# Third-party frameworks only the integrations (and the public modules on them) import.
FRAMEWORKS = ("lightning", "pytorch_lightning", "deepspeed", "transformers", "accelerate")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def layer_of(name: str) -> int:
    """The layer of module `nebulaml.X...` (by X); `nebulaml` itself is the top."""
    parts = name.split(".")
    key = parts[1] if len(parts) > 1 else "__init__"
    if key not in LAYERS:
        raise AssertionError(f"{name}: in no layer; add it to LAYERS and the architecture page")
    return LAYERS[key]


def imports_of(path: Path, known: dict[str, Path]) -> Iterator[tuple[int, str]]:
    """(line, module) for every nebulaml module `path` imports, resolved to the module
    file it names (`from nebulaml.storage import store` is nebulaml.storage.store)."""
    this = module_name(path)
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "nebulaml":
                    yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = this.split(".")
                if path.name != "__init__.py":
                    base = base[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            if target.split(".")[0] != "nebulaml":
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                yield node.lineno, sub if sub in known else target


def framework_imports(path: Path) -> Iterator[tuple[int, str]]:
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names = [node.module]
        for name in names:
            if name.split(".")[0] in FRAMEWORKS:
                yield node.lineno, name


def test_every_module_is_in_a_layer() -> None:
    for name in modules():
        layer_of(name)


def test_no_module_imports_a_layer_above_its_own() -> None:
    known = modules()
    breaches = []
    for name, path in known.items():
        mine = layer_of(name)
        for line, target in imports_of(path, known):
            if layer_of(target) > mine:
                breaches.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {name} -> {target}")
    assert breaches == []


def test_only_the_integrations_import_a_framework() -> None:
    breaches = []
    for name, path in modules().items():
        if layer_of(name) == LAYERS["integrations"]:
            continue
        for line, target in framework_imports(path):
            breaches.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {name} -> {target}")
    assert breaches == []


def test_there_is_no_import_cycle() -> None:
    known = modules()
    graph = {
        name: sorted({t for _, t in imports_of(path, known) if t in known and t != name})
        for name, path in known.items()
    }
    # A package's __init__ that re-exports its modules is imported *through*: an edge to
    # nebulaml.storage from inside nebulaml.storage is not a cycle of design.
    cycles: list[list[str]] = []
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in graph[node]:
            if nxt == "nebulaml" or (nxt + ".") in node + ".":
                continue  # the package itself, or a package this module is inside
            if state.get(nxt) == 1:
                cycles.append([*stack[stack.index(nxt) :], nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name)
    assert cycles == []


@pytest.mark.parametrize("name", ["nebulaml.protocol.catalog", "nebulaml.storage.store"])
def test_the_checker_sees_imports(name: str) -> None:
    # catches: a resolver that finds no imports at all (every check above would pass)
    known = modules()
    assert list(imports_of(known[name], known)) != []
