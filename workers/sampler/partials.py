"""Partial rollouts: sequences stopped at their ``token_budget`` and kept, under a
resume handle, until a resume continues them (once) or they are forgotten.

A resume re-prefills each sequence from its prompt and tokens so far and
samples on; its result holds the sequences whole, earlier parts first, with
their own logprobs and versions (``sampler_state.sequence_of``).
"""

from __future__ import annotations

import secrets
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import replace

import numpy as np

from treadle.common.engine.domain import SampleOp, SampleResult, SamplingConfig
from treadle.errors import InvalidArgumentError, NotFoundError
from treadle.workers.sampler.state import Partial

#: partial rollouts kept for resumption per sampler; beyond it the oldest are forgotten
MAX_PARTIALS = 65536


class PartialStore:
    """Partial rollouts by resume handle, owned by the requester that made them
    (bounded: beyond ``limit`` the oldest are forgotten). Thread-safe."""

    def __init__(self, limit: int = MAX_PARTIALS) -> None:
        self.limit = limit
        self._kept: OrderedDict[str, Partial] = OrderedDict()  # resume handle -> rollout
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._kept)

    def keep(self, kept: Partial) -> str:
        """Keep a rollout that stopped "partial" (``partial_of`` its row); its handle."""
        handle = "rh-" + secrets.token_urlsafe(18)
        with self._lock:
            self._kept[handle] = kept
            while len(self._kept) > self.limit:  # the oldest are forgotten
                self._kept.popitem(last=False)
        return handle

    def take(self, owner: tuple[str, str], handles: Sequence[str]) -> list[Partial]:
        """The partial rollouts of ``handles``, removed (each resumes once).

        All or nothing: a handle that never existed, was consumed (or forgotten,
        beyond ``limit``), or belongs to another tenant or model is NOT_FOUND,
        with the same message, and then no handle is consumed.
        """
        if not handles:
            raise InvalidArgumentError("resume_handles: give at least one")
        if len(set(handles)) != len(handles):
            raise InvalidArgumentError("resume_handles: a handle is given twice")
        with self._lock:
            for h in handles:
                kept = self._kept.get(h)
                if kept is None or kept.owner != owner:
                    raise NotFoundError(f"resume handle {h[:48]!r} not found")
            return [self._kept.pop(h) for h in handles]

    def give_back(self, handles: Sequence[str], partials: Sequence[Partial]) -> None:
        """Undo ``take`` (the resume was refused before it started)."""
        with self._lock:
            for h, kept in zip(handles, partials, strict=True):
                self._kept[h] = kept


def resume_op(handle: str, part: Partial, params: SamplingConfig) -> SampleOp:
    """The one-sample request that continues ``part``: its prompt and tokens so far
    as the prompt, and what is left of ``params.max_tokens`` (which counts the
    whole sequence)."""
    done = len(part.tokens)
    if params.max_tokens <= done:
        raise InvalidArgumentError(
            f"max_tokens: counts the whole sequence, and resume handle "
            f"{handle[:48]!r} has {done} tokens already; give more than "
            f"{done} (got {params.max_tokens})"
        )
    prompt = np.concatenate([part.prompt, np.asarray(part.tokens, np.int64)])
    return SampleOp(prompt, 1, replace(params, max_tokens=params.max_tokens - done))


def gather(parts: list[Future[SampleResult]], out: Future[SampleResult], resumed: int) -> None:
    """Resolve ``out`` with the one sequence of each part, in order; cancelling
    ``out`` cancels the parts."""

    def done(_: Future[SampleResult]) -> None:
        if out.done():
            return
        for part in parts:
            if part.done() and not part.cancelled() and part.exception() is not None:
                for other in parts:
                    other.cancel()
                out.set_exception(part.exception())  # type: ignore[arg-type]
                return
        if all(p.done() and not p.cancelled() for p in parts):
            results = [p.result() for p in parts]
            out.set_result(
                SampleResult(
                    tuple(r.sequences[0] for r in results),
                    compute_s=sum(r.compute_s for r in results),
                    resumed_tokens=resumed,
                )
            )

    for part in parts:
        part.add_done_callback(done)
    out.add_done_callback(lambda f: [p.cancel() for p in parts] if f.cancelled() else None)
