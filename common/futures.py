"""Resolving a ``concurrent.futures.Future`` from a background thread.

Two steps written once: ``outcome_of`` runs a piece of work and turns what it
raised into the error its caller's future fails with (a ``TreadleError`` as it
is, since it already names what to fix; anything else is a bug, logged with its
traceback and reported as ``InternalError``, so the thread that ran it lives
on), and ``settle`` resolves a future with a value or an error unless something
else (a cancel, an earlier failure) resolved it first.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from typing import Any, TypeVar

from treadle.errors import InternalError, TreadleError

T = TypeVar("T")


def settle(fut: Future[Any], outcome: Any) -> None:
    """Resolve ``fut`` with ``outcome`` (an exception fails it) unless it is done."""
    if fut.done():
        return
    try:
        if isinstance(outcome, BaseException):
            fut.set_exception(outcome)
        else:
            fut.set_result(outcome)
    except InvalidStateError:
        pass  # resolved by another thread between the check and the set


def outcome_of(fn: Callable[[], T], what: str, log: logging.Logger) -> T | TreadleError:
    """``fn()``, or the error a future waiting on it should fail with."""
    try:
        return fn()
    except TreadleError as err:
        return err
    except Exception as err:  # a bug, not a user error: keep the calling thread alive
        log.error("%s failed: %s", what, err, exc_info=True)
        return InternalError(f"{what}: {type(err).__name__}: {err}")


def mapped(fut: Future[Any], fn: Callable[[Any], T]) -> Future[T]:
    """A future resolved with ``fn(result)`` of ``fut`` (or its error, or cancelled);
    cancelling it cancels ``fut`` (e.g. a sample's rows are freed)."""
    out: Future[T] = Future()
    out.add_done_callback(lambda o: fut.cancel() if o.cancelled() else None)

    def done(f: Future[Any]) -> None:
        if f.cancelled():
            out.cancel()
        elif (err := f.exception()) is not None:
            settle(out, err)
        else:
            settle(out, outcome_of(lambda: fn(f.result()), "result", _log))

    fut.add_done_callback(done)
    return out


_log = logging.getLogger("treadle")
