"""The import directions between the installed packages hold.

Every module of the installed ``treadle`` distribution is parsed (no module is
imported), its imports resolved (relative ones against its package), and each
arrow checked against the layering:

- the SDK (``treadle``, ``treadle.v1``, ``treadle.rl``) imports none of server,
  workers, common;
- ``treadle.common`` (what server and workers both need) imports neither;
- workers never import the server;
- server, workers and common import no private module of the SDK (``treadle._*``):
  what they share with it is public (``treadle.wire``), so the SDK's insides can
  change without breaking the server;
- what importing the engine runs (module-level imports, transitively) reaches
  no database, object store, Celery or gRPC server library, so an engine
  imports with torch, transformers, safetensors and tokenizers alone;
- the server reaches an engine only through the engine contract
  (``treadle.common.engine``): no server module imports ``treadle.workers``
  but the start-up modules, where an engine is built (``STARTUP``);
- the engine contract imports neither torch nor any server library, at import
  time or later.

The first three rules count every import, also those inside functions and
under ``TYPE_CHECKING``; the engine rule counts what runs at import time.
"""

from __future__ import annotations

import ast
import importlib.util
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

#: top-level packages of the distribution; the SDK is every other ``treadle.*``
LAYERS = ("treadle.server", "treadle.workers", "treadle.common", "treadle.migrations")

#: (importer layer, imported layer) arrows that run the wrong way
FORBIDDEN = {
    ("sdk", "treadle.server"),
    ("sdk", "treadle.workers"),
    ("sdk", "treadle.common"),
    ("sdk", "treadle.migrations"),
    ("treadle.common", "treadle.server"),
    ("treadle.common", "treadle.workers"),
    ("treadle.workers", "treadle.server"),
}

#: the server's start-up modules: the only ones that may import treadle.workers
STARTUP = (
    "treadle.server.app",
    "treadle.server.cli",
    "treadle.server.config",
    "treadle.server.demo",
)

#: the torch-free engine contract, below server and workers
CONTRACT = "treadle.common.engine"

#: what the engine contract must not import (module names and their submodules)
CONTRACT_MUST_NOT_IMPORT = (
    "torch",
    "transformers",
    "safetensors",
    "vllm",
    "sqlalchemy",
    "alembic",
    "psycopg",
    "boto3",
    "celery",
    "kombu",
    "grpc",
    "fastapi",
    "uvicorn",
    "treadle.server",
    "treadle.workers",
    "treadle.common.db",
    "treadle.common.s3_store",
)

#: where importing the engine starts
ENGINE_ROOTS = ("treadle.workers.engine.loop",)

#: what the engine's import path must not reach (module names and their submodules)
ENGINE_MUST_NOT_REACH = (
    "sqlalchemy",
    "alembic",
    "psycopg",
    "boto3",
    "botocore",
    "celery",
    "kombu",
    "grpc_health",
    "grpc_reflection",
    "treadle.server",
    "treadle.common.db",
    "treadle.common.s3_store",
)


@dataclass(frozen=True)
class Arrow:
    importer: str
    imported: str
    line: int
    at_import_time: bool

    def __str__(self) -> str:
        when = "" if self.at_import_time else " (lazy or TYPE_CHECKING)"
        return f"{self.importer}:{self.line} -> {self.imported}{when}"


def _package_dirs() -> dict[str, Path]:
    """Installed package name -> its directory (editable and regular installs alike)."""
    dirs: dict[str, Path] = {}
    for name in ("treadle", *LAYERS):
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.submodule_search_locations:
            continue
        dirs[name] = Path(next(iter(spec.submodule_search_locations)))
    return dirs


def _modules() -> dict[str, tuple[Path, bool]]:
    """Module name -> (source file, is a package)."""
    dirs = _package_dirs()
    nested = {d.resolve() for name, d in dirs.items() if name != "treadle"}
    found: dict[str, tuple[Path, bool]] = {}
    for pkg, root in dirs.items():
        for path in sorted(root.rglob("*.py")):
            if pkg == "treadle" and any(p.resolve() in nested for p in path.parents):
                continue  # a layer folder that happens to sit inside client_sdk/
            parts = list(path.relative_to(root).with_suffix("").parts)
            is_pkg = parts[-1] == "__init__"
            if is_pkg:
                parts = parts[:-1]
            found[".".join([pkg, *parts])] = (path, is_pkg)
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.Module) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool]]:
    """Every import statement, and whether it runs when the module is imported."""

    def walk(node: ast.AST, eager: bool) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import | ast.ImportFrom):
                yield child, eager
            elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
                yield from walk(child, False)
            elif isinstance(child, ast.If) and _is_type_checking(child.test):
                for stmt in child.body:
                    yield from walk(ast.Module(body=[stmt], type_ignores=[]), False)
                for stmt in child.orelse:
                    yield from walk(ast.Module(body=[stmt], type_ignores=[]), eager)
            else:
                yield from walk(child, eager)

    yield from walk(tree, True)


def _resolve(module: str, is_pkg: bool, node: ast.Import | ast.ImportFrom) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if node.level:
        package = module if is_pkg else module.rpartition(".")[0]
        for _ in range(node.level - 1):
            package = package.rpartition(".")[0]
        base = f"{package}.{node.module}" if node.module else package
    else:
        base = node.module or ""
    # ``from pkg import name`` imports the submodule pkg.name when there is one
    return [base, *(f"{base}.{alias.name}" for alias in node.names if alias.name != "*")]


def _graph() -> tuple[dict[str, tuple[Path, bool]], list[Arrow]]:
    modules = _modules()
    arrows = []
    for name, (path, is_pkg) in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node, eager in _imports(tree):
            for target in _resolve(name, is_pkg, node):
                if target.startswith("treadle") and target not in modules:
                    continue  # a name imported from a module, not a module
                arrows.append(Arrow(name, target, node.lineno, eager))
    return modules, arrows


def _layer(module: str) -> str:
    for layer in LAYERS:
        if module == layer or module.startswith(layer + "."):
            return layer
    return "sdk" if module == "treadle" or module.startswith("treadle.") else "external"


def _within(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def _parents(module: str) -> list[str]:
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


@pytest.fixture(scope="module")
def graph() -> tuple[dict[str, tuple[Path, bool]], list[Arrow]]:
    return _graph()


def test_the_graph_covers_every_layer(
    graph: tuple[dict[str, tuple[Path, bool]], list[Arrow]],
) -> None:
    modules, arrows = graph
    layers = {_layer(m) for m in modules}
    assert {"sdk", "treadle.server", "treadle.workers"} <= layers
    assert "treadle.workers.engine.loop" in modules
    # relative imports resolve: the engine package's own modules appear as targets
    assert any(
        a.importer.startswith("treadle.server.db") and a.imported.startswith("treadle.")
        for a in arrows
    )


def test_no_import_runs_against_the_layering(
    graph: tuple[dict[str, tuple[Path, bool]], list[Arrow]],
) -> None:
    _, arrows = graph
    wrong = [str(a) for a in arrows if (_layer(a.importer), _layer(a.imported)) in FORBIDDEN]
    assert not wrong, "imports that run the wrong way:\n  " + "\n  ".join(sorted(set(wrong)))


def _sdk_private(module: str) -> bool:
    return _layer(module) == "sdk" and any(p.startswith("_") for p in module.split(".")[1:])


def test_no_layer_below_or_beside_the_sdk_imports_its_private_modules(
    graph: tuple[dict[str, tuple[Path, bool]], list[Arrow]],
) -> None:
    _, arrows = graph
    private = [str(a) for a in arrows if _layer(a.importer) != "sdk" and _sdk_private(a.imported)]
    assert not private, "private SDK modules imported outside the SDK:\n  " + "\n  ".join(
        sorted(set(private))
    )


def test_the_engine_imports_without_server_libraries(
    graph: tuple[dict[str, tuple[Path, bool]], list[Arrow]],
) -> None:
    modules, arrows = graph
    eager: dict[str, list[Arrow]] = {}
    for a in arrows:
        if a.at_import_time:
            eager.setdefault(a.importer, []).append(a)
    # breadth-first over what importing the engine runs; importing a.b.c runs a and a.b too
    via: dict[str, Arrow | None] = {root: None for root in ENGINE_ROOTS}
    todo = list(ENGINE_ROOTS)
    while todo:
        module = todo.pop()
        for target_arrow in eager.get(module, []):
            for target in [*_parents(target_arrow.imported), target_arrow.imported]:
                if target not in via:
                    via[target] = target_arrow
                    if target in modules:
                        todo.append(target)
    reached = sorted(m for m in via if _within(m, ENGINE_MUST_NOT_REACH))

    def chain(module: str) -> str:
        links = []
        while (arrow := via.get(module)) is not None:
            links.append(str(arrow))
            module = arrow.importer
        return " <- ".join(links)

    assert not reached, "the engine's import path reaches:\n  " + "\n  ".join(
        f"{m}: {chain(m)}" for m in reached
    )


def test_the_server_reaches_engines_only_through_the_contract(
    graph: tuple[dict[str, tuple[Path, bool]], list[Arrow]],
) -> None:
    _, arrows = graph
    wrong = [
        str(a)
        for a in arrows
        if _layer(a.importer) == "treadle.server"
        and not _within(a.importer, STARTUP)
        and _layer(a.imported) == "treadle.workers"
    ]
    assert not wrong, (
        "server modules other than the start-up ones import the engine (use "
        "treadle.common.engine):\n  " + "\n  ".join(sorted(set(wrong)))
    )


def test_the_engine_contract_needs_neither_torch_nor_server_libraries(
    graph: tuple[dict[str, tuple[Path, bool]], list[Arrow]],
) -> None:
    modules, arrows = graph
    assert any(_within(m, (CONTRACT,)) for m in modules)
    wrong = [
        str(a)
        for a in arrows
        if _within(a.importer, (CONTRACT,)) and _within(a.imported, CONTRACT_MUST_NOT_IMPORT)
    ]
    assert not wrong, "the engine contract imports:\n  " + "\n  ".join(sorted(set(wrong)))


def test_importing_the_engine_contract_loads_no_torch() -> None:
    """The same, for real: a fresh interpreter imports every contract module."""
    import subprocess
    import sys

    names = sorted(m for m in _modules() if _within(m, (CONTRACT,)))
    code = (
        "import sys\n"
        + "".join(f"import {m}\n" for m in names)
        + "bad = sorted({m.split('.')[0] for m in sys.modules} & "
        + repr({m.split(".")[0] for m in CONTRACT_MUST_NOT_IMPORT if "." not in m})
        + ")\nprint(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"importing {CONTRACT} loaded: {out.stdout.strip()}"
