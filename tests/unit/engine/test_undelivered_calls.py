"""The SDK's ordered calls when one fails UNAVAILABLE (``treadle._ordering``): it
may never have reached the model, and the calls after it would wait for it
there, so it is sent again, with its own seq_id and payload, before the next
ordered call. Pure: a fake caller stands for the server."""

from __future__ import annotations

import time
from concurrent.futures import Future
from typing import Any

import pytest

from treadle import _ordering
from treadle._ordering import OrderedCalls
from treadle.errors import AbortedError, UnavailableError
from treadle.wire.metadata import FIRST_PENDING_KEY


class Request:
    def __init__(self, seq_id: int, payload: str) -> None:
        self.seq_id, self.payload = seq_id, payload

    def ByteSize(self) -> int:  # noqa: N802 - the protobuf name
        return len(self.payload)


class FakeCaller:
    """Records each call sent; the test settles their futures."""

    server_instance = "srv-1"

    def __init__(self) -> None:
        self.sent: list[tuple[int, str, dict[str, str]]] = []
        self.futures: list[Future[Any]] = []

    def call(self, method: Any, request: Request, convert: Any, **kw: Any) -> Future[Any]:
        md = dict(kw["extra_metadata"]()) if kw.get("extra_metadata") else {}
        self.sent.append((request.seq_id, request.payload, md))
        fut: Future[Any] = Future()
        self.futures.append(fut)
        return fut


def _send(calls: OrderedCalls, payload: str) -> Future[Any]:
    return calls.send("method", Request(calls.take(), payload), lambda r: r)


def test_a_call_failed_unavailable_is_sent_again_before_the_next_one() -> None:
    caller = FakeCaller()
    calls = OrderedCalls(caller, "m", 5)  # type: ignore[arg-type]
    first = _send(calls, "fb-5")
    caller.futures[0].set_exception(UnavailableError("broker down"))
    assert isinstance(first.exception(), UnavailableError)  # its caller hears at once

    nxt = _send(calls, "optim-6")
    assert [(s, p) for s, p, _ in caller.sent] == [(5, "fb-5"), (5, "fb-5"), (6, "optim-6")]
    # the next call says 5 is still pending: a restarted server sees no lost gap
    assert caller.sent[2][2][FIRST_PENDING_KEY] == "5"
    caller.futures[1].set_result("fb answered")
    caller.futures[2].set_result("step")
    assert nxt.result() == "step"

    _send(calls, "fb-7")  # sent once: nothing is left to send again
    assert [s for s, _, _ in caller.sent] == [5, 5, 6, 7]


def test_a_repeat_that_fails_unavailable_again_waits_for_the_next_call() -> None:
    caller = FakeCaller()
    calls = OrderedCalls(caller, "m", 1)  # type: ignore[arg-type]
    _send(calls, "a")
    caller.futures[0].set_exception(UnavailableError("down"))
    _send(calls, "b")  # sends 1 again, then 2; both fail: the broker is still down
    caller.futures[1].set_exception(UnavailableError("down"))
    caller.futures[2].set_exception(UnavailableError("down"))
    _send(calls, "c")
    assert [s for s, _, _ in caller.sent] == [1, 1, 2, 1, 2, 3]


def test_a_call_that_later_calls_wait_for_is_sent_again_without_a_next_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The repeat of 1 fails again (the database was still down) just after 2 got
    through: 2 waits for 1 on the server, and its caller waits for 2, so there is
    no next call to carry 1. It is sent again on its own, until it lands."""
    monkeypatch.setattr(_ordering, "RESEND_AFTER_S", 0.01)
    caller = FakeCaller()
    calls = OrderedCalls(caller, "m", 1)  # type: ignore[arg-type]
    _send(calls, "a")
    caller.futures[0].set_exception(UnavailableError("down"))
    second = _send(calls, "b")  # sends 1 again, then 2
    caller.futures[1].set_exception(UnavailableError("still down"))  # 2 is on its way
    deadline = time.monotonic() + 10
    while len(caller.sent) < 4:
        assert time.monotonic() < deadline, caller.sent
        time.sleep(0.01)
    assert [(s, p) for s, p, _ in caller.sent] == [(1, "a"), (1, "a"), (2, "b"), (1, "a")]
    caller.futures[3].set_result("a answered")
    caller.futures[2].set_result("b answered")
    assert second.result() == "b answered"
    time.sleep(0.1)  # nothing is pending or undelivered: nothing more is sent
    assert len(caller.sent) == 4


def test_no_resend_without_a_later_call_waiting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_ordering, "RESEND_AFTER_S", 0.01)
    caller = FakeCaller()
    calls = OrderedCalls(caller, "m", 1)  # type: ignore[arg-type]
    _send(calls, "a")
    caller.futures[0].set_exception(UnavailableError("down"))
    time.sleep(0.1)  # its caller has the error; it waits for the next call
    assert len(caller.sent) == 1


def test_other_errors_and_resync_send_nothing_again() -> None:
    caller = FakeCaller()
    calls = OrderedCalls(caller, "m", 1)  # type: ignore[arg-type]
    _send(calls, "a")
    _send(calls, "b")
    caller.futures[0].set_exception(AbortedError("model lost"))  # it reached the model
    caller.futures[1].set_exception(UnavailableError("down"))
    calls.reset(9)  # resync: the old numbering is dropped, its failed calls too
    _send(calls, "c")
    assert [s for s, _, _ in caller.sent] == [1, 2, 9]
