"""A tenant's training models: create (fresh or from a checkpoint), info, list,
restore, delete, export. Another tenant's model answers NOT_FOUND, exactly like
a model that does not exist.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import dataclasses
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

from sqlalchemy.orm import object_session

from treadle.common.db import models as db
from treadle.common.engine.domain import DTYPES, ModelSpec
from treadle.common.engine.messages import CreateModelCall, DeleteModelCall, ExportCall
from treadle.common.store import copy_checkpoint, storage_path_str
from treadle.errors import InvalidArgumentError, NotFoundError, TreadleError
from treadle.server.context import ServerContext
from treadle.server.db import ops_log, queries, session_queries, tenancy
from treadle.server.rpc import convert
from treadle.server.service.checkpoints import CheckpointService
from treadle.server.service.types import ModelRecord, NewModel

MAX_LORA_RANK = 1024
#: name of the checkpoint a model created from a state keeps of its starting point
INIT_CHECKPOINT = "init"


class ModelService:
    def __init__(self, ctx: ServerContext, checkpoints: CheckpointService) -> None:
        self.ctx = ctx
        self.checkpoints = checkpoints

    async def create(self, tenant: str, req: NewModel) -> ModelRecord:
        """A new model under the tenant's model quota, at seq_id 0 (its first
        call is 1). From a checkpoint, the model keeps its own copy of it
        (``init``), so a restart or the source's deletion brings it back there."""
        ctx = self.ctx
        from_state: str | None = None
        if req.from_state:
            with ctx.session() as s:
                from_state = self.checkpoints.resolve(s, tenant, req.from_state, "from_state")
            manifest = ctx.store.read_manifest(from_state)
            base_model, rank = manifest["base_model"], int(manifest["lora_rank"])
            alpha, seed, dtype = (
                float(manifest["lora_alpha"]),
                int(manifest["seed"]),
                manifest["dtype"],
            )
            modules = convert.manifest_modules(manifest)
        else:
            base_model, rank, seed = ctx.base_model_name(req.base_model), req.lora_rank, req.seed
            alpha = req.lora_alpha or float(rank)
            dtype = req.dtype or ctx.config.default_dtype
            modules = req.modules
        if not base_model:
            raise InvalidArgumentError("base_model: required")
        if base_model not in ctx.catalog.base_model_names():
            raise NotFoundError(
                f"base_model {base_model!r} is not served here; served: {ctx.catalog.base_model_names()}"
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
            if req.session_id:
                session = session_queries.get_session(s, tenant, req.session_id)
                if session is None or session.ended_at is not None:
                    raise NotFoundError(f"session_id: session {req.session_id!r} not found")
            row = queries.create_model(
                s,
                tenant_id=tenant,
                base_model=base_model,
                lora_rank=rank,
                lora_alpha=alpha,
                seed=seed,
                dtype=dtype,
                modules=modules,
                session_id=req.session_id or None,
                user_metadata=dict(req.user_metadata),
            )
            model_id = row.id
        spec = ModelSpec(model_id, tenant, base_model, rank, alpha, seed, dtype, *modules)
        init = None
        load_from = from_state
        if from_state is not None and req.weights_only:
            # The model's own copy holds no optimizer state, so it loads (now and
            # after a restart) with fresh Adam moments.
            init_path = ctx.store.state_path(tenant, model_id, INIT_CHECKPOINT)
            size = await asyncio.to_thread(
                copy_checkpoint, ctx.store, from_state, init_path, weights_only=True
            )
            init = (init_path, size)
            load_from = init_path
        try:
            status = await ctx.dispatcher.call(
                CreateModelCall(
                    spec, storage_path_str(load_from) if load_from is not None else None, 1
                )
            )
        except TreadleError:
            with ctx.session() as s:
                queries.mark_model_deleted(s, tenant, model_id)
            raise
        ctx.owners[model_id] = tenant
        ctx.lifecycle.touch(model_id)
        if from_state is not None and init is None:
            init_path = ctx.store.state_path(tenant, model_id, INIT_CHECKPOINT)
            size = await asyncio.to_thread(copy_checkpoint, ctx.store, from_state, init_path)
            init = (init_path, size)
        with ctx.session() as s:
            if status.version:
                queries.update_model_progress(s, model_id, version=status.version)
            if init is not None:
                ckpt = self.checkpoints.record(
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
                queries.update_model_progress(s, model_id, last_checkpoint=ckpt)
            return self._info(ctx.model_row(s, tenant, model_id))

    def info(self, tenant: str, model_id: str) -> ModelRecord:
        with self.ctx.session() as s:
            return self._info(self.ctx.model_row(s, tenant, model_id))

    def list(self, tenant: str) -> list[ModelRecord]:
        with self.ctx.session() as s:
            return [self._info(m) for m in queries.list_models(s, tenant)]

    async def restore(self, tenant: str, model_id: str) -> ModelRecord:
        """Load an unloaded model back now (any call on it would); its info."""
        async with self.ctx.lifecycle.using(tenant, model_id):
            pass
        return self.info(tenant, model_id)

    async def delete(self, tenant: str, model_id: str) -> None:
        ctx = self.ctx
        await ctx.lifecycle.wait_idle_transition(model_id)
        if model_id not in ctx.owners:  # unloaded: only its row is left
            with ctx.session() as s:
                row = ctx.model_row(s, tenant, model_id)
                if row.status not in ("unloaded", "lost"):
                    raise NotFoundError(f"model {model_id!r} not found")
                queries.mark_model_deleted(s, tenant, model_id)
            return
        ctx.require_model(tenant, model_id)
        with ctx.session() as s:
            queries.mark_model_deleted(s, tenant, model_id)
        ctx.owners.pop(model_id, None)
        ctx.lifecycle.forget(model_id)
        with contextlib.suppress(NotFoundError):
            await ctx.dispatcher.call(DeleteModelCall(model_id))

    @contextlib.asynccontextmanager
    async def export_weights(
        self, tenant: str, model_id: str, *, merged: bool
    ) -> AsyncIterator[builtins.list[Path]]:
        """The model's current weights written as files (a PEFT adapter, or a merged
        HF checkpoint with tokenizer files), removed when the block ends."""
        directory = self.ctx.config.data_dir / "exports" / db.new_id("x")
        try:
            async with self.ctx.lifecycle.using(tenant, model_id):
                exported = await self.ctx.dispatcher.call(
                    ExportCall(model_id, str(directory), merged)
                )
                names = exported.names
            yield [directory / name for name in names]
        finally:
            shutil.rmtree(directory, ignore_errors=True)

    def _info(self, row: db.Model) -> ModelRecord:
        next_seq_id = 0
        if row.status == "unloaded":  # it comes back at its checkpoint, continuing after it
            next_seq_id = row.last_checkpoint_seq_id + 1
        elif row.status == "lost" and (s := object_session(row)) is not None:
            # its next call replays it to its last applied step (or a load_state places it)
            next_seq_id = ops_log.last_applied_seq(s, row.id) + 1
        info = ModelRecord(
            model_id=row.id,
            base_model=row.base_model,
            is_lora=row.lora_rank > 0,
            lora_rank=row.lora_rank,
            dtype=row.dtype,
            version=row.version,
            next_seq_id=next_seq_id,
            last_checkpoint_seq_id=row.last_checkpoint_seq_id,
            status=row.status,
            created_at=row.created_at.timestamp(),
            session_id=row.session_id or "",
            user_metadata=dict(row.user_metadata or {}),
            last_request_at=self.ctx.lifecycle.last_used.get(row.id)
            or max(row.created_at, row.updated_at).timestamp(),
        )
        try:
            status = self.ctx.dispatcher.model_status(row.id)
        except NotFoundError:
            return info
        return dataclasses.replace(
            info,
            version=status.version,
            next_seq_id=status.next_seq_id,
            last_checkpoint_seq_id=status.last_checkpoint_seq_id,
        )
