"""The vLLM backend's bookkeeping of one sample request: the request, its rows
(one vLLM request each at a time), the sequences they become, and the partial
rollouts kept for ``resume``.

A row records, per sampled token, its logprob and the version of the weights
that produced it; a row moved to new weights (an in-flight update) or resumed
keeps what it had and goes on from there.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from treadle.common.engine.domain import SampleResult, SamplerTarget, SequenceResult
from treadle.workers.engine.versions import WeightSnapshot
from treadle.workers.sampler.backend import OnSequence, owner_of
from treadle.workers.sampler.state import Partial, continued, sequence_result
from treadle.workers.vllm.adapters import VllmAdapter


@dataclass
class VllmRequest:
    """The vLLM backend's progress on one ``SampleJob`` or ``ResumeJob`` (a resume has
    no ``SampleOp``, so the parameters and target are kept, not the job)."""

    future: Future[SampleResult]
    stop_ids: frozenset[int]
    params: Any  # SamplingConfig of this call
    target: SamplerTarget  # whose request (its owner resumes it) and what it follows
    on_sequence: OnSequence | None
    rows: list[VllmRow] = field(default_factory=list)
    compute_s: float = 0.0
    reported_s: float = 0.0


@dataclass
class VllmRow:
    request: VllmRequest
    index: int
    prompt: np.ndarray  # what this call prefilled (a resume: the prompt and earlier tokens)
    max_tokens: int  # this call's cap
    seed: int
    weights: WeightSnapshot
    adapter: VllmAdapter | None
    prefix: Partial | None = None  # the partial rollout it continues
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    vid: str = ""  # its current vLLM request id
    stop_reason: str | None = None
    handle: str = ""

    def release_adapter(self) -> None:
        if self.adapter is not None:
            self.adapter.users -= 1
            self.adapter = None


def partial_of(row: VllmRow) -> Partial:
    """The row's rollout so far, earlier parts of a resumed one included."""
    owner = owner_of(row.request.target)
    return continued(row.prefix, owner, row.prompt, row.tokens, row.logprobs, row.versions)


def sequence_of(row: VllmRow) -> SequenceResult:
    return sequence_result(partial_of(row), row.stop_reason or "cancelled", row.handle)
