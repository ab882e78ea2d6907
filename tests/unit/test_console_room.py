"""The console is a room of its own (docs/layout.md): only the HTTP app mounts it,
and it reaches the server through the service layer, the database queries and
the HTTP errors' status map, never a transport's servicers, Celery or an engine."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONSOLE = "treadle.server.console"
#: what the console must not import
FORBIDDEN = ("treadle.server.rpc", "treadle.server.celery", "treadle.workers", "torch", "grpc")


def _imports(path: Path) -> set[str]:
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return out


def test_only_the_http_app_imports_the_console() -> None:
    importers = {
        path.relative_to(ROOT).as_posix()
        for package in ("server", "workers", "common", "client_sdk")
        for path in (ROOT / package).rglob("*.py")
        if not path.is_relative_to(ROOT / "server" / "console")
        and any(m == CONSOLE or m.startswith(CONSOLE + ".") for m in _imports(path))
    }
    assert importers == {"server/http/app.py"}


def test_the_console_reaches_no_transport_or_engine() -> None:
    for path in (ROOT / "server" / "console").rglob("*.py"):
        for module in _imports(path):
            assert not module.startswith(FORBIDDEN), (path.name, module)
