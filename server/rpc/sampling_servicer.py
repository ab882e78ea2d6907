"""SamplingService over gRPC: a translator over the service layer
(``server.service.sampling``), which owns samplers, quotas and usage."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import grpc

from treadle.server.context import ServerContext
from treadle.server.rpc import convert
from treadle.server.service.types import parse
from treadle.v1 import sampling_pb2, sampling_pb2_grpc


class SamplingServicer(sampling_pb2_grpc.SamplingServiceServicer):
    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx
        self.sampling = ctx.service.sampling

    async def CreateSampler(
        self, request: sampling_pb2.CreateSamplerRequest, context: grpc.aio.ServicerContext
    ) -> sampling_pb2.SamplerInfo:
        tenant = self.ctx.tenant(context)
        info = await self.sampling.create_sampler(tenant, convert.sampler_source(request))
        return convert.sampler_info(info)

    async def Sample(
        self, request: sampling_pb2.SampleRequest, context: grpc.aio.ServicerContext
    ) -> sampling_pb2.SampleResponse:
        tenant = self.ctx.tenant(context)
        op = parse(lambda: convert.sample_op(request))
        digest = convert.digest(request) if request.seq_id > 0 else ""
        result = await self.sampling.sample(
            tenant, request.sampler_id, op, seq_id=request.seq_id, digest=digest
        )
        return convert.sample_response(result)

    async def Resume(
        self, request: sampling_pb2.ResumeRequest, context: grpc.aio.ServicerContext
    ) -> sampling_pb2.SampleResponse:
        """Continue partial rollouts under the weights the sampler reads now; the
        sequences come back whole (earlier parts first)."""
        tenant = self.ctx.tenant(context)
        result = await self.sampling.resume(
            tenant,
            request.sampler_id,
            tuple(request.resume_handles),
            convert.sampling_config(request.params),
        )
        return convert.sample_response(result)

    async def SampleStream(
        self, request: sampling_pb2.SampleRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[sampling_pb2.SampleStreamResponse]:
        """Each sequence the moment it finishes; a client that cancels the stream
        cancels the samples still generating (the generator is closed)."""
        tenant = self.ctx.tenant(context)
        op = parse(lambda: convert.sample_op(request))
        stream = self.sampling.sample_stream(tenant, request.sampler_id, op)
        async with contextlib.aclosing(stream):
            async for item in stream:
                yield convert.stream_response(item)
