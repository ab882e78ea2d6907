"""SamplingService: samplers are tenant resources; Sample reads their weights."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import replace

import grpc
import numpy as np

from treadle.errors import InvalidArgumentError, NotFoundError
from treadle.server import convert
from treadle.server.context import ServerContext
from treadle.server.db import queries
from treadle.server.metering import CallMeter
from treadle.server.store import parse_weights_uri
from treadle.v1 import sampling_pb2, sampling_pb2_grpc
from treadle.workers.domain import SampleOp, SampleResult, SamplerTarget, SequenceResult


class SamplingServicer(sampling_pb2_grpc.SamplingServiceServicer):
    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx
        self._targets: dict[str, tuple[str, SamplerTarget]] = {}  # sampler_id -> (tenant, target)
        self.meter = CallMeter(ctx.quotas, ctx.usage)

    async def CreateSampler(
        self, request: sampling_pb2.CreateSamplerRequest, context: grpc.aio.ServicerContext
    ) -> sampling_pb2.SamplerInfo:
        ctx = self.ctx
        tenant = ctx.tenant(context)
        which = request.WhichOneof("target")
        if which == "base_model":
            if request.base_model not in ctx.dispatcher.base_model_names():
                raise NotFoundError(f"base_model {request.base_model!r} is not served here")
            target = SamplerTarget(base_model=request.base_model)
            mode = "base"
        elif which == "weights":
            ref = parse_weights_uri(request.weights)
            with ctx.session() as s:
                row = queries.get_model(s, tenant, ref.model_id)
                if row is None:
                    raise NotFoundError(f"weights {request.weights!r} not found")
                target = SamplerTarget(
                    base_model=row.base_model, model_id=row.id, version=ref.version
                )
            mode = "latest" if ref.version is None else "version"
        else:
            raise InvalidArgumentError("target: give base_model or weights")
        if target.model_id is not None:  # brings an unloaded model back
            async with ctx.lifecycle.using(tenant, target.model_id):
                version = await ctx.dispatcher.check_sampler_target(target)
        else:
            version = await ctx.dispatcher.check_sampler_target(target)
        with ctx.session() as s:
            row_s = queries.create_sampler(
                s,
                tenant_id=tenant,
                base_model=target.base_model,
                mode=mode,
                model_id=target.model_id,
                pinned_version=target.version,
            )
            sampler_id = row_s.id
        self._targets[sampler_id] = (tenant, target)
        return sampling_pb2.SamplerInfo(
            sampler_id=sampler_id,
            base_model=target.base_model,
            model_id=target.model_id or "",
            version=-1 if target.follows_latest else version,
            follows_latest=target.follows_latest,
        )

    def _target(self, tenant: str, sampler_id: str) -> SamplerTarget:
        cached = self._targets.get(sampler_id)
        if cached is None:
            with self.ctx.session() as s:
                row = queries.get_sampler(s, tenant, sampler_id)
                if row is None:
                    raise NotFoundError(f"sampler {sampler_id!r} not found")
                target = SamplerTarget(row.base_model, row.model_id, row.pinned_version)
                cached = (row.tenant_id, target)
            self._targets[sampler_id] = cached
        owner, target = cached
        if owner != tenant:
            raise NotFoundError(f"sampler {sampler_id!r} not found")
        return target

    async def _sample(
        self,
        tenant: str,
        target: SamplerTarget,
        op: SampleOp,
        key: tuple[str, int, str] | None,
    ) -> SampleResult:
        """Dispatch under the tenant's quota (its worst case reserved, settled with
        what it generated), counting its usage."""
        ticket = self.meter.admit_sample(tenant, op)
        result: SampleResult | None = None
        try:
            # The engine's sampler queues each tenant's requests fairly against the rest.
            result = await self.ctx.dispatcher.sample(replace(target, tenant_id=tenant), op, key)
            return result
        finally:
            self.meter.end_sample(tenant, target, op, ticket, result, key)

    async def Sample(
        self, request: sampling_pb2.SampleRequest, context: grpc.aio.ServicerContext
    ) -> sampling_pb2.SampleResponse:
        tenant = self.ctx.tenant(context)
        target = self._target(tenant, request.sampler_id)
        op = convert.sample_op(request)
        key = (
            (request.sampler_id, request.seq_id, convert.digest(request))
            if request.seq_id > 0
            else None
        )
        if target.model_id is None:
            result = await self._sample(tenant, target, op, key)
        else:  # a call on the model: restores it if it was unloaded, resets its idle clock
            async with self.ctx.lifecycle.using(tenant, target.model_id):
                result = await self._sample(tenant, target, op, key)
        return convert.sample_response(result)

    async def Resume(
        self, request: sampling_pb2.ResumeRequest, context: grpc.aio.ServicerContext
    ) -> sampling_pb2.SampleResponse:
        """Continue partial rollouts under the weights the sampler reads now; the
        sequences come back whole (earlier parts first)."""
        tenant = self.ctx.tenant(context)
        target = replace(self._target(tenant, request.sampler_id), tenant_id=tenant)
        params = convert.sampling_config(request.params)
        handles = tuple(request.resume_handles)
        # the quota reserves the new tokens; the re-prefilled ones settle as prompt
        op = SampleOp(np.zeros(0, dtype=np.int64), max(1, len(handles)), params)
        async with contextlib.AsyncExitStack() as stack:
            if target.model_id is not None:
                await stack.enter_async_context(self.ctx.lifecycle.using(tenant, target.model_id))
            ticket = self.meter.admit_sample(tenant, op)
            result: SampleResult | None = None
            try:
                result = await self.ctx.dispatcher.resume(
                    target, request.sampler_id, handles, params
                )
            finally:
                self.meter.end_sample(tenant, target, op, ticket, result)
        return convert.sample_response(result)

    async def SampleStream(
        self, request: sampling_pb2.SampleRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[sampling_pb2.SampleStreamResponse]:
        """Each sequence the moment it finishes; a client that cancels the stream
        cancels the samples still generating (the generator is closed)."""
        tenant = self.ctx.tenant(context)
        target = self._target(tenant, request.sampler_id)
        op = convert.sample_op(request)
        async with contextlib.AsyncExitStack() as stack:
            if target.model_id is not None:  # restores an unloaded model, resets its idle clock
                await stack.enter_async_context(self.ctx.lifecycle.using(tenant, target.model_id))
            ticket = self.meter.admit_sample(tenant, op)
            done: list[SequenceResult] = []
            compute_s = 0.0
            try:
                stream = self.ctx.dispatcher.sample_stream(replace(target, tenant_id=tenant), op)
                async with contextlib.aclosing(stream):
                    async for item in stream:
                        done.append(item.sequence)
                        compute_s += item.compute_s
                        yield convert.stream_response(item)
            finally:
                # Usage counts what was generated and delivered, cancelled or not.
                result = SampleResult(tuple(done), compute_s=compute_s) if done else None
                self.meter.end_sample(tenant, target, op, ticket, result)
