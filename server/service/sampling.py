"""A tenant's samplers and the samples they draw, for any transport.

A sampler is a tenant resource like a model: another tenant's sampler answers
NOT_FOUND. Every sample runs under the tenant's quota (its worst case reserved,
settled with what it generated) and is counted once: a repeat of a sample
with a ``seq_id`` gets the first call's result and is not charged again.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import replace

import numpy as np

from treadle.common.engine.domain import (
    SAMPLER_PLACEMENTS,
    SampleOp,
    SampleResult,
    SamplerTarget,
    SamplingConfig,
    SequenceResult,
    StreamedSequence,
)
from treadle.common.engine.messages import CheckTargetCall, ResumeCall, SampleCall
from treadle.common.store import parse_weights_uri
from treadle.errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    UnavailableError,
)
from treadle.server.accounting.metering import CallMeter
from treadle.server.context import ServerContext
from treadle.server.db import queries, session_queries
from treadle.server.service.ordered import Admission
from treadle.server.service.types import Parsed, SamplerInfo, SamplerSource, unwrap

#: samplers whose target is kept in memory (the most recently used); an older
#: one is read again from the database. Every ``sync_weights`` makes a sampler,
#: so an unbounded cache grows by one entry per sync for the server's lifetime.
MAX_CACHED_SAMPLERS = 4096


class SamplingService:
    def __init__(self, ctx: ServerContext, meter: CallMeter) -> None:
        self.ctx = ctx
        self.meter = meter
        #: sampler_id -> (tenant, target), at most ``MAX_CACHED_SAMPLERS``, LRU
        self._targets: OrderedDict[str, tuple[str, SamplerTarget]] = OrderedDict()

    def remember(self, tenant: str, sampler_id: str, target: SamplerTarget) -> None:
        """Keep (or touch) a sampler's target, the most recently used last; also for
        a sampler made elsewhere (``sync_weights``'s), so its first sample does not
        read it back from the database."""
        self._targets[sampler_id] = (tenant, target)
        self._targets.move_to_end(sampler_id)
        while len(self._targets) > MAX_CACHED_SAMPLERS:
            self._targets.popitem(last=False)

    async def create_sampler(
        self, tenant: str, source: SamplerSource, session_id: str = ""
    ) -> SamplerInfo:
        """A sampler on a base model or published weights; ``session_id`` (optional)
        is the tenant's client session it belongs to."""
        ctx = self.ctx
        placement = _checked(source.placement)
        if source.base_model is not None:
            base_model = ctx.base_model_name(source.base_model)
            if base_model not in ctx.catalog.base_model_names():
                raise NotFoundError(f"base_model {source.base_model!r} is not served here")
            target = SamplerTarget(base_model=base_model, placement=placement)
            mode = "base"
        elif source.weights is not None:
            ref = parse_weights_uri(source.weights)
            with ctx.session() as s:
                row = queries.get_model(s, tenant, ref.model_id)
                if row is None:
                    raise NotFoundError(f"weights {source.weights!r} not found")
                target = SamplerTarget(
                    base_model=row.base_model,
                    model_id=row.id,
                    version=ref.version,
                    placement=placement,
                )
            mode = "latest" if ref.version is None else "version"
        else:
            raise InvalidArgumentError("target: give base_model or weights")
        self._refuse_unplaceable(target)
        if target.model_id is not None:  # brings an unloaded model back
            async with ctx.lifecycle.using(tenant, target.model_id):
                version = (await ctx.dispatcher.call(CheckTargetCall(target))).version
        else:
            version = (await ctx.dispatcher.call(CheckTargetCall(target))).version
        with ctx.session() as s:
            if session_id and session_queries.get_session(s, tenant, session_id) is None:
                raise NotFoundError(f"session_id: session {session_id!r} not found")
            row_s = queries.create_sampler(
                s,
                tenant_id=tenant,
                base_model=target.base_model,
                mode=mode,
                model_id=target.model_id,
                pinned_version=target.version,
                session_id=session_id or None,
                placement=placement or None,
            )
            sampler_id = row_s.id
        self.remember(tenant, sampler_id, target)
        return SamplerInfo(
            sampler_id=sampler_id,
            base_model=target.base_model,
            model_id=target.model_id or "",
            version=-1 if target.follows_latest else version,
            follows_latest=target.follows_latest,
        )

    def check_placement(self, tenant: str, model_id: str, placement: str, made: bool) -> None:
        """The placement chosen for the sampler an ordered call makes on the tenant's
        model (``sync_weights``; ``made``: whether it makes one), checked as
        ``create_sampler`` checks its own (``_refuse_unplaceable``): the call is
        refused in its turn and takes its ``seq_id``."""
        if not placement:
            return
        if not made:
            raise InvalidArgumentError(
                "placement: chooses where the sampler a sync makes samples; this sync "
                "makes none (create_sampler is not set)"
            )
        with self.ctx.session() as s:
            base_model = self.ctx.model_row(s, tenant, model_id).base_model
        self._refuse_unplaceable(
            SamplerTarget(base_model, model_id, tenant_id=tenant, placement=_checked(placement))
        )

    def _refuse_unplaceable(self, target: SamplerTarget) -> None:
        """A new sampler that chose where it samples (``target.placement``) and cannot
        sample there (``pool`` with no sampler worker of its base) is refused
        FAILED_PRECONDITION with the rule's message naming the base model, before
        anything is made (or an unloaded model restored). Not UNAVAILABLE: the
        server has no such worker until an operator starts one, so the SDK's
        retries (about 6 s) would only delay the answer, and an ordered call
        (``sync_weights``) answered UNAVAILABLE counts as never arrived (the SDK
        sends it again before the model's next call, and the replay log does not
        count it as taken). A pool worker still starting up is not waited for: one
        that has registered (printed "ready") is seen (the dispatcher reads the
        workers table again before it refuses), and one that has not could serve
        no sample either. A sampler
        that exists already and loses its pool workers later answers UNAVAILABLE
        when it samples (the dispatcher's own check; a worker may come back)."""
        if not target.placement:
            return
        try:
            self.ctx.dispatcher.check_placement(target)
        except UnavailableError as err:
            raise FailedPreconditionError(err.message) from None

    def target(self, tenant: str, sampler_id: str) -> SamplerTarget:
        """What the tenant's sampler reads (NOT_FOUND for another tenant's)."""
        cached = self._targets.get(sampler_id)
        if cached is None:
            with self.ctx.session() as s:
                row = queries.get_sampler(s, tenant, sampler_id)
                if row is None:
                    raise NotFoundError(f"sampler {sampler_id!r} not found")
                cached = (
                    row.tenant_id,
                    SamplerTarget(
                        row.base_model,
                        row.model_id,
                        row.pinned_version,
                        placement=row.placement or "",
                    ),
                )
        owner, target = cached
        self.remember(owner, sampler_id, target)
        if owner != tenant:
            raise NotFoundError(f"sampler {sampler_id!r} not found")
        return target

    async def sample(
        self,
        tenant: str,
        sampler_id: str,
        op: Parsed[SampleOp],
        seq_id: int = 0,
        digest: str = "",
        *,
        admitted: Admission | None = None,
    ) -> SampleResult:
        """``num_samples`` completions of the prompt. With ``seq_id`` > 0 the call
        may be repeated: ``(sampler_id, seq_id, digest)`` identifies it.
        ``admitted`` resolves once the tenant's quota has admitted the call (a
        transport answers its refusal, e.g. RESOURCE_EXHAUSTED, on the request)."""
        target = self.target(tenant, sampler_id)
        parsed = unwrap(op)
        key = (sampler_id, seq_id, digest) if seq_id > 0 else None
        if target.model_id is None:
            return await self._sample(tenant, target, parsed, key, admitted)
        # a call on the model: restores it if it was unloaded, resets its idle clock
        async with self.ctx.lifecycle.using(tenant, target.model_id):
            return await self._sample(tenant, target, parsed, key, admitted)

    async def _sample(
        self,
        tenant: str,
        target: SamplerTarget,
        op: SampleOp,
        key: tuple[str, int, str] | None,
        admitted: Admission | None = None,
    ) -> SampleResult:
        """Dispatch under the tenant's quota (its worst case reserved, settled with
        what it generated), counting its usage."""
        ticket = self.meter.admit_sample(tenant, op)
        if admitted is not None and not admitted.done():
            admitted.set_result(None)
        result: SampleResult | None = None
        try:
            # The engine's sampler queues each tenant's requests fairly against the rest.
            result = await self.ctx.dispatcher.call(
                SampleCall(replace(target, tenant_id=tenant), op, key)
            )
            return result
        finally:
            self.meter.end_sample(tenant, target, op, ticket, result, key)

    async def resume(
        self,
        tenant: str,
        sampler_id: str,
        handles: tuple[str, ...],
        params: SamplingConfig,
    ) -> SampleResult:
        """Continue partial rollouts under the weights the sampler reads now; the
        sequences come back whole (earlier parts first)."""
        target = replace(self.target(tenant, sampler_id), tenant_id=tenant)
        # the quota reserves the new tokens; the re-prefilled ones settle as prompt
        op = SampleOp(np.zeros(0, dtype=np.int64), max(1, len(handles)), params)
        async with contextlib.AsyncExitStack() as stack:
            if target.model_id is not None:
                await stack.enter_async_context(self.ctx.lifecycle.using(tenant, target.model_id))
            ticket = self.meter.admit_sample(tenant, op)
            result: SampleResult | None = None
            try:
                result = await self.ctx.dispatcher.call(
                    ResumeCall(target, tuple(handles), params, sampler_id)
                )
            finally:
                self.meter.end_sample(tenant, target, op, ticket, result)
        return result

    async def sample_stream(
        self, tenant: str, sampler_id: str, op: Parsed[SampleOp]
    ) -> AsyncIterator[StreamedSequence]:
        """Each sequence the moment it finishes; closing the iterator early cancels
        the samples still generating. Usage counts what was delivered."""
        target = self.target(tenant, sampler_id)
        parsed = unwrap(op)
        if parsed.scores_prompt:
            field = "prompt_logprobs" if parsed.prompt_logprobs else "topk_prompt_logprobs"
            raise InvalidArgumentError(
                f"{field}: a streamed request returns no prompt logprobs; use Sample"
            )
        async with contextlib.AsyncExitStack() as stack:
            if target.model_id is not None:  # restores an unloaded model, resets its idle clock
                await stack.enter_async_context(self.ctx.lifecycle.using(tenant, target.model_id))
            ticket = self.meter.admit_sample(tenant, parsed)
            done: list[SequenceResult] = []
            compute_s = 0.0
            try:
                stream = self.ctx.dispatcher.sample_stream(
                    replace(target, tenant_id=tenant), parsed
                )
                async with contextlib.aclosing(stream):
                    async for item in stream:
                        done.append(item.sequence)
                        compute_s += item.compute_s
                        yield item
            finally:
                # Usage counts what was generated and delivered, cancelled or not.
                result = SampleResult(tuple(done), compute_s=compute_s) if done else None
                self.meter.end_sample(tenant, target, parsed, ticket, result)


def _checked(placement: str) -> str:
    """A sampler's placement as the service takes it: one of ``SAMPLER_PLACEMENTS``,
    or "" for the server's."""
    if placement and placement not in SAMPLER_PLACEMENTS:
        raise InvalidArgumentError(
            f"placement: {placement!r} is not one of {', '.join(SAMPLER_PLACEMENTS)}"
        )
    return placement
