"""Checkpoint management over the tenant's whole store: every checkpoint of the
tenant (``/checkpoints``), storage usage, a checkpoint's TTL, publishing, and
``copy_weights``.

"Public" under tenant walls: a published checkpoint is readable by any tenant's
key through its tinker path (load it, create a model from it, copy it into the
caller's own models); only its owner can delete, unpublish or set its TTL.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from fastapi import Depends, Request

from treadle.errors import InvalidArgumentError
from treadle.server.http import wire
from treadle.server.http.auth import tenant
from treadle.server.http.state import HttpState, api_router, state
from treadle.server.service.types import CheckpointRecord

router = api_router()


def checkpoint_json(st: HttpState, c: CheckpointRecord, model_id: str = "") -> dict[str, Any]:
    """A treadle checkpoint as the SDK's ``Checkpoint`` (under the id the caller uses)."""
    return {
        "checkpoint_id": f"weights/{c.name}",
        "checkpoint_type": "training",
        "time": wire.iso_time(c.created_at),
        "tinker_path": st.names.weights_path(model_id or c.model_id, c.name),
        "size_bytes": c.size_bytes,
        "public": c.public,
        "expires_at": wire.iso_time(c.expires_at) if c.expires_at is not None else None,
    }


def _uri(st: HttpState, tenant_id: str, model_id: str, kind: str, name: str) -> str:
    return st.names.state_uri(tenant_id, f"tinker://{model_id}/{kind}/{name}")


@dataclass(frozen=True)
class CheckpointRef:
    """The checkpoint a ``.../checkpoints/{kind}/{name}...`` route names, resolved
    for the calling tenant (a route dependency: ``Depends(checkpoint_ref)``)."""

    tenant_id: str
    uri: str
    st: HttpState


async def checkpoint_ref(
    model_id: str,
    kind: str,
    name: str,
    tenant_id: str = Depends(tenant),
    st: HttpState = Depends(state),
) -> CheckpointRef:
    return CheckpointRef(tenant_id, _uri(st, tenant_id, model_id, kind, name), st)


def _page(request: Request) -> tuple[int, int]:
    limit, offset = wire.page(request.query_params, 100)
    if limit < 1 or offset < 0:
        raise InvalidArgumentError(
            f"limit, offset: limit >= 1, offset >= 0 (got {limit}, {offset})"
        )
    return limit, offset


@router.get("/checkpoints")
async def list_user_checkpoints(
    request: Request, tenant_id: str = Depends(tenant), st: HttpState = Depends(state)
) -> dict[str, Any]:
    limit, offset = _page(request)
    rows = st.service.checkpoints.list_all(tenant_id)
    return {
        "checkpoints": [checkpoint_json(st, c) for c in rows[offset : offset + limit]],
        "cursor": {"offset": offset, "limit": limit, "total_count": len(rows)},
    }


@router.get("/billing/usage/checkpoints/current")
async def checkpoint_storage_usage(
    tenant_id: str = Depends(tenant), st: HttpState = Depends(state)
) -> dict[str, Any]:
    """What the tenant stores now; treadle has no projects and no prices."""
    count, size = st.service.checkpoints.usage(tenant_id)
    return {
        "effective_rate_usd_per_gigabyte_month": None,
        "data": [
            {
                "checkpoint_count": count,
                "size_bytes": size,
                "size_gigabytes": size / 1e9,
                "estimated_monthly_cost_usd": None,
            }
        ],
    }


@router.put("/training_runs/{model_id}/checkpoints/{kind}/{name}/ttl")
async def set_checkpoint_ttl(
    model_id: str,
    kind: str,
    name: str,
    request: Request,
    tenant_id: str = Depends(tenant),
    st: HttpState = Depends(state),
) -> dict[str, Any]:
    body = wire.json_body(await request.body())
    ttl = body.get("ttl_seconds")
    if ttl is not None and (not isinstance(ttl, int) or isinstance(ttl, bool)):
        raise InvalidArgumentError(f"ttl_seconds: an integer or null, got {ttl!r}")
    st.service.checkpoints.set_ttl(tenant_id, _uri(st, tenant_id, model_id, kind, name), ttl)
    return {}


@router.post("/training_runs/{model_id}/checkpoints/{kind}/{name}/publish")
async def publish_checkpoint(ref: CheckpointRef = Depends(checkpoint_ref)) -> dict[str, Any]:
    ref.st.service.checkpoints.set_public(ref.tenant_id, ref.uri, True)
    return {}


@router.delete("/training_runs/{model_id}/checkpoints/{kind}/{name}/publish")
async def unpublish_checkpoint(ref: CheckpointRef = Depends(checkpoint_ref)) -> dict[str, Any]:
    ref.st.service.checkpoints.set_public(ref.tenant_id, ref.uri, False)
    return {}


@router.post("/copy_weights")
async def copy_weights(
    request: Request, tenant_id: str = Depends(tenant), st: HttpState = Depends(state)
) -> dict[str, Any]:
    """A copy of a readable training checkpoint in a new model of the caller's
    (treadle has no projects: the copy is the caller's whatever project is named).
    The copy is a new set of files, not shared storage."""
    body = wire.json_body(await request.body())
    source = wire.field(body, "source_path", str)
    ttl = body.get("ttl_seconds")
    if ttl is not None and (not isinstance(ttl, int) or isinstance(ttl, bool)):
        raise InvalidArgumentError(f"ttl_seconds: an integer or null, got {ttl!r}")
    uri = st.names.state_uri(tenant_id, source, "source_path")
    copied = await asyncio.to_thread(st.service.checkpoints.copy, tenant_id, uri, ttl)
    return {"tinker_path": st.names.tinker_from_state_uri(copied)}
