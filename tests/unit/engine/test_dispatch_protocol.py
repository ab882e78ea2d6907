"""Every dispatcher implements each of the small dispatch interfaces (mypy
cannot see across the package-dir mapping, so this checks it): the same
methods, the same parameters, async where the interface is async. A method
added to an interface later fails here until each dispatcher has it. The
engine-call interface holds no catalog, metrics or draining method, and the
server reaches those through their own interfaces, never the dispatcher."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

from treadle.server import dispatch
from treadle.server.celery.dispatch import CeleryDispatcher
from treadle.server.dispatch import (
    INTERFACES,
    Catalog,
    Dispatcher,
    Draining,
    EngineMetrics,
    InProcessDispatcher,
)


def _members(protocol: type) -> list[str]:
    return [
        name
        for name, fn in vars(protocol).items()
        if inspect.isfunction(fn) and not name.startswith("_")
    ]


@pytest.mark.parametrize("protocol", INTERFACES, ids=lambda p: p.__name__)
@pytest.mark.parametrize("impl", [InProcessDispatcher, CeleryDispatcher])
def test_implements_each_interface(impl: type, protocol: type) -> None:
    assert _members(protocol)
    for name in _members(protocol):
        want = getattr(protocol, name)
        have = getattr(impl, name, None)
        assert have is not None, f"{impl.__name__} lacks {protocol.__name__}.{name}"
        assert list(inspect.signature(have).parameters) == list(
            inspect.signature(want).parameters
        ), name
        assert inspect.iscoroutinefunction(have) == inspect.iscoroutinefunction(want), name


def test_the_interfaces_are_small_and_apart() -> None:
    members = {p: set(_members(p)) for p in INTERFACES}
    assert members[Catalog] == {"base_model_config", "base_model_path", "base_model_names"}
    assert members[EngineMetrics] == {"sampler_metrics", "pass_metrics", "engine_report"}
    assert members[Draining] == {"draining_models"}
    others = members[Catalog] | members[EngineMetrics] | members[Draining]
    assert not members[Dispatcher] & others
    assert len(members[Dispatcher]) <= 12


def test_callers_reach_catalog_metrics_and_draining_through_their_interface() -> None:
    server = Path(dispatch.__file__).parent
    narrow = "|".join(
        sorted(set(_members(Catalog)) | set(_members(EngineMetrics)) | set(_members(Draining)))
    )
    wrong = re.compile(rf"dispatcher\s*\.\s*({narrow})\b")
    found = [
        f"{path.relative_to(server)}:{n}: {line.strip()}"
        for path in sorted(server.rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if wrong.search(line)
    ]
    assert found == []
