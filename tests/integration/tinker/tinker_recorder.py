"""pytest plugin: which public methods of the tinker SDK's clients the tests call,
and whether the tests that call them pass (``scripts/tinker_compat.py`` runs the
tinker tests with ``-p tests.integration.tinker.tinker_recorder`` and turns the record
into docs/tinker-compat.md).

Only calls the test itself makes count (the main thread, outermost call): a
method the SDK calls from inside another one, or on its own event-loop thread,
is not credited. The record goes to ``$TREADLE_TINKER_RECORD`` as JSON:
``{"Class.method": {"passed": [test ids], "failed": [test ids]}}``.
"""

from __future__ import annotations

import functools
import inspect
import json
import os
import threading
from collections.abc import Callable
from typing import Any

import pytest

CLASSES = ("ServiceClient", "TrainingClient", "SamplingClient", "RestClient")
_called: set[str] = set()
_depth = threading.local()
_record: dict[str, dict[str, list[str]]] = {}
#: every test's outcome (a test passes when setup, call and teardown all pass)
TESTS = "__tests__"


def public_methods(cls: type) -> list[str]:
    return sorted(
        name
        for name, value in inspect.getmembers(cls)
        if not name.startswith("_") and callable(value)
    )


def _wrap(label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        outermost = getattr(_depth, "n", 0) == 0
        if outermost and threading.current_thread() is threading.main_thread():
            _called.add(label)
        _depth.n = getattr(_depth, "n", 0) + 1
        try:
            return fn(*args, **kwargs)
        finally:
            _depth.n -= 1

    return wrapper


def pytest_configure(config: pytest.Config) -> None:
    import tinker

    for cls_name in CLASSES:
        cls = getattr(tinker, cls_name)
        for name in public_methods(cls):
            raw = inspect.getattr_static(cls, name)
            label = f"{cls_name}.{name}"
            if isinstance(raw, staticmethod):
                setattr(cls, name, staticmethod(_wrap(label, raw.__func__)))
            elif isinstance(raw, classmethod):
                setattr(cls, name, classmethod(_wrap(label, raw.__func__)))
            elif inspect.isfunction(raw):
                setattr(cls, name, _wrap(label, raw))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    outcome = "passed" if report.passed else "failed" if report.failed else None
    tests = _record.setdefault(TESTS, {"passed": [], "failed": []})
    if report.when == "call" and report.passed:
        tests["passed"].append(report.nodeid)
    elif report.failed:
        tests["failed"].append(report.nodeid)
    if outcome is not None:
        for label in _called:
            _record.setdefault(label, {"passed": [], "failed": []})[outcome].append(report.nodeid)
    _called.clear()


def pytest_sessionfinish(session: pytest.Session) -> None:
    path = os.environ.get("TREADLE_TINKER_RECORD")
    if path:
        with open(path, "w") as f:
            json.dump(_record, f, indent=1, sort_keys=True)
