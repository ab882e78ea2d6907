"""ServerService over gRPC: what the server serves (``server.service.info``), its
live sampler and training-pass metrics, and tokenizer files for local tokenization."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc

import treadle
from treadle.server.context import ServerContext
from treadle.server.rpc import convert
from treadle.v1 import server_pb2, server_pb2_grpc

CHUNK_BYTES = 1 << 20
FEATURES = ("lora", "full_finetune", "version_spans", "reference_logprobs", "seq_dedupe")


class InfoServicer(server_pb2_grpc.ServerServiceServicer):
    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx
        self.info = ctx.service.info

    async def GetServerInfo(
        self, request: server_pb2.GetServerInfoRequest, context: grpc.aio.ServicerContext
    ) -> server_pb2.ServerInfo:
        tenant = self.ctx.tenant(context)
        d = self.ctx.engine_metrics
        quota = await asyncio.to_thread(self.info.model_quota, tenant)
        # off the event loop: with a sampler thread this waits for its current step
        sampler_metrics = await asyncio.to_thread(d.sampler_metrics)
        workers = await asyncio.to_thread(self.info.workers)
        return convert.server_info(
            server_version=treadle.__version__,
            max_message_bytes=self.ctx.config.max_message_bytes,
            max_tokens_per_request=self.info.max_tokens_per_request(tenant),
            features=FEATURES,
            quota=quota,
            base_models=self.info.base_models(),
            sampler_metrics=sampler_metrics,
            pass_metrics=d.pass_metrics(),
            workers=workers,
        )

    async def GetTokenizer(
        self, request: server_pb2.GetTokenizerRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[server_pb2.TokenizerChunk]:
        self.ctx.tenant(context)
        for path in self.info.tokenizer_files(request.base_model):
            data = path.read_bytes()
            for offset in range(0, max(len(data), 1), CHUNK_BYTES):
                piece = data[offset : offset + CHUNK_BYTES]
                last = offset + CHUNK_BYTES >= len(data)
                yield convert.tokenizer_chunk(path.name, offset, piece, last)
