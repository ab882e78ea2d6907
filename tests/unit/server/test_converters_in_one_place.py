"""Wire messages are built in the converter modules only.

Every module of the installed ``treadle`` distribution is parsed (none is
imported) and each call on a generated protobuf module (``x_pb2.Message(...)``,
``x_pb2.Enum.Value(...)``) is located: outside the modules whose job is the
conversion, such a call means a type is converted in a second place. Type
annotations, enum constants and descriptors are not calls and stay allowed.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

#: the modules that ARE converters between wire messages and the code's own types
CONVERTERS = {
    "treadle._convert",  # SDK types <-> requests and responses
    "treadle.wire.tensors",  # numpy arrays <-> the wire's Tensor
    "treadle.server.rpc.convert",  # server: wire <-> domain types
    "treadle.server.http.tinker_pb",  # the tinker HTTP API's message pool
}


def _sources() -> dict[str, Path]:
    """Module name -> source, for every module of the installed distribution
    (generated ``*_pb2*`` stubs aside)."""
    out: dict[str, Path] = {}
    names = ("treadle", "treadle.server", "treadle.workers", "treadle.common")
    roots = {}
    for name in names:
        spec = importlib.util.find_spec(name)
        assert spec is not None and spec.submodule_search_locations, name
        roots[name] = Path(next(iter(spec.submodule_search_locations))).resolve()
    for name, root in roots.items():
        for path in sorted(root.rglob("*.py")):
            if "_pb2" in path.name:
                continue
            parts = list(path.resolve().relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out.setdefault(".".join([name, *parts]), path)
    return out


def _root_name(node: ast.expr) -> str | None:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def pb2_calls(source: str) -> list[tuple[int, str]]:
    """(line, callee) of every call on a ``*_pb2`` module in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            root = _root_name(node.func)
            if root is not None and root.endswith("_pb2"):
                found.append((node.lineno, ast.unparse(node.func)))
    return sorted(found)


def test_the_walk_finds_builders_and_ignores_annotations() -> None:
    source = (
        "from treadle.v1 import training_pb2\n"
        "def f(r: training_pb2.ModelInfo) -> training_pb2.ModelInfo:\n"
        "    x = training_pb2.DESCRIPTOR\n"
        "    return training_pb2.ModelInfo(model_id=r.model_id)\n"
        "y = common_pb2.LossFn.Name(1)\n"
        "stub = training_pb2_grpc.TrainingServiceStub(None)\n"
    )
    assert pb2_calls(source) == [(4, "training_pb2.ModelInfo"), (5, "common_pb2.LossFn.Name")]


def test_wire_messages_are_built_in_the_converters_only() -> None:
    sources = _sources()
    assert set(sources) >= CONVERTERS, CONVERTERS - set(sources)
    assert "treadle.server.rpc.training_servicer" in sources and "treadle.service_client" in sources
    inline = [
        f"{module}:{line} {callee}(...)"
        for module, path in sources.items()
        if module not in CONVERTERS
        for line, callee in pb2_calls(path.read_text(encoding="utf-8"))
    ]
    assert not inline, "wire messages built outside the converters:\n  " + "\n  ".join(inline)
