"""A class name means one thing: no two modules of the SDK, server, workers and
common code define a class of the same name.

A name that says its layer keeps a reader from taking the service's answer for
the SDK's public type, or a scheduler's queue entry for the service's call
identity (issue 34: ``OrderedCall``, ``OrderedCalls``, ``ModelInfo``,
``CreateModel`` and ``Request`` each meant two things). The SDK's public names
(``treadle.ModelInfo``, ...) are the ones users know; the other side is renamed.
Generated protobuf code is left out: its names are the wire's.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("client_sdk", "server", "workers", "common")
GENERATED = ("client_sdk/v1/", "server/http/tinker_pb")


def class_names(sources: dict[str, str]) -> dict[str, list[str]]:
    """Each class name defined in more than one of ``sources`` (path -> text),
    with the paths that define it."""
    where: defaultdict[str, set[str]] = defaultdict(set)
    for path, text in sources.items():
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef):
                where[node.name].add(path)
    return {name: sorted(paths) for name, paths in where.items() if len(paths) > 1}


def _sources() -> dict[str, str]:
    out = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if not rel.startswith(GENERATED):
                out[rel] = path.read_text()
    return out


def test_the_check_finds_a_name_two_modules_define() -> None:
    clash = class_names(
        {
            "server/a.py": "class ModelInfo:\n    pass\n",
            "client_sdk/b.py": "def f():\n    class ModelInfo: ...\n",
            "workers/c.py": "class Other: ...\n",
        }
    )
    assert clash == {"ModelInfo": ["client_sdk/b.py", "server/a.py"]}


def test_no_class_name_is_defined_in_two_modules() -> None:
    sources = _sources()
    assert len(sources) > 100  # the tree was found
    clashes = class_names(sources)
    assert not clashes, (
        "class names defined in more than one module (rename the one that is not "
        f"the SDK's public type, so each name says its layer): {clashes}"
    )
