"""Checkpoint routes: a training run's checkpoints (list, delete), what a path
holds (weights_info). Paths are the tenant's own: another tenant's answer 404."""

from __future__ import annotations

import datetime as dt
from typing import Any

from fastapi import APIRouter, Depends, Request

from treadle.errors import UnimplementedError
from treadle.server.http import wire
from treadle.server.http.auth import tenant
from treadle.server.http.state import HttpState, state

router = APIRouter(prefix="/api/v1")


@router.get("/training_runs/{model_id}/checkpoints")
async def list_checkpoints(
    model_id: str, tenant_id: str = Depends(tenant), st: HttpState = Depends(state)
) -> dict[str, Any]:
    treadle_id = st.names.model_id(tenant_id, model_id)
    out = []
    for c in st.service.checkpoints.list(tenant_id, treadle_id):
        out.append(
            {
                "checkpoint_id": f"weights/{c.name}",
                "checkpoint_type": "training",
                "time": dt.datetime.fromtimestamp(c.created_at, dt.timezone.utc).isoformat(),
                "tinker_path": st.names.weights_path(model_id, c.name),
                "size_bytes": c.size_bytes,
                "public": False,
            }
        )
    return {"checkpoints": out, "cursor": None}


@router.delete("/training_runs/{model_id}/checkpoints/{kind}/{name}")
async def delete_checkpoint(
    model_id: str,
    kind: str,
    name: str,
    tenant_id: str = Depends(tenant),
    st: HttpState = Depends(state),
) -> dict[str, Any]:
    path = f"tinker://{model_id}/{kind}/{name}"
    st.service.checkpoints.delete(tenant_id, st.names.state_uri(tenant_id, path))
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


@router.post("/copy_weights")
async def copy_weights(tenant_id: str = Depends(tenant)) -> dict[str, Any]:
    raise UnimplementedError("copy_weights: not supported by this server yet")
