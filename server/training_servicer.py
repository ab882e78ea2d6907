"""TrainingService: model lifecycle and the ordered training primitives."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import shutil
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from sqlalchemy.orm import object_session

from treadle.errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    TreadleError,
)
from treadle.server import convert, references, restarts
from treadle.server.context import ServerContext
from treadle.server.db import models as db
from treadle.server.db import queries, tenancy
from treadle.server.metering import CallMeter
from treadle.server.store import (
    check_name,
    copy_checkpoint,
    parse_state_uri,
    state_uri,
    storage_path_str,
    weights_uri,
)
from treadle.v1 import training_pb2, training_pb2_grpc
from treadle.workers.domain import (
    ForwardResult,
    LoadResult,
    LoadStateOp,
    ModelSpec,
    OptimStepOp,
    OptimStepResult,
    OrderedOp,
    RejectedOp,
    SaveResult,
    SaveStateOp,
    SyncResult,
    SyncWeightsOp,
)
from treadle.workers.engine_flags import DTYPES

log = logging.getLogger("treadle.server")
MAX_LORA_RANK = 1024
#: name of the checkpoint a model created from a state keeps of its starting point
INIT_CHECKPOINT = "init"
EXPORT_CHUNK_BYTES = 1 << 20


class TrainingServicer(training_pb2_grpc.TrainingServiceServicer):
    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx
        self.meter = CallMeter(ctx.quotas, ctx.usage)  # quotas and usage of ordered calls

    # ---- lifecycle -----------------------------------------------------------------

    async def CreateModel(
        self, request: training_pb2.CreateModelRequest, context: grpc.aio.ServicerContext
    ) -> training_pb2.ModelInfo:
        ctx = self.ctx
        tenant = ctx.tenant(context)
        from_state: str | None = None
        if request.from_state:
            with ctx.session() as s:
                from_state = self._checkpoint_dir(s, tenant, request.from_state, "from_state")
            manifest = ctx.store.read_manifest(from_state)
            base_model, rank = manifest["base_model"], int(manifest["lora_rank"])
            alpha, seed, dtype = (
                float(manifest["lora_alpha"]),
                int(manifest["seed"]),
                manifest["dtype"],
            )
            modules = convert.manifest_modules(manifest)
        else:
            base_model, rank, seed = request.base_model, request.lora_rank, request.seed
            alpha = request.lora_alpha or float(rank)
            dtype = request.dtype or ctx.config.default_dtype
            modules = convert.lora_modules(request)
        if not base_model:
            raise InvalidArgumentError("base_model: required")
        if base_model not in ctx.dispatcher.base_model_names():
            raise NotFoundError(
                f"base_model {base_model!r} is not served here; served: {ctx.dispatcher.base_model_names()}"
            )
        if not 0 <= rank <= MAX_LORA_RANK:
            raise InvalidArgumentError(
                f"lora_rank: must be in 0..{MAX_LORA_RANK} (0 = full fine-tune), got {rank}"
            )
        if alpha < 0:
            raise InvalidArgumentError(f"lora_alpha: must be >= 0, got {alpha}")
        if rank > 0 and not any(modules):
            raise InvalidArgumentError(
                "train_attn, train_mlp, train_unembed: all false leaves a LoRA model nothing "
                "to train; leave them unset (all true) or set one"
            )
        if dtype not in DTYPES:
            raise InvalidArgumentError(f"dtype: {dtype!r}; choose from {DTYPES}")
        with ctx.session() as s:
            ctx.quotas.check_new_model(tenant, tenancy.count_live_models(s, tenant))
        with ctx.session() as s:
            if request.session_id:
                session = queries.get_session(s, tenant, request.session_id)
                if session is None or session.ended_at is not None:
                    raise NotFoundError(f"session_id: session {request.session_id!r} not found")
            row = queries.create_model(
                s,
                tenant_id=tenant,
                base_model=base_model,
                lora_rank=rank,
                lora_alpha=alpha,
                seed=seed,
                dtype=dtype,
                modules=modules,
            )
            row.session_id = request.session_id or None
            model_id = row.id
        spec = ModelSpec(model_id, tenant, base_model, rank, alpha, seed, dtype, *modules)
        try:
            status = await ctx.dispatcher.create_model(spec, from_state=from_state, next_seq_id=1)
        except TreadleError:
            with ctx.session() as s:
                queries.mark_model_deleted(s, tenant, model_id)
            raise
        ctx.owners[model_id] = tenant
        ctx.lifecycle.touch(model_id)
        init = None
        if from_state is not None:
            # The model owns a copy of the state it started from, so a restart (or
            # the source's deletion) brings it back there, not to a fresh init.
            init_path = ctx.store.state_path(tenant, model_id, INIT_CHECKPOINT)
            size = await asyncio.to_thread(copy_checkpoint, ctx.store, from_state, init_path)
            init = (init_path, size)
        with ctx.session() as s:
            if status.version:
                queries.update_model_progress(s, model_id, version=status.version)
            if init is not None:
                row = self._record_checkpoint(
                    s,
                    tenant,
                    model_id,
                    INIT_CHECKPOINT,
                    init[0],
                    0,
                    status.version,
                    "auto",
                    init[1],
                )
                queries.update_model_progress(s, model_id, last_checkpoint=row)
            return self._info(ctx.model_row(s, tenant, model_id))

    async def GetModelInfo(
        self, request: training_pb2.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> training_pb2.ModelInfo:
        tenant = self.ctx.tenant(context)
        with self.ctx.session() as s:
            return self._info(self.ctx.model_row(s, tenant, request.model_id))

    async def ListModels(
        self, request: training_pb2.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> training_pb2.ListModelsResponse:
        tenant = self.ctx.tenant(context)
        with self.ctx.session() as s:
            return training_pb2.ListModelsResponse(
                models=[self._info(m) for m in queries.list_models(s, tenant)]
            )

    async def DeleteModel(
        self, request: training_pb2.DeleteModelRequest, context: grpc.aio.ServicerContext
    ) -> training_pb2.DeleteModelResponse:
        tenant = self.ctx.tenant(context)
        await self.ctx.lifecycle.wait_idle_transition(request.model_id)
        if request.model_id not in self.ctx.owners:  # unloaded: only its row is left
            with self.ctx.session() as s:
                row = self.ctx.model_row(s, tenant, request.model_id)
                if row.status not in ("unloaded", "lost"):
                    raise NotFoundError(f"model {request.model_id!r} not found")
                queries.mark_model_deleted(s, tenant, request.model_id)
            return training_pb2.DeleteModelResponse()
        self.ctx.require_model(tenant, request.model_id)
        with self.ctx.session() as s:
            queries.mark_model_deleted(s, tenant, request.model_id)
        self.ctx.owners.pop(request.model_id, None)
        self.ctx.lifecycle.forget(request.model_id)
        with contextlib.suppress(NotFoundError):
            await self.ctx.dispatcher.delete_model(request.model_id)
        return training_pb2.DeleteModelResponse()

    def _info(self, row: db.Model) -> training_pb2.ModelInfo:
        info = training_pb2.ModelInfo(
            model_id=row.id,
            base_model=row.base_model,
            is_lora=row.lora_rank > 0,
            lora_rank=row.lora_rank,
            dtype=row.dtype,
            version=row.version,
            last_checkpoint_seq_id=row.last_checkpoint_seq_id,
            status=row.status,
            created_at=row.created_at.timestamp(),
            session_id=row.session_id or "",
        )
        if row.status == "unloaded":  # it comes back at its checkpoint, continuing after it
            info.next_seq_id = row.last_checkpoint_seq_id + 1
        elif row.status == "lost" and (s := object_session(row)) is not None:
            # its next call replays it to its last applied step (or a load_state places it)
            info.next_seq_id = queries.last_applied_seq(s, row.id) + 1
        try:
            status = self.ctx.dispatcher.model_status(row.id)
        except NotFoundError:
            return info
        info.version = status.version
        info.next_seq_id = status.next_seq_id
        info.last_checkpoint_seq_id = status.last_checkpoint_seq_id
        return info

    # ---- ordered primitives -----------------------------------------------------------

    async def _ordered(
        self,
        context: grpc.aio.ServicerContext,
        request: Any,
        build: Callable[[str], OrderedOp],
        kind: str,
    ) -> Any:
        tenant = self.ctx.tenant(context)
        # Restores the model first if it was unloaded for idling (same seq_ids).
        async with self.ctx.lifecycle.using(tenant, request.model_id):
            # A client numbering from before a restart, past where the model is back: at once.
            restarts.check_numbering(
                self.ctx.instance_id,
                self.ctx.restored,
                context.invocation_metadata(),
                request.model_id,
                request.seq_id,
                lambda: self.ctx.dispatcher.model_status(request.model_id),
            )
            return await self._submit(tenant, request, build, kind)

    async def _submit(
        self, tenant: str, request: Any, build: Callable[[str], OrderedOp], kind: str
    ) -> Any:
        if request.seq_id < 1:
            raise InvalidArgumentError(f"seq_id: must be >= 1 (got {request.seq_id})")
        try:
            op = build(tenant)
        except TreadleError as err:
            op = RejectedOp(err, kind=kind)
        digest = convert.digest(request)
        ticket = None
        try:
            with self.ctx.connection() as conn:
                # A repeat of a recorded call is not admitted (or counted) again; a
                # call over quota raises here and its row is rolled back.
                if queries.insert_op_if_new(conn, request.model_id, request.seq_id, kind, digest):
                    ticket, op = self.meter.admit_ordered(
                        tenant, request.model_id, request.seq_id, op
                    )
        except Exception:
            self.meter.release_ordered(request.model_id, request.seq_id, ticket)
            raise
        try:
            result = await self.ctx.dispatcher.submit(request.model_id, request.seq_id, op, digest)
        except TreadleError as err:
            self._finish(request, "failed", err.code, digest)
            raise
        finally:
            self.meter.release_ordered(request.model_id, request.seq_id, ticket)
        if self._finish(request, "done", None, digest):  # applied now, exactly once: count it
            self.meter.count_ordered(tenant, request.model_id, op, result)
        return result

    def _finish(self, request: Any, status: str, code: str | None, digest: str) -> bool:
        """Record the call's end; whether this was the call that ended it."""
        with self.ctx.connection() as conn:
            return queries.finish_pending_op(
                conn, request.model_id, request.seq_id, status, code, digest
            )

    async def ForwardBackward(
        self, request: training_pb2.ForwardBackwardRequest, context: grpc.aio.ServicerContext
    ) -> training_pb2.ForwardOutput:
        result: ForwardResult = await self._ordered(
            context, request, lambda _: convert.forward_backward_op(request), "forward_backward"
        )
        return convert.forward_output(result)

    async def ForwardLogprobs(
        self, request: training_pb2.ForwardLogprobsRequest, context: grpc.aio.ServicerContext
    ) -> training_pb2.ForwardOutput:
        def build(tenant: str) -> OrderedOp:
            op = convert.forward_logprobs_op(request)
            if not request.reference_path:
                return op
            if request.reference:
                raise InvalidArgumentError(
                    "reference_path: give reference=true (the base model) or a "
                    "reference_path, not both"
                )
            with self.ctx.session() as s:
                model = self.ctx.model_row(s, tenant, request.model_id)
                ref = references.resolve(s, tenant, model, request.reference_path)
            return dataclasses.replace(op, reference_weights=ref)

        result: ForwardResult = await self._ordered(context, request, build, "forward_logprobs")
        return convert.forward_output(result)

    async def OptimStep(
        self, request: training_pb2.OptimStepRequest, context: grpc.aio.ServicerContext
    ) -> training_pb2.OptimStepResponse:
        def build(_: str) -> OrderedOp:
            if not request.HasField("adam_params"):
                raise InvalidArgumentError("adam_params: required")
            return OptimStepOp(convert.adam(request.adam_params))

        result: OptimStepResult = await self._ordered(context, request, build, "optim_step")
        with self.ctx.session() as s:
            queries.update_model_progress(s, request.model_id, version=result.step)
            auto = result.auto_checkpoint
            if auto is not None:
                tenant = self.ctx.tenant(context)
                row = self._record_checkpoint(
                    s,
                    tenant,
                    request.model_id,
                    "auto",
                    auto.directory,
                    auto.seq_id,
                    auto.step,
                    "auto",
                    auto.size_bytes,
                )
                queries.update_model_progress(s, request.model_id, last_checkpoint=row)
        return training_pb2.OptimStepResponse(step=result.step, metrics=dict(result.metrics))

    async def SyncWeights(
        self, request: training_pb2.SyncWeightsRequest, context: grpc.aio.ServicerContext
    ) -> training_pb2.SyncWeightsResponse:
        tenant = self.ctx.tenant(context)

        def build(tenant: str) -> SyncWeightsOp:
            if request.inflight:
                with self.ctx.session() as s:
                    if not queries.has_latest_sampler(s, tenant, request.model_id):
                        raise InvalidArgumentError(
                            f"inflight: model {request.model_id} has no sampler following "
                            "its latest weights, so no sequence could take the update in "
                            f"flight; create one from treadle://{request.model_id}/latest "
                            "first, or sync without inflight"
                        )
            return SyncWeightsOp(inflight=request.inflight)

        result: SyncResult = await self._ordered(context, request, build, "sync_weights")
        uri = weights_uri(request.model_id, result.version)
        response = training_pb2.SyncWeightsResponse(version=result.version, weights_uri=uri)
        with self.ctx.session() as s:
            if s.get(db.WeightVersion, (request.model_id, result.version)) is None:
                queries.add_weight_version(s, request.model_id, result.version, uri)
            queries.release_weight_versions(s, request.model_id, self.ctx.config.keep_versions)
            if request.create_sampler:
                row = self.ctx.model_row(s, tenant, request.model_id)
                sampler = queries.create_sampler(
                    s,
                    tenant_id=tenant,
                    base_model=row.base_model,
                    mode="version",
                    model_id=request.model_id,
                    pinned_version=result.version,
                )
                response.sampler_id = sampler.id
        return response

    async def SaveState(
        self, request: training_pb2.SaveStateRequest, context: grpc.aio.ServicerContext
    ) -> training_pb2.SaveStateResponse:
        tenant = self.ctx.tenant(context)

        def build(_: str) -> OrderedOp:
            name = check_name(request.name)
            return SaveStateOp(name, self.ctx.store.state_path(tenant, request.model_id, name))

        result: SaveResult = await self._ordered(context, request, build, "save_state")
        with self.ctx.session() as s:
            directory = self.ctx.store.state_path(tenant, request.model_id, request.name)
            row = self._record_checkpoint(
                s,
                tenant,
                request.model_id,
                request.name,
                directory,
                result.seq_id,
                result.step,
                "state",
                result.size_bytes,
            )
            queries.update_model_progress(s, request.model_id, last_checkpoint=row)
        uri = state_uri(request.model_id, request.name)
        return training_pb2.SaveStateResponse(path=uri, seq_id=result.seq_id, step=result.step)

    async def LoadState(
        self, request: training_pb2.LoadStateRequest, context: grpc.aio.ServicerContext
    ) -> training_pb2.LoadStateResponse:
        tenant = self.ctx.tenant(context)

        def build(_: str) -> OrderedOp:
            with self.ctx.session() as s:
                return LoadStateOp(self._checkpoint_dir(s, tenant, request.path, "path"))

        result: LoadResult = await self._ordered(context, request, build, "load_state")
        with self.ctx.session() as s:
            queries.update_model_progress(s, request.model_id, version=result.step)
        return training_pb2.LoadStateResponse(step=result.step)

    async def ListCheckpoints(
        self, request: training_pb2.ListCheckpointsRequest, context: grpc.aio.ServicerContext
    ) -> training_pb2.ListCheckpointsResponse:
        tenant = self.ctx.tenant(context)
        with self.ctx.session() as s:
            self.ctx.model_row(s, tenant, request.model_id)
            rows = queries.list_checkpoints(s, tenant, request.model_id)
            return training_pb2.ListCheckpointsResponse(
                checkpoints=[
                    training_pb2.Checkpoint(
                        path=c.uri,
                        name=c.name,
                        seq_id=c.seq_id,
                        step=c.step,
                        created_at=c.created_at.timestamp(),
                        size_bytes=c.size_bytes,
                    )
                    for c in rows
                ]
            )

    async def DeleteCheckpoint(
        self, request: training_pb2.DeleteCheckpointRequest, context: grpc.aio.ServicerContext
    ) -> training_pb2.DeleteCheckpointResponse:
        tenant = self.ctx.tenant(context)
        parse_state_uri(request.path, "path")
        with self.ctx.session() as s:
            row = queries.get_checkpoint_by_uri(s, tenant, request.path)
            if row is None:
                raise NotFoundError(f"path: checkpoint {request.path!r} not found")
            model = s.get(db.Model, row.model_id)
            if model is not None and model.last_checkpoint_id == row.id:
                if model.status == "unloaded":
                    raise FailedPreconditionError(
                        f"path: {request.path!r} is what brings unloaded model {model.id} "
                        "back; restore the model first (any call on it does), or delete the model"
                    )
                # A restart brings the model back at its newest remaining checkpoint.
                newer = [c for c in queries.list_checkpoints(s, tenant, model.id) if c.id != row.id]
                model.last_checkpoint = newer[-1] if newer else None
                model.last_checkpoint_seq_id = newer[-1].seq_id if newer else 0
                s.flush()
            storage_path = row.storage_path
            s.delete(row)
        self.ctx.store.delete(storage_path)
        return training_pb2.DeleteCheckpointResponse()

    async def RestoreModel(
        self, request: training_pb2.RestoreModelRequest, context: grpc.aio.ServicerContext
    ) -> training_pb2.ModelInfo:
        tenant = self.ctx.tenant(context)
        async with self.ctx.lifecycle.using(tenant, request.model_id):
            pass
        with self.ctx.session() as s:
            return self._info(self.ctx.model_row(s, tenant, request.model_id))

    async def ExportWeights(
        self, request: training_pb2.ExportWeightsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[training_pb2.FileChunk]:
        ctx = self.ctx
        tenant = ctx.tenant(context)
        directory = ctx.config.data_dir / "exports" / db.new_id("x")
        try:
            async with ctx.lifecycle.using(tenant, request.model_id):
                names = await ctx.dispatcher.export_weights(
                    request.model_id, directory, merged=request.merged
                )
            for name in names:
                size = (directory / name).stat().st_size
                with open(directory / name, "rb") as f:  # chunk by chunk: a merged model is big
                    for offset in range(0, max(size, 1), EXPORT_CHUNK_BYTES):
                        yield training_pb2.FileChunk(
                            file_name=name,
                            offset=offset,
                            data=f.read(EXPORT_CHUNK_BYTES),
                            last=offset + EXPORT_CHUNK_BYTES >= size,
                        )
        finally:
            shutil.rmtree(directory, ignore_errors=True)

    def _record_checkpoint(
        self,
        s: Any,
        tenant: str,
        model_id: str,
        name: str,
        directory: str,
        seq_id: int,
        step: int,
        kind: str,
        size: int,
    ) -> db.Checkpoint:
        """The DB row of a checkpoint just written; a name saved again replaces its row
        (a retried call finds its own row and keeps it).

        The row is updated in place, never deleted and added again: the model may
        point at it as its last checkpoint (a foreign key), and a delete would fail
        after the engine has already written the new state."""
        uri = state_uri(model_id, name)
        existing = queries.get_checkpoint_by_uri(s, tenant, uri)
        if existing is not None and existing.seq_id == seq_id:
            return existing
        if existing is not None:
            existing.storage_path = directory
            existing.seq_id = seq_id
            existing.step = step
            existing.kind = kind
            existing.size_bytes = size
            existing.created_at = db.utcnow()
            s.flush()
            return existing
        return queries.add_checkpoint(
            s,
            tenant_id=tenant,
            model_id=model_id,
            name=name,
            uri=uri,
            storage_path=directory,
            seq_id=seq_id,
            step=step,
            kind=kind,
            size_bytes=size,
        )

    def _checkpoint_dir(self, s: Any, tenant: str, uri: str, field: str) -> str:
        """The storage path (a directory, or s3://...) of the tenant's checkpoint."""
        parse_state_uri(uri, field)
        row = queries.get_checkpoint_by_uri(s, tenant, uri)
        if row is None:
            raise NotFoundError(f"{field}: checkpoint {uri!r} not found")
        return storage_path_str(row.storage_path)
