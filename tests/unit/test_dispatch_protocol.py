"""Every dispatcher implements the whole ``Dispatcher`` protocol (mypy cannot see
across the package-dir mapping, so this checks it): the same methods, the same
parameters, async where the protocol is async. A method added to the protocol
later fails here until each dispatcher has it."""

from __future__ import annotations

import inspect

import pytest

from treadle.server.celery_dispatch import CeleryDispatcher
from treadle.server.dispatch import Dispatcher, InProcessDispatcher


def _members() -> list[str]:
    return [
        name
        for name, fn in vars(Dispatcher).items()
        if inspect.isfunction(fn) and not name.startswith("_")
    ]


@pytest.mark.parametrize("impl", [InProcessDispatcher, CeleryDispatcher])
def test_implements_the_protocol(impl: type) -> None:
    assert _members()
    for name in _members():
        want = getattr(Dispatcher, name)
        have = getattr(impl, name, None)
        assert have is not None, f"{impl.__name__} lacks {name}"
        assert list(inspect.signature(have).parameters) == list(
            inspect.signature(want).parameters
        ), name
        assert inspect.iscoroutinefunction(have) == inspect.iscoroutinefunction(want), name
