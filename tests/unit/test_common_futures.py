"""``treadle.common.futures``: settling a future once, and the error a failed step
reports."""

from __future__ import annotations

import logging
from concurrent.futures import Future

import pytest

from treadle.common.futures import outcome_of, settle
from treadle.errors import InternalError, InvalidArgumentError


def test_settle_resolves_a_pending_future_with_a_value_or_an_error() -> None:
    ok: Future[int] = Future()
    settle(ok, 3)
    assert ok.result() == 3
    failed: Future[int] = Future()
    settle(failed, InvalidArgumentError("data: empty"))
    with pytest.raises(InvalidArgumentError, match="data: empty"):
        failed.result()


def test_settle_leaves_a_done_future_as_it_is() -> None:
    cancelled: Future[int] = Future()
    cancelled.cancel()
    settle(cancelled, 1)
    assert cancelled.cancelled()
    first: Future[int] = Future()
    settle(first, 1)
    settle(first, InvalidArgumentError("late"))
    assert first.result() == 1


def test_outcome_of_passes_treadle_errors_and_wraps_bugs(caplog: pytest.LogCaptureFixture) -> None:
    log = logging.getLogger("treadle.test")
    assert outcome_of(lambda: 5, "step", log) == 5
    user_error = InvalidArgumentError("name: bad")

    def refuse() -> int:
        raise user_error

    assert outcome_of(refuse, "step", log) is user_error
    assert not caplog.records

    def bug() -> int:
        raise KeyError("k")

    with caplog.at_level(logging.ERROR, logger="treadle.test"):
        err = outcome_of(bug, "store", log)
    assert isinstance(err, InternalError)
    assert err.message == "store: KeyError: 'k'"
    assert "store failed" in caplog.text and "Traceback" in caplog.text
