"""ServerService over gRPC: what the server serves (``server.service.info``), its
live sampler and training-pass metrics, and tokenizer files for local tokenization."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc

import treadle
from treadle.server.context import ServerContext
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
        d = self.ctx.dispatcher
        max_models, live_models = await asyncio.to_thread(self.info.model_quota, tenant)
        info = server_pb2.ServerInfo(
            server_version=treadle.__version__,
            api_version="treadle.v1",
            max_message_bytes=self.ctx.config.max_message_bytes,
            max_tokens_per_request=self.info.max_tokens_per_request(tenant),
            features=list(FEATURES),
            max_models=max_models,
            live_models=live_models,
        )
        for b in self.info.base_models():
            info.base_models.add(
                name=b.name,
                arch=b.arch,
                vocab_size=b.vocab_size,
                max_context=b.max_context,
                num_params=b.num_params,
                dtype=b.dtype,
            )
        # off the event loop: with a sampler thread this waits for its current step
        for m in await asyncio.to_thread(d.sampler_metrics):
            info.sampler_metrics.add(
                base_model=m.base_model,
                dtype=m.dtype,
                tokens_per_s=m.tokens_per_s,
                occupancy=m.occupancy,
                running_rows=m.running_rows,
                num_slots=m.num_slots,
                queued_requests=m.queued_requests,
                prefilling_requests=m.prefilling_requests,
                tokens_generated=m.tokens_generated,
                prompt_tokens=m.prompt_tokens,
                prefix_reused_tokens=m.prefix_reused_tokens,
                kv_cache_usage=m.kv_cache_usage,
                kv_cache_peak_usage=m.kv_cache_peak_usage,
            )
        for p in d.pass_metrics():
            info.training_pass_metrics.add(
                base_model=p.base_model,
                dtype=p.dtype,
                passes=p.passes,
                batched_passes=p.batched_passes,
                calls_batched=p.calls_batched,
                calls_alone=p.calls_alone,
                tokens_batched=p.tokens_batched,
                tokens_alone=p.tokens_alone,
                calls_per_batched_pass=p.calls_per_batched_pass,
                max_calls_per_pass=p.max_calls_per_pass,
            )
        return info

    async def GetTokenizer(
        self, request: server_pb2.GetTokenizerRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[server_pb2.TokenizerChunk]:
        self.ctx.tenant(context)
        for path in self.info.tokenizer_files(request.base_model):
            data = path.read_bytes()
            for offset in range(0, max(len(data), 1), CHUNK_BYTES):
                piece = data[offset : offset + CHUNK_BYTES]
                last = offset + CHUNK_BYTES >= len(data)
                yield server_pb2.TokenizerChunk(
                    file_name=path.name, offset=offset, data=piece, last=last
                )
