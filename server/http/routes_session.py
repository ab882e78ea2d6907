"""Start-up and session routes: client config, sessions and their heartbeats
(which keep the session's models loaded: ``server.lifecycle``), telemetry,
health and the server's capabilities."""

from __future__ import annotations

from typing import Any

from fastapi import Depends, Request

from treadle.errors import NotFoundError
from treadle.server.http import session_search, session_trace, wire
from treadle.server.http.auth import tenant
from treadle.server.http.errors import GoneError
from treadle.server.http.state import HttpState, api_router, state

router = api_router()


@router.post("/client/config")
async def client_config() -> dict[str, Any]:
    """Every optional SDK feature off: the plain paths are the ones served here.
    The SDK's pyqwest transport too: httpx's own cost less per request over
    loopback, where it was measured (benchmarks/tinker_api.py)."""
    return {
        "pjwt_auth_enabled": False,
        "proto_compress_fwdbwd": False,
        "sample_use_retrieve_futures": False,
        "custom_loss_server_side": False,
        "sample_join_sampling_session": False,
        "use_pyqwest_transport": False,
    }


@router.post("/client/dynamic_config")
async def client_dynamic_config() -> dict[str, Any]:
    return {}


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/get_server_capabilities")
async def capabilities(
    tenant_id: str = Depends(tenant), st: HttpState = Depends(state)
) -> dict[str, Any]:
    return {
        "supported_models": [
            {
                "model_name": m.name,
                "max_context_length": m.max_context,
                "trainable": True,
                "sampleable": True,
            }
            for m in st.service.info.base_models()
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
    info = st.service.sessions.create(
        tenant_id,
        client,
        display_name=wire.field(body, "display_name", str, None),
        user_metadata=session_search.user_metadata(body),
    )
    return {"type": "create_session", "session_id": info.session_id}


@router.post("/session_heartbeat")
async def session_heartbeat(
    request: Request, tenant_id: str = Depends(tenant), st: HttpState = Depends(state)
) -> dict[str, Any]:
    """Keeps the session's models loaded (``server.lifecycle``). A session finished
    through this API answers 410, on which the SDK stops its heartbeat loop."""
    body = wire.json_body(await request.body())
    session_id = wire.field(body, "session_id", str)
    if (tenant_id, session_id) in st.finished_sessions:
        raise GoneError(f"session_id: session {session_id!r} has finished")
    st.service.sessions.heartbeat(tenant_id, session_id)
    return {"type": "session_heartbeat"}


@router.get("/sessions")
async def list_sessions(
    request: Request, tenant_id: str = Depends(tenant), st: HttpState = Depends(state)
) -> dict[str, Any]:
    limit, offset = wire.page(request.query_params, 20)
    ids = st.service.sessions.list_ids(tenant_id)
    return {"sessions": ids[offset : offset + limit]}


@router.post("/sessions/search")
async def search_sessions(
    request: Request, tenant_id: str = Depends(tenant), st: HttpState = Depends(state)
) -> dict[str, Any]:
    """The tenant's sessions, newest first, filtered and paged (``session_search``)."""
    query = session_search.query(wire.json_body(await request.body()))
    return session_search.page(st.service.sessions.search(tenant_id, query), tenant_id)


@router.get("/sessions/{session_id}")
async def get_session(
    session_id: str, tenant_id: str = Depends(tenant), st: HttpState = Depends(state)
) -> dict[str, Any]:
    models, samplers = st.service.sessions.members(tenant_id, session_id)
    return {"training_run_ids": models, "sampler_ids": samplers}


@router.get("/sessions/{session_id}/trace_export")
async def export_trace(
    session_id: str,
    request: Request,
    tenant_id: str = Depends(tenant),
    st: HttpState = Depends(state),
) -> dict[str, Any]:
    """A download URL of the session's trace, needing no key, valid for an hour on
    this server (``session_trace``); 404 for another tenant's session."""
    st.service.sessions.check(tenant_id, session_id)  # NOT_FOUND before a link
    token = st.trace_links.issue(tenant_id, session_id)
    return {"status": "ready", "url": f"{request.base_url}api/v1/session_traces/{token}"}


@router.get("/session_traces/{token}")
async def download_trace(token: str, st: HttpState = Depends(state)) -> dict[str, Any]:
    """The trace behind a URL ``trace_export`` gave out (its token is the key)."""
    link = st.trace_links.resolve(token)
    if link is None:
        raise NotFoundError("token: no such trace link here (unknown or expired): export again")
    timeline = st.service.sessions.timeline(*link)
    metrics = st.service.runs.metric_points([m for m, _ in timeline.models])
    return session_trace.trace(timeline, metrics)


@router.post("/sessions/{session_id}/finish")
async def finish_session(
    session_id: str,
    request: Request,
    tenant_id: str = Depends(tenant),
    st: HttpState = Depends(state),
) -> dict[str, Any]:
    """Idempotent; the session's models stay, only their heartbeats stop. The
    client's reason (``{"reason": {"type": "success"}, "detail": ...}``, as the SDK
    sends it, or ``"reason": "success"``) is kept for search."""
    body = wire.json_body(await request.body())
    reason = wire.field(body, "reason", (dict, str), None)
    if isinstance(reason, dict):
        reason = wire.field(reason, "type", str, None)
    detail = wire.field(body, "detail", str, None)
    st.service.sessions.end(tenant_id, session_id, reason, detail)
    st.finished_sessions.add((tenant_id, session_id))
    return {"session_id": session_id, "status": "finished"}
