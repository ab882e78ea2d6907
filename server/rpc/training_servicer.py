"""TrainingService over gRPC: a translator over the service layer.

Each RPC reads the caller's tenant, turns its request into domain types
(``server.rpc.convert``), calls ``server.service`` and turns the result back into
its response; ordering, dedupe, tenancy, quotas and usage live in the service.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from treadle.common.engine.domain import AdamConfig
from treadle.errors import InvalidArgumentError
from treadle.server.context import ServerContext
from treadle.server.rpc import convert
from treadle.server.service.types import OrderedCall, parse
from treadle.v1 import training_pb2, training_pb2_grpc

EXPORT_CHUNK_BYTES = 1 << 20


def _call(request: object, context: grpc.aio.ServicerContext) -> OrderedCall:
    return convert.ordered_call(request, context.invocation_metadata())


class TrainingServicer(training_pb2_grpc.TrainingServiceServicer):
    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx
        self.models = ctx.service.models
        self.training = ctx.service.training
        self.checkpoints = ctx.service.checkpoints

    # ---- lifecycle -----------------------------------------------------------------

    async def CreateModel(
        self, request: training_pb2.CreateModelRequest, context: grpc.aio.ServicerContext
    ) -> training_pb2.ModelInfo:
        tenant = self.ctx.tenant(context)
        info = await self.models.create(tenant, convert.create_model(request))
        return convert.model_info(info)

    async def GetModelInfo(
        self, request: training_pb2.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> training_pb2.ModelInfo:
        tenant = self.ctx.tenant(context)
        return convert.model_info(self.models.info(tenant, request.model_id))

    async def ListModels(
        self, request: training_pb2.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> training_pb2.ListModelsResponse:
        tenant = self.ctx.tenant(context)
        models = self.models.list(tenant)
        return convert.list_models(models)

    async def DeleteModel(
        self, request: training_pb2.DeleteModelRequest, context: grpc.aio.ServicerContext
    ) -> training_pb2.DeleteModelResponse:
        tenant = self.ctx.tenant(context)
        await self.models.delete(tenant, request.model_id)
        return convert.deleted_model()

    async def RestoreModel(
        self, request: training_pb2.RestoreModelRequest, context: grpc.aio.ServicerContext
    ) -> training_pb2.ModelInfo:
        tenant = self.ctx.tenant(context)
        return convert.model_info(await self.models.restore(tenant, request.model_id))

    async def ExportWeights(
        self, request: training_pb2.ExportWeightsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[training_pb2.FileChunk]:
        tenant = self.ctx.tenant(context)
        async with self.models.export_weights(
            tenant, request.model_id, merged=request.merged
        ) as paths:
            for path in paths:
                size = path.stat().st_size
                with open(path, "rb") as f:  # chunk by chunk: a merged model is big
                    for offset in range(0, max(size, 1), EXPORT_CHUNK_BYTES):
                        data = f.read(EXPORT_CHUNK_BYTES)
                        last = offset + EXPORT_CHUNK_BYTES >= size
                        yield convert.file_chunk(path.name, offset, data, last)

    # ---- ordered primitives -----------------------------------------------------------

    async def ForwardBackward(
        self, request: training_pb2.ForwardBackwardRequest, context: grpc.aio.ServicerContext
    ) -> training_pb2.ForwardOutput:
        tenant = self.ctx.tenant(context)
        op = parse(lambda: convert.forward_backward_op(request))
        result = await self.training.forward_backward(tenant, _call(request, context), op)
        return convert.forward_output(result)

    async def ForwardLogprobs(
        self, request: training_pb2.ForwardLogprobsRequest, context: grpc.aio.ServicerContext
    ) -> training_pb2.ForwardOutput:
        tenant = self.ctx.tenant(context)
        op = parse(lambda: convert.forward_logprobs_op(request))
        result = await self.training.forward_logprobs(
            tenant, _call(request, context), op, request.reference_path
        )
        return convert.forward_output(result)

    async def OptimStep(
        self, request: training_pb2.OptimStepRequest, context: grpc.aio.ServicerContext
    ) -> training_pb2.OptimStepResponse:
        tenant = self.ctx.tenant(context)

        def adam() -> AdamConfig:
            if not request.HasField("adam_params"):
                raise InvalidArgumentError("adam_params: required")
            return convert.adam(request.adam_params)

        result = await self.training.optim_step(tenant, _call(request, context), parse(adam))
        return convert.optim_step(result)

    async def SyncWeights(
        self, request: training_pb2.SyncWeightsRequest, context: grpc.aio.ServicerContext
    ) -> training_pb2.SyncWeightsResponse:
        tenant = self.ctx.tenant(context)
        out = await self.training.sync_weights(
            tenant,
            _call(request, context),
            inflight=request.inflight,
            sampler="version" if request.create_sampler else "",
            placement=parse(lambda: convert.sampler_placement(request.placement)),
        )
        return convert.sync_weights(out)

    async def SaveState(
        self, request: training_pb2.SaveStateRequest, context: grpc.aio.ServicerContext
    ) -> training_pb2.SaveStateResponse:
        tenant = self.ctx.tenant(context)
        saved = await self.training.save_state(tenant, _call(request, context), request.name)
        return convert.saved_state(saved)

    async def LoadState(
        self, request: training_pb2.LoadStateRequest, context: grpc.aio.ServicerContext
    ) -> training_pb2.LoadStateResponse:
        tenant = self.ctx.tenant(context)
        result = await self.training.load_state(
            tenant, _call(request, context), request.path, optimizer=not request.weights_only
        )
        return convert.loaded_state(result)

    # ---- checkpoints ----------------------------------------------------------------

    async def ListCheckpoints(
        self, request: training_pb2.ListCheckpointsRequest, context: grpc.aio.ServicerContext
    ) -> training_pb2.ListCheckpointsResponse:
        tenant = self.ctx.tenant(context)
        rows = self.checkpoints.list(tenant, request.model_id)
        return convert.list_checkpoints(rows)

    async def DeleteCheckpoint(
        self, request: training_pb2.DeleteCheckpointRequest, context: grpc.aio.ServicerContext
    ) -> training_pb2.DeleteCheckpointResponse:
        tenant = self.ctx.tenant(context)
        self.checkpoints.delete(tenant, request.path)
        return convert.deleted_checkpoint()

    # ---- a run's metrics and usage ----------------------------------------------------

    async def LogMetrics(
        self, request: training_pb2.LogMetricsRequest, context: grpc.aio.ServicerContext
    ) -> training_pb2.LogMetricsResponse:
        tenant = self.ctx.tenant(context)
        kept = self.ctx.service.runs.log_metrics(
            tenant, request.model_id, request.step, dict(request.metrics)
        )
        return convert.metrics_logged(kept)

    async def GetUsage(
        self, request: training_pb2.GetUsageRequest, context: grpc.aio.ServicerContext
    ) -> training_pb2.Usage:
        tenant = self.ctx.tenant(context)
        return convert.usage(self.ctx.service.runs.usage(tenant, request.model_id))
