"""The suite's own hygiene: a test that configures the root logger the way a
``treadle`` process does (``cli.main``) must not leave a handler on a stream
that closes with the test (``tests/conftest.py`` puts the root logger back).
The two tests run in this order: the second fails when the first's handler
survives it."""

from __future__ import annotations

import io
import logging

import pytest

from treadle.common.logs import configure_logging

STREAMS: list[io.StringIO] = []


def test_a_test_configures_logging_on_its_own_stderr(monkeypatch: pytest.MonkeyPatch) -> None:
    stream = io.StringIO()
    STREAMS.append(stream)
    monkeypatch.setattr("sys.stderr", stream)
    configure_logging("text")  # what cli.main does first
    logging.getLogger("treadle").warning("inside the test")
    assert "inside the test" in stream.getvalue()
    stream.close()  # as pytest closes a test's captured stream


def test_later_log_lines_find_no_closed_stream() -> None:
    assert STREAMS, "runs after the test above"
    streams = [getattr(h, "stream", None) for h in logging.getLogger().handlers]
    closed = [s for s in streams if isinstance(s, io.IOBase) and s.closed]
    assert closed == []
