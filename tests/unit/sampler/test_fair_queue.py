"""The torch sampler's queue: tenants take turns by tokens, each tenant's own
requests keep their order (``workers.sampler.fair_queue``)."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import numpy as np

from treadle.common.engine.domain import SampleOp, SamplerTarget, SamplingConfig
from treadle.workers.sampler.backend import SampleJob
from treadle.workers.sampler.fair_queue import FairQueue
from treadle.workers.sampler.state import TorchRequest


def _request(tenant: str, name: str, prompt_len: int = 4, max_tokens: int = 4) -> TorchRequest:
    op = SampleOp(np.arange(prompt_len), 1, SamplingConfig(max_tokens=max_tokens))
    job = SampleJob(Any, op, Any, SamplerTarget("base", tenant_id=tenant))  # type: ignore[arg-type]
    req = TorchRequest(job, Future(), frozenset(), 0, op.prompt)
    req.tenant_name = name  # type: ignore[attr-defined]
    return req


def _order(q: FairQueue) -> list[str]:
    out = []
    while len(q):
        out.append(q.pop().tenant_name)  # type: ignore[attr-defined]
    return out


def test_a_tenant_with_many_requests_takes_turns_with_one_with_few() -> None:
    q = FairQueue()
    for i in range(4):
        q.push(_request("a", f"a{i}"))
    q.push(_request("b", "b0"))
    # b's one request goes second, not after all of a's
    assert _order(q) == ["a0", "b0", "a1", "a2", "a3"]


def test_turns_are_by_tokens_not_requests() -> None:
    q = FairQueue()
    q.push(_request("big", "big0", prompt_len=8, max_tokens=56))  # 64 tokens
    q.push(_request("big", "big1", prompt_len=8, max_tokens=56))
    for i in range(5):
        q.push(_request("small", f"s{i}", prompt_len=4, max_tokens=12))  # 16 tokens each
    order = _order(q)
    # four of small's 16-token requests fit in big's first 64 tokens
    assert order.index("big1") > order.index("s3")


def test_cancelled_requests_are_dropped_and_order_kept() -> None:
    q = FairQueue()
    reqs = [_request("a", f"a{i}") for i in range(3)]
    for r in reqs:
        q.push(r)
    reqs[1].future.cancel()
    q.drop_cancelled()
    assert [r.tenant_name for r in q] == ["a0", "a2"]  # type: ignore[attr-defined]
    assert q.peek() is reqs[0]
