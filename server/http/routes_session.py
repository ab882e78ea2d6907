"""Start-up and session routes: client config, sessions and their heartbeats
(which keep the session's models loaded: ``server.lifecycle``), telemetry,
health and the server's capabilities."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request

from treadle.errors import NotFoundError
from treadle.server.db import models as db
from treadle.server.db import queries
from treadle.server.http import wire
from treadle.server.http.auth import tenant
from treadle.server.http.errors import GoneError
from treadle.server.http.state import HttpState, state

router = APIRouter(prefix="/api/v1")


@router.post("/client/config")
async def client_config() -> dict[str, Any]:
    """Every optional SDK feature off: the plain paths are the ones served here."""
    return {
        "pjwt_auth_enabled": False,
        "proto_compress_fwdbwd": False,
        "use_pyqwest_transport": False,
        "sample_use_retrieve_futures": False,
        "custom_loss_server_side": False,
        "sample_join_sampling_session": False,
    }


@router.post("/client/dynamic_config")
async def client_dynamic_config() -> dict[str, Any]:
    return {}


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/get_server_capabilities")
async def capabilities(
    request: Request, tenant_id: str = Depends(tenant), st: HttpState = Depends(state)
) -> dict[str, Any]:
    max_len = st.ctx.config.sampler_max_len
    return {
        "supported_models": [
            {
                "model_name": name,
                "max_context_length": max_len,
                "trainable": True,
                "sampleable": True,
            }
            for name in st.ctx.dispatcher.base_model_names()
        ]
    }


@router.post("/telemetry")
async def telemetry(tenant_id: str = Depends(tenant)) -> dict[str, str]:
    """Accepted and dropped: treadle keeps no client telemetry."""
    return {"status": "accepted"}


@router.post("/create_session")
async def create_session(
    request: Request, tenant_id: str = Depends(tenant), st: HttpState = Depends(state)
) -> dict[str, Any]:
    body = wire.json_body(await request.body())
    client = f"tinker-sdk {body.get('sdk_version') or ''}".strip()
    with st.ctx.session() as s:
        row = queries.create_session(s, tenant_id, client)
        return {"type": "create_session", "session_id": row.id}


def _live_session(st: HttpState, tenant_id: str, session_id: object) -> Any:
    if not isinstance(session_id, str) or not session_id:
        raise NotFoundError("session_id: required")
    with st.ctx.session() as s:
        row = queries.get_session(s, tenant_id, session_id)
        if row is None:
            raise NotFoundError(f"session_id: session {session_id!r} not found")
        if row.ended_at is not None:  # the SDK stops its heartbeat loop on 410
            raise GoneError(f"session_id: session {session_id!r} has finished")
        row.last_heartbeat_at = db.utcnow()
    return row


@router.post("/session_heartbeat")
async def session_heartbeat(
    request: Request, tenant_id: str = Depends(tenant), st: HttpState = Depends(state)
) -> dict[str, Any]:
    body = wire.json_body(await request.body())
    _live_session(st, tenant_id, body.get("session_id"))
    return {"type": "session_heartbeat"}


@router.post("/sessions/{session_id}/finish")
async def finish_session(
    session_id: str, tenant_id: str = Depends(tenant), st: HttpState = Depends(state)
) -> dict[str, Any]:
    """Idempotent; the session's models stay, only their heartbeats stop."""
    with st.ctx.session() as s:
        row = queries.get_session(s, tenant_id, session_id)
        if row is None:
            raise NotFoundError(f"session_id: session {session_id!r} not found")
        if row.ended_at is None:
            row.ended_at = db.utcnow()
    return {"session_id": session_id, "status": "finished"}
