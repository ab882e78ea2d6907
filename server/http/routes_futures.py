"""retrieve_future (held until the result is ready) and cancel_future."""

from __future__ import annotations

from typing import Any

from fastapi import Depends, Request
from starlette.responses import Response

from treadle.server.http import wire
from treadle.server.http.auth import tenant
from treadle.server.http.state import HttpState, api_router, state

router = api_router()


@router.post("/retrieve_future")
async def retrieve_future(
    request: Request, tenant_id: str = Depends(tenant), st: HttpState = Depends(state)
) -> Response:
    body = wire.json_body(await request.body())
    return await st.futures.retrieve(tenant_id, wire.field(body, "request_id", str))


@router.post("/cancel_future")
async def cancel_future(
    request: Request, tenant_id: str = Depends(tenant), st: HttpState = Depends(state)
) -> dict[str, Any]:
    body = wire.json_body(await request.body())
    cancelled = st.futures.cancel(tenant_id, wire.field(body, "request_id", str))
    return {"cancelled": cancelled}
