"""The import graph of hermes_core, hermes_plugins and hermes_hookspecs: no cycles, and a core that
imports no plugin.

The graph is read from the source (AST), ``if TYPE_CHECKING:`` blocks left out. Module-level
imports must form no cycle. A deferred import (inside a function) may close a cycle only where
:data:`DEFERRED_CYCLE_EDGES` says why. The one core module that imports ``hermes_plugins`` is the
plugin manager, and it imports only the package itself (``BUILTIN_PLUGINS``, plain data: the
package imports nothing), never a plugin module.
"""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from collections.abc import Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {
    "hermes_core": ROOT / "hermes_core",
    "hermes_plugins": ROOT / "hermes_plugins",
    "hermes_hookspecs": ROOT / "hookspecs",
}
CORE_MAY_IMPORT_PLUGINS = {("hermes_core.plugins.manager", "hermes_plugins")}
"""The one allowed exception: the manager registers the built-ins listed by the package."""
DEFERRED_CYCLE_EDGES = {
    ("hermes_core.domain.models", "hermes_core.plugins.manager"): (
        "plugins=None means the process's default plugin manager, resolved when called; the "
        "manager's records (specs) describe the models"
    ),
}
"""Deferred imports allowed to close a cycle, with the reason."""


@dataclass(frozen=True)
class Edge:
    importer: str
    imported: str
    deferred: bool


def _modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for package, folder in PACKAGES.items():
        for path in sorted(folder.rglob("*.py")):
            parts = [package, *path.relative_to(folder).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(module: str, path: Path, known: Iterable[str]) -> Iterator[Edge]:
    """The first-party modules ``module`` imports at run time."""
    names = set(known)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]

    def targets(node: ast.Import | ast.ImportFrom) -> Iterator[str]:
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
            return
        base = node.module or ""
        if node.level:
            parent = package.split(".")[: len(package.split(".")) - node.level + 1]
            base = ".".join([*parent, base] if base else parent)
        for alias in node.names:
            submodule = f"{base}.{alias.name}"
            yield submodule if submodule in names else base

    def visit(node: ast.AST, deferred: bool) -> Iterator[Edge]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for other in child.orelse:
                    yield from visit(other, deferred)
                continue
            inner = deferred or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                for target in targets(child):
                    if target in names:
                        yield Edge(module, target, inner)
            yield from visit(child, inner)

    yield from visit(ast.parse(path.read_text(encoding="utf-8")), False)


def import_graph() -> dict[str, set[Edge]]:
    modules = _modules()
    return {module: set(_imports(module, path, modules)) for module, path in modules.items()}


def find_cycle(graph: Mapping[str, Iterable[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a path that starts and ends on the same module, or None."""
    state: dict[str, str] = {}
    path: list[str] = []

    def walk(node: str) -> list[str] | None:
        state[node] = "open"
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (cycle := walk(nxt)) is not None:
                return cycle
        state[node] = "done"
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := walk(node)) is not None:
            return cycle
    return None


def dependency_order(graph: Mapping[str, Iterable[str]]) -> list[str]:
    """Modules with every module they import (module level) before them."""
    order: list[str] = []
    seen: set[str] = set()

    def visit(node: str) -> None:
        if node in seen:
            return
        seen.add(node)
        for nxt in sorted(graph.get(node, ())):
            visit(nxt)
        order.append(node)

    for node in sorted(graph):
        visit(node)
    return order


def _module_level(graph: Mapping[str, set[Edge]]) -> dict[str, set[str]]:
    return {m: {e.imported for e in edges if not e.deferred} for m, edges in graph.items()}


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    assert dependency_order({"a": {"b"}, "b": {"c"}, "c": set()}) == ["c", "b", "a"]


def test_the_graph_sees_deferred_and_type_checking_imports(tmp_path: Path) -> None:
    source = tmp_path / "mod.py"
    source.write_text(
        "from typing import TYPE_CHECKING\nimport x.a\nif TYPE_CHECKING:\n    import x.b\n"
        "def f():\n    from x import c\n",
        encoding="utf-8",
    )
    edges = set(_imports("x.mod", source, ["x", "x.a", "x.b", "x.c"]))
    assert edges == {Edge("x.mod", "x.a", False), Edge("x.mod", "x.c", True)}


def test_module_level_imports_form_no_cycle() -> None:
    assert find_cycle(_module_level(import_graph())) is None


@pytest.mark.slow
def test_deferred_imports_close_no_undeclared_cycle() -> None:
    graph = import_graph()
    runtime = {
        module: {
            e.imported
            for e in edges
            if not e.deferred or (e.importer, e.imported) not in DEFERRED_CYCLE_EDGES
        }
        for module, edges in graph.items()
    }
    assert find_cycle(runtime) is None
    for importer, imported in DEFERRED_CYCLE_EDGES:  # each exception is still needed
        assert Edge(importer, imported, True) in graph[importer]


def test_core_imports_no_plugin_module() -> None:
    graph = import_graph()
    core_to_plugins = {
        (e.importer, e.imported)
        for module, edges in graph.items()
        if module.startswith("hermes_core")
        for e in edges
        if e.imported.startswith("hermes_plugins")
    }
    assert core_to_plugins == CORE_MAY_IMPORT_PLUGINS
    assert graph["hermes_plugins"] == set()  # the list of built-ins imports nothing


SERVE_EXTRA = ("httpx", "starlette", "uvicorn", "prometheus_client")


def test_embedding_the_core_needs_nothing_of_the_serve_extra(tmp_path: Path) -> None:
    """The core, every built-in plugin's registration (connectors included) and the command
    line load without the serve extra's packages: embedding needs none of them."""
    script = (
        "import sys, hermes_core\n"
        "from hermes_core import GatewayConfig, create_plugin_manager, Gateway\n"
        "from hermes_core.cli.main import _parser\n"
        f"config = GatewayConfig.from_dict({{}}, environ={{'HERMES_HOME': {str(tmp_path)!r}}})\n"
        "plugins = create_plugin_manager(config)\n"
        "plugins.connectors(); plugins.platforms(); _parser()\n"
        f"print(sorted(m for m in {SERVE_EXTRA!r} if m in sys.modules))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, cwd=ROOT
    )
    assert result.stdout.strip() == "[]"


def _import_alone(module: str) -> tuple[str, str]:
    result = subprocess.run(
        [sys.executable, "-c", f"import {module}"],
        capture_output=True, text=True, check=False, cwd=ROOT,
    )  # fmt: skip
    return module, result.stderr.strip().splitlines()[-1] if result.returncode else ""


@pytest.mark.slow
def test_every_module_imports_first_in_a_fresh_interpreter() -> None:
    """Each module imported first in its own interpreter, in dependency order: an import cycle
    that only bites when a particular module comes first shows up here."""
    order = dependency_order(_module_level(import_graph()))
    with ThreadPoolExecutor(max_workers=2) as pool:
        failures = {module: error for module, error in pool.map(_import_alone, order) if error}
    assert failures == {}


def test_every_package_is_shipped() -> None:
    """A package missing from pyproject's list works in a checkout and is absent when installed
    (an ``operations`` package once failed CI that way)."""
    tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11")
    listed = set(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )
    found = {
        ".".join((name, *init.parent.relative_to(folder).parts))
        for name, folder in PACKAGES.items()
        for init in folder.rglob("__init__.py")
    }
    assert found == listed


LONG_MODULE_LINES = 400


def test_a_long_module_says_why_at_its_top() -> None:
    """A module over about 400 lines keeps its size only for a reason written in its docstring
    (its parts are read together); anything else is split."""
    unexplained = []
    for folder in PACKAGES.values():
        for path in folder.rglob("*.py"):
            text = path.read_text(encoding="utf-8")
            if text.count("\n") <= LONG_MODULE_LINES:
                continue
            doc = ast.get_docstring(ast.parse(text)) or ""
            if "on purpose" not in doc and "stays in one class" not in doc:
                unexplained.append(str(path.relative_to(ROOT)))
    assert unexplained == []


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("hermes_core.errors", "hermes_core.domain.errors"),
        ("hermes_core.keys", "hermes_core.domain.keys"),
        ("hermes_core.cache", "hermes_core.gateway.cache"),
        ("hermes_core.text", "hermes_core.domain.text"),
    ],
)
def test_an_import_path_the_docs_published_still_works(old: str, new: str) -> None:
    """The modules that earlier docs told users to import from moved into subpackages; their old
    paths name the same objects."""
    shim = importlib.import_module(old)
    home = importlib.import_module(new)
    assert shim.__all__
    for name in shim.__all__:
        assert getattr(shim, name) is getattr(home, name), name
