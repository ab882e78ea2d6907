"""Which pool worker keeps each partial rollout (``server.celery.pool_partials``): a
resume goes to the worker its handles came from; handles from no pool worker are
not routed (the colocated path answers them); handles kept on two workers, or on
one that is gone, are refused saying why; a successful resume forgets the handles
it consumed; the memory is bounded, oldest first."""

from __future__ import annotations

import numpy as np
import pytest

from treadle.common.engine.domain import SequenceResult
from treadle.errors import InvalidArgumentError, NotFoundError
from treadle.server.celery.pool_partials import KeptPartials


def seq(handle: str = "") -> SequenceResult:
    stop = "partial" if handle else "length"
    tokens = np.array([3, 4], np.int64)
    return SequenceResult(tokens, np.zeros(2, np.float32), stop, ((0, 2, 0),), handle)


def test_a_resume_goes_to_the_worker_that_keeps_its_handles() -> None:
    kept = KeptPartials()
    kept.note("w1", [seq("rh-a"), seq("rh-b"), seq()])
    kept.note("w2", [seq("rh-c")])
    assert len(kept) == 3  # a finished sequence has no handle
    assert kept.keeper(("rh-a", "rh-b"), {"w1", "w2"}) == "w1"
    assert kept.keeper(("rh-c",), {"w1", "w2"}) == "w2"
    # one handle the pool never saw beside pool ones: the keeper answers it (NOT_FOUND)
    assert kept.keeper(("rh-a", "rh-nope"), {"w1", "w2"}) == "w1"
    assert kept.keeper(("rh-nope",), {"w1", "w2"}) is None


def test_handles_on_two_workers_are_refused_naming_the_field() -> None:
    kept = KeptPartials()
    kept.note("w1", [seq("rh-a")])
    kept.note("w2", [seq("rh-c")])
    with pytest.raises(InvalidArgumentError, match="resume_handles: kept on 2 sampler workers"):
        kept.keeper(("rh-a", "rh-c"), {"w1", "w2"})


def test_handles_on_a_worker_that_is_gone_are_not_found_saying_why() -> None:
    kept = KeptPartials()
    kept.note("w1", [seq("rh-a")])
    kept.note("w2", [seq("rh-c")])
    with pytest.raises(
        NotFoundError, match="'rh-a' not found: .* sampler worker w1, which is gone"
    ):
        kept.keeper(("rh-c", "rh-a"), {"w2"})


def test_a_resume_consumes_its_handles_and_notes_the_new_ones() -> None:
    kept = KeptPartials()
    kept.note("w1", [seq("rh-a"), seq("rh-b")])
    kept.consumed(("rh-a", "rh-b"))
    kept.note("w1", [seq("rh-a2"), seq()])
    assert kept.keeper(("rh-a",), {"w1"}) is None
    assert kept.keeper(("rh-a2",), {"w1"}) == "w1"
    assert len(kept) == 1


def test_the_oldest_handles_are_forgotten_beyond_the_limit() -> None:
    kept = KeptPartials(limit=2)
    kept.note("w1", [seq("rh-1"), seq("rh-2")])
    kept.note("w2", [seq("rh-3")])
    assert len(kept) == 2
    assert kept.keeper(("rh-1",), {"w1", "w2"}) is None
    assert kept.keeper(("rh-2",), {"w1", "w2"}) == "w1"
    assert kept.keeper(("rh-3",), {"w1", "w2"}) == "w2"
