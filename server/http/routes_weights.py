"""Training runs (treadle's models) and their checkpoints: list, get, delete, what
a path holds (weights_info). Everything is the tenant's own: another tenant's
ids answer 404."""

from __future__ import annotations

from typing import Any

from fastapi import Depends, Request

from treadle.server.http import wire
from treadle.server.http.auth import tenant
from treadle.server.http.routes_checkpoints import CheckpointRef, checkpoint_json, checkpoint_ref
from treadle.server.http.state import HttpState, api_router, state
from treadle.server.service.types import ModelRecord

router = api_router()


def _run(st: HttpState, info: ModelRecord, tenant_id: str, run_id: str = "") -> dict[str, Any]:
    """A model as the SDK's ``TrainingRun``, under the id the caller uses (``run_id``)."""
    run_id = run_id or info.model_id
    checkpoints = st.service.checkpoints.list(tenant_id, info.model_id)
    last = max(checkpoints, key=lambda c: c.created_at, default=None)
    sampler = st.names.last_sampler_weights(tenant_id, info.model_id)
    return {
        "training_run_id": run_id,
        "base_model": info.base_model,
        "model_owner": tenant_id,
        "is_lora": info.is_lora,
        "corrupted": info.status == "lost",
        "lora_rank": info.lora_rank if info.is_lora else None,
        "last_request_time": wire.iso_time(info.last_request_at or info.created_at),
        "last_checkpoint": checkpoint_json(st, last, run_id) if last is not None else None,
        "last_sampler_checkpoint": (
            {
                "checkpoint_id": f"sampler_weights/{sampler[0]}",
                "checkpoint_type": "sampler",
                "time": wire.iso_time(sampler[1]),
                "tinker_path": f"tinker://{run_id}/sampler_weights/{sampler[0]}",
                "public": False,
            }
            if sampler is not None
            else None
        ),
        "user_metadata": dict(info.user_metadata) or None,
    }


@router.get("/training_runs")
async def list_training_runs(
    request: Request, tenant_id: str = Depends(tenant), st: HttpState = Depends(state)
) -> dict[str, Any]:
    limit, offset = wire.page(request.query_params, 20)
    runs = st.service.models.list(tenant_id)
    page = runs[offset : offset + limit]
    return {
        "training_runs": [_run(st, m, tenant_id) for m in page],
        "cursor": {"offset": offset, "limit": limit, "total_count": len(runs)},
    }


@router.get("/training_runs/{model_id}")
async def get_training_run(
    model_id: str, tenant_id: str = Depends(tenant), st: HttpState = Depends(state)
) -> dict[str, Any]:
    info = st.service.models.info(tenant_id, st.names.model_id(tenant_id, model_id))
    return _run(st, info, tenant_id, model_id)


@router.get("/training_runs/{model_id}/usage")
async def get_usage(
    model_id: str, tenant_id: str = Depends(tenant), st: HttpState = Depends(state)
) -> dict[str, Any]:
    """What the run used (treadle's, for scripts): tokens trained, sampled, scored,
    calls, device-seconds, and the cost at the operator's prices (null: none set)."""
    u = st.service.runs.usage(tenant_id, st.names.model_id(tenant_id, model_id))
    return {
        "training_run_id": model_id,
        "tokens_trained": u.tokens_trained,
        "tokens_sampled": u.tokens_sampled,
        "tokens_scored": u.tokens_scored,
        "calls": u.calls,
        "device_s": u.device_s,
        "cost": u.cost,
        "currency": u.currency,
    }


@router.get("/training_runs/{model_id}/checkpoints")
async def list_checkpoints(
    model_id: str, tenant_id: str = Depends(tenant), st: HttpState = Depends(state)
) -> dict[str, Any]:
    treadle_id = st.names.model_id(tenant_id, model_id)
    out = [
        checkpoint_json(st, c, model_id) for c in st.service.checkpoints.list(tenant_id, treadle_id)
    ]
    return {"checkpoints": out, "cursor": None}


@router.delete("/training_runs/{model_id}/checkpoints/{kind}/{name}")
async def delete_checkpoint(ref: CheckpointRef = Depends(checkpoint_ref)) -> dict[str, Any]:
    ref.st.service.checkpoints.delete(ref.tenant_id, ref.uri)
    return {}


@router.post("/weights_info")
async def weights_info(
    request: Request, tenant_id: str = Depends(tenant), st: HttpState = Depends(state)
) -> dict[str, Any]:
    body = wire.json_body(await request.body())
    path = body.get("tinker_path")
    model_id, _, _ = st.names.split(tenant_id, path, "tinker_path")
    info = st.service.models.info(tenant_id, model_id)
    return {
        "base_model": info.base_model,
        "is_lora": info.is_lora,
        "lora_rank": info.lora_rank if info.is_lora else None,
    }
