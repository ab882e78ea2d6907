"""The ordered training calls of a tenant's model, for any transport.

Each method takes the caller's tenant, the call's identity (``OrderedCall``)
and its parsed input, runs it through the one pipeline (``OrderedPipeline``), and
does what must follow once the engine has applied it (weight versions,
checkpoint rows, the model's progress). Every method also takes ``admitted``
so ``CallHandle.start`` can run it in a task and learn when it is queued.
"""

from __future__ import annotations

import dataclasses
from typing import cast

from treadle.common.db import models as db
from treadle.common.engine.domain import (
    AdamConfig,
    ForwardBackwardOp,
    ForwardLogprobsOp,
    ForwardResult,
    LoadResult,
    LoadStateOp,
    OptimStepOp,
    OptimStepResult,
    OrderedOp,
    SamplerTarget,
    SaveResult,
    SaveStateOp,
    SyncResult,
    SyncWeightsOp,
)
from treadle.common.store import check_name, state_uri, weights_uri
from treadle.errors import InvalidArgumentError
from treadle.server import references
from treadle.server.context import ServerContext
from treadle.server.db import queries
from treadle.server.service.checkpoints import CheckpointService
from treadle.server.service.ordered import Admission, OrderedPipeline
from treadle.server.service.sampling import SamplingService
from treadle.server.service.types import OrderedCall, Parsed, SavedState, SyncOutcome, unwrap


class TrainingService:
    def __init__(
        self,
        ctx: ServerContext,
        calls: OrderedPipeline,
        checkpoints: CheckpointService,
        samplers: SamplingService,
    ) -> None:
        self.ctx = ctx
        self.calls = calls
        self.checkpoints = checkpoints
        self.samplers = samplers  # knows the sampler a sync makes, as create_sampler's

    async def forward_backward(
        self,
        tenant: str,
        call: OrderedCall,
        op: Parsed[ForwardBackwardOp],
        *,
        admitted: Admission | None = None,
    ) -> ForwardResult:
        """Gradients of the loss (a sum over tokens), added to those accumulated."""
        result = await self.calls.run(
            tenant, call, lambda: unwrap(op), "forward_backward", admitted=admitted
        )
        return cast(ForwardResult, result)

    async def forward_logprobs(
        self,
        tenant: str,
        call: OrderedCall,
        op: Parsed[ForwardLogprobsOp],
        reference_path: str = "",
        *,
        admitted: Admission | None = None,
    ) -> ForwardResult:
        """Per-token logprobs under the model's weights, the base model's
        (``op.reference``), or a checkpoint or weight version of the tenant's
        (``reference_path``)."""

        def build() -> OrderedOp:
            parsed = unwrap(op)
            if not reference_path:
                return parsed
            if parsed.reference:
                raise InvalidArgumentError(
                    "reference_path: give reference=true (the base model) or a "
                    "reference_path, not both"
                )
            with self.ctx.session() as s:
                model = self.ctx.model_row(s, tenant, call.model_id)
                ref = references.resolve(s, tenant, model, reference_path)
            return dataclasses.replace(parsed, reference_weights=ref)

        result = await self.calls.run(tenant, call, build, "forward_logprobs", admitted=admitted)
        return cast(ForwardResult, result)

    async def optim_step(
        self,
        tenant: str,
        call: OrderedCall,
        adam: Parsed[AdamConfig],
        *,
        admitted: Admission | None = None,
    ) -> OptimStepResult:
        """One optimizer step (a barrier); records an auto-checkpoint it wrote."""
        result = cast(
            OptimStepResult,
            await self.calls.run(
                tenant, call, lambda: OptimStepOp(unwrap(adam)), "optim_step", admitted=admitted
            ),
        )
        auto = result.auto_checkpoint
        if auto is None:  # the hot path: every step
            with self.ctx.connection() as conn:
                queries.record_version(conn, call.model_id, result.step)
            return result
        with self.ctx.session() as s:
            row = self.checkpoints.record(
                s,
                tenant,
                call.model_id,
                "auto",
                auto.directory,
                auto.seq_id,
                auto.step,
                "auto",
                auto.size_bytes,
            )
            queries.update_model_progress(
                s, call.model_id, version=result.step, last_checkpoint=row
            )
        return result

    async def sync_weights(
        self,
        tenant: str,
        call: OrderedCall,
        inflight: bool = False,
        sampler: Parsed[str] = "",
        placement: Parsed[str] = "",
        *,
        admitted: Admission | None = None,
    ) -> SyncOutcome:
        """Publish the current weights as a new version (a barrier); the oldest
        versions past the configured count are released. ``inflight``: samplers
        following the model's latest weights take them mid-sequence.
        ``sampler``: also make a sampler on them: "version" pinned to the new
        version, "latest" following the model's latest weights (tinker's
        ``kind="inflight"``: every such sampler of the model reads the one target
        that each later sync moves; sequences in flight take this sync's weights
        when the model has such samplers already); "" none. ``placement``: where
        that sampler samples, as ``create_sampler``'s (checked before the sync is
        applied: a sampler that cannot sample there refuses the whole call)."""

        def build() -> SyncWeightsOp:
            mode = unwrap(sampler)
            following = False
            if inflight:
                with self.ctx.session() as s:
                    following = queries.has_latest_sampler(s, tenant, call.model_id)
                if not following and mode != "latest":
                    raise InvalidArgumentError(
                        f"inflight: model {call.model_id} has no sampler following "
                        "its latest weights, so no sequence could take the update in "
                        f"flight; create one from treadle://{call.model_id}/latest "
                        "first, or sync without inflight"
                    )
            # last: a pool sampler's check has the model's next versions published there
            self.samplers.check_placement(tenant, call.model_id, unwrap(placement), bool(mode))
            return SyncWeightsOp(inflight=following)

        result = cast(
            SyncResult, await self.calls.run(tenant, call, build, "sync_weights", admitted=admitted)
        )
        uri = weights_uri(call.model_id, result.version)
        mode, where = unwrap(sampler), unwrap(placement)
        sampler_id, made = "", None
        with self.ctx.session() as s:
            if s.get(db.WeightVersion, (call.model_id, result.version)) is None:
                queries.add_weight_version(s, call.model_id, result.version, uri)
            queries.release_weight_versions(s, call.model_id, self.ctx.config.keep_versions)
            if mode:
                row = self.ctx.model_row(s, tenant, call.model_id)
                pinned = result.version if mode == "version" else None
                created = queries.create_sampler(
                    s,
                    tenant_id=tenant,
                    base_model=row.base_model,
                    mode=mode,
                    model_id=call.model_id,
                    pinned_version=pinned,
                    placement=where or None,
                )
                sampler_id = created.id
                made = SamplerTarget(row.base_model, call.model_id, pinned, placement=where)
        if made is not None:  # committed: its first sample finds it without a database read
            self.samplers.remember(tenant, sampler_id, made)
        return SyncOutcome(result.version, uri, sampler_id)

    async def save_state(
        self, tenant: str, call: OrderedCall, name: str, *, admitted: Admission | None = None
    ) -> SavedState:
        """Checkpoint weights and optimizer state under ``name`` (a barrier); the
        model comes back there after a restart."""

        def build() -> OrderedOp:
            checked = check_name(name)
            return SaveStateOp(checked, self.ctx.store.state_path(tenant, call.model_id, checked))

        result = cast(
            SaveResult, await self.calls.run(tenant, call, build, "save_state", admitted=admitted)
        )
        with self.ctx.session() as s:
            directory = self.ctx.store.state_path(tenant, call.model_id, name)
            row = self.checkpoints.record(
                s,
                tenant,
                call.model_id,
                name,
                directory,
                result.seq_id,
                result.step,
                "state",
                result.size_bytes,
            )
            queries.update_model_progress(s, call.model_id, last_checkpoint=row)
        return SavedState(state_uri(call.model_id, name), result.seq_id, result.step)

    async def load_state(
        self,
        tenant: str,
        call: OrderedCall,
        path: str,
        *,
        optimizer: bool = True,
        admitted: Admission | None = None,
    ) -> LoadResult:
        """Load weights and optimizer state from the tenant's checkpoint ``path``
        (a barrier); without ``optimizer``, the weights only (fresh Adam moments)."""

        def build() -> OrderedOp:
            with self.ctx.session() as s:
                directory = self.checkpoints.resolve(s, tenant, path, "path")
            return LoadStateOp(directory, optimizer=optimizer)

        result = cast(
            LoadResult, await self.calls.run(tenant, call, build, "load_state", admitted=admitted)
        )
        with self.ctx.session() as s:
            queries.update_model_progress(s, call.model_id, version=result.step)
        return result
