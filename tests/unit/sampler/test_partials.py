"""Partial rollouts kept under resume handles (``workers.sampler.partials``)."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import numpy as np
import pytest

from treadle.common.engine.domain import (
    SampleOp,
    SampleResult,
    SamplerTarget,
    SamplingConfig,
    SequenceResult,
)
from treadle.errors import InvalidArgumentError, NotFoundError
from treadle.workers.sampler.backend import SampleJob
from treadle.workers.sampler.partials import PartialStore, gather, resume_op
from treadle.workers.sampler.state import (
    Partial,
    Row,
    TorchRequest,
    continued,
    partial_of,
    sequence_result,
)

OWNER = ("t1", "m")
#: tenant t1's sampler on model m: its partial rollouts are OWNER's
TARGET = SamplerTarget("base", "m", None, "t1")


def _row(tokens: list[int], prefix: Partial | None = None) -> Row:
    op = SampleOp(np.arange(3, 7), 1, SamplingConfig(max_tokens=8))
    job = SampleJob(Any, op, Any, TARGET)  # type: ignore[arg-type]
    req = TorchRequest(job, Future(), frozenset(), 0, op.prompt, prefix=prefix)
    row = Row(req, 0, 0, 0, Any)  # type: ignore[arg-type]
    row.tokens, row.logprobs, row.versions = tokens, [-0.5] * len(tokens), [2] * len(tokens)
    return row


def _part(tokens: list[int], prefix: Partial | None = None) -> Partial:
    return partial_of(_row(tokens, prefix=prefix))


def test_a_handle_resumes_once_and_only_for_its_owner() -> None:
    store = PartialStore()
    h = store.keep(_part([10, 11]))
    with pytest.raises(NotFoundError, match="not found"):
        store.take(("t2", "m"), [h])  # another tenant: as unknown
    with pytest.raises(NotFoundError, match="not found"):
        store.take(OWNER, [h, "rh-nope"])  # all or nothing: h is not consumed
    (part,) = store.take(OWNER, [h])
    assert part.tokens == [10, 11] and part.prompt.tolist() == [3, 4, 5, 6]
    with pytest.raises(NotFoundError):
        store.take(OWNER, [h])  # consumed
    store.give_back([h], [part])
    assert store.take(OWNER, [h]) == [part]


def test_bad_handle_lists_are_invalid() -> None:
    store = PartialStore()
    h = store.keep(_part([1]))
    with pytest.raises(InvalidArgumentError, match="resume_handles: give at least one"):
        store.take(OWNER, [])
    with pytest.raises(InvalidArgumentError, match="resume_handles: a handle is given twice"):
        store.take(OWNER, [h, h])


def test_a_resumed_row_keeps_its_earlier_parts_and_the_oldest_are_forgotten() -> None:
    store = PartialStore(limit=2)
    first = store.keep(_part([10, 11]))
    (part,) = store.take(OWNER, [first])
    again = store.keep(_part([12], prefix=part))
    (whole,) = store.take(OWNER, [again])
    assert whole.tokens == [10, 11, 12] and len(whole.logprobs) == len(whole.versions) == 3
    handles = [store.keep(_part([i])) for i in range(3)]
    with pytest.raises(NotFoundError):
        store.take(OWNER, [handles[0]])
    assert len(store) == 2


def test_resume_op_counts_the_whole_sequence() -> None:
    part = Partial(OWNER, np.arange(3, 7), [10, 11], [-1.0, -1.0], [0, 0])
    op = resume_op("rh-x", part, SamplingConfig(max_tokens=5, seed=3))
    assert op.prompt.tolist() == [3, 4, 5, 6, 10, 11] and op.params.max_tokens == 3
    with pytest.raises(InvalidArgumentError, match="max_tokens: counts the whole sequence"):
        resume_op("rh-x", part, SamplingConfig(max_tokens=2))


def _seq(t: int) -> SequenceResult:
    return SequenceResult(np.array([t]), np.array([-1.0], np.float32), "length", ((0, 1, 0),))


def test_gather_resolves_in_order_and_fails_as_a_whole() -> None:
    parts: list[Future[SampleResult]] = [Future(), Future()]
    out: Future[SampleResult] = Future()
    gather(parts, out, resumed=4)
    parts[1].set_result(SampleResult((_seq(2),), compute_s=1.0))
    assert not out.done()
    parts[0].set_result(SampleResult((_seq(1),), compute_s=0.5))
    res = out.result(0)
    assert [int(s.tokens[0]) for s in res.sequences] == [1, 2]
    assert (res.compute_s, res.resumed_tokens) == (1.5, 4)

    parts = [Future(), Future()]
    out = Future()
    gather(parts, out, resumed=0)
    parts[0].set_exception(InvalidArgumentError("top_p: bad"))
    with pytest.raises(InvalidArgumentError):
        out.result(0)
    assert parts[1].cancelled()


def test_a_continued_rollout_has_its_prefix_in_front_and_lists_of_its_own() -> None:
    prefix = Partial(OWNER, np.arange(3, 7), [10], [-1.0], [0])
    tokens, logprobs, versions = [11, 12], [-0.5, -0.25], [1, 1]
    whole = continued(prefix, OWNER, np.arange(9), tokens, logprobs, versions)
    assert whole.prompt is prefix.prompt  # the prompt the first part was sampled from
    assert (whole.tokens, whole.logprobs, whole.versions) == (
        [10, 11, 12],
        [-1, -0.5, -0.25],
        [0, 1, 1],
    )
    alone = continued(None, OWNER, np.arange(9), tokens, logprobs, versions)
    assert alone.prompt.tolist() == list(range(9)) and alone.tokens == tokens
    assert alone.tokens is not tokens and alone.versions is not versions
    seq = sequence_result(whole, "length", "rh-x")
    assert seq.tokens.tolist() == [10, 11, 12] and seq.tokens.dtype == np.int64
    assert seq.versions == ((0, 1, 0), (1, 2, 1))
    assert (seq.stop_reason, seq.resume_handle) == ("length", "rh-x")
