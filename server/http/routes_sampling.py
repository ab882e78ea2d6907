"""Sampling routes: sampling sessions are treadle samplers (tenant resources);
``asample`` is treadle's Sample, its result a protobuf ``SampleResponse``."""

from __future__ import annotations

from typing import Any

from fastapi import Depends, Request

from treadle.common.engine.domain import SampleResult
from treadle.errors import InvalidArgumentError
from treadle.server.http import wire
from treadle.server.http.auth import tenant
from treadle.server.http.state import HttpState, api_router, state
from treadle.server.service import CallHandle
from treadle.server.service.types import SamplerSource, parse

router = api_router()


async def _await(handle: CallHandle[SampleResult]) -> SampleResult:
    return await handle


def _source(st: HttpState, tenant_id: str, body: dict[str, Any]) -> SamplerSource:
    model_path = body.get("model_path")
    if model_path is not None:
        return SamplerSource(weights=st.names.sampler_weights_uri(tenant_id, model_path))
    base_model = body.get("base_model")
    if not isinstance(base_model, str) or not base_model:
        raise InvalidArgumentError("base_model: required when no model_path is given")
    return SamplerSource(base_model=base_model)


@router.post("/create_sampling_session")
async def create_sampling_session(
    request: Request, tenant_id: str = Depends(tenant), st: HttpState = Depends(state)
) -> dict[str, Any]:
    body = wire.json_body(await request.body())
    session_id = body.get("session_id")
    info = await st.service.sampling.create_sampler(
        tenant_id,
        _source(st, tenant_id, body),
        session_id if isinstance(session_id, str) else "",
    )
    return {"type": "create_sampling_session", "sampling_session_id": info.sampler_id}


@router.get("/samplers/{sampler_id}")
async def get_sampler(
    sampler_id: str, tenant_id: str = Depends(tenant), st: HttpState = Depends(state)
) -> dict[str, Any]:
    target = st.service.sampling.target(tenant_id, sampler_id)
    model_path = None
    if target.model_id is not None:
        model_path = (
            f"treadle://{target.model_id}/latest"
            if target.version is None
            else f"treadle://{target.model_id}/v/{target.version}"
        )
    return {"sampler_id": sampler_id, "base_model": target.base_model, "model_path": model_path}


@router.post("/asample")
async def asample(
    request: Request, tenant_id: str = Depends(tenant), st: HttpState = Depends(state)
) -> dict[str, Any]:
    body = wire.json_body(await request.body())
    sampler_id = body.get("sampling_session_id")
    if sampler_id is None:  # a one-off sample of a base model or a path
        info = await st.service.sampling.create_sampler(tenant_id, _source(st, tenant_id, body))
        sampler_id = info.sampler_id
    if not isinstance(sampler_id, str):
        raise InvalidArgumentError("sampling_session_id: expected a string")
    st.service.sampling.target(tenant_id, sampler_id)  # 404 now, not in the future
    seq_id = wire.field(body, "seq_id", int, 0)
    op = parse(lambda: wire.sample_op(body))
    num = body.get("num_samples", 1) if isinstance(body.get("num_samples", 1), int) else 1
    # Admitted (or refused: 429 with the quota's retry delay) before the request answers.
    handle: CallHandle[SampleResult] = CallHandle.start(
        st.service.sampling.sample, tenant_id, sampler_id, op, seq_id, wire.digest(body)
    )
    await handle.admitted()
    request_id = st.futures.start(tenant_id, _await(handle), wire.sample_encoder(body))
    return {
        "request_id": request_id,
        "sample_sequence_ids": [f"{request_id}:{i}" for i in range(max(num, 1))],
    }
