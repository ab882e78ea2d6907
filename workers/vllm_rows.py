"""The vLLM backend's bookkeeping of one sample request: the request, its rows
(one vLLM request each at a time), the sequences they become, and the partial
rollouts kept for ``resume``.

A row records, per sampled token, its logprob and the version of the weights
that produced it; a row moved to new weights (an in-flight update) or resumed
keeps what it had and goes on from there.
"""

from __future__ import annotations

import secrets
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from treadle.errors import InvalidArgumentError, NotFoundError
from treadle.workers.domain import SampleResult, SequenceResult, version_spans
from treadle.workers.sampler_backend import OnSequence, Requester
from treadle.workers.sampler_state import Partial
from treadle.workers.versions import WeightSnapshot
from treadle.workers.vllm_adapters import VllmAdapter

#: partial rollouts kept for resumption; beyond it the oldest are forgotten
MAX_PARTIALS = 65536


@dataclass
class VllmRequest:
    future: Future[SampleResult]
    stop_ids: frozenset[int]
    params: Any  # SamplingConfig of this call
    requester: Requester
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


def sequence_of(row: VllmRow) -> SequenceResult:
    prefix = row.prefix
    tokens = (prefix.tokens if prefix else []) + row.tokens
    logprobs = (prefix.logprobs if prefix else []) + row.logprobs
    versions = (prefix.versions if prefix else []) + row.versions
    return SequenceResult(
        tokens=np.asarray(tokens, dtype=np.int64),
        logprobs=np.asarray(logprobs, dtype=np.float32),
        stop_reason=row.stop_reason or "cancelled",
        versions=version_spans(versions),
        resume_handle=row.handle,
    )


class PartialStore:
    """Partial rollouts by resume handle, owned by the requester that made them
    (bounded: beyond ``MAX_PARTIALS`` the oldest are forgotten). Thread-safe."""

    def __init__(self) -> None:
        self._partials: OrderedDict[str, Partial] = OrderedDict()
        self._lock = threading.Lock()

    def take(self, owner: tuple[str, str], handles: Sequence[str]) -> list[Partial]:
        if not handles:
            raise InvalidArgumentError("resume_handles: give at least one")
        if len(set(handles)) != len(handles):
            raise InvalidArgumentError("resume_handles: a handle is given twice")
        with self._lock:
            for h in handles:
                kept = self._partials.get(h)
                if kept is None or kept.owner != owner:
                    raise NotFoundError(f"resume handle {h[:48]!r} not found")
            return [self._partials.pop(h) for h in handles]

    def give_back(self, handles: Sequence[str], kept: Sequence[Partial]) -> None:
        with self._lock:
            for h, part in zip(handles, kept, strict=True):
                self._partials[h] = part

    def keep(self, row: VllmRow) -> str:
        """Keep the row's sequence so far; its resume handle."""
        prefix = row.prefix
        kept = Partial(
            owner=row.request.requester.owner,
            prompt=row.prompt if prefix is None else prefix.prompt,
            tokens=(prefix.tokens if prefix else []) + row.tokens,
            logprobs=(prefix.logprobs if prefix else []) + row.logprobs,
            versions=(prefix.versions if prefix else []) + row.versions,
        )
        handle = "rh-" + secrets.token_urlsafe(18)
        with self._lock:
            self._partials[handle] = kept
            while len(self._partials) > MAX_PARTIALS:
                self._partials.popitem(last=False)
        return handle
