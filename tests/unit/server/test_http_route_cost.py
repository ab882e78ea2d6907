"""What an HTTP request costs the server beyond its route's own work: no thread
hop (FastAPI runs a plain-function dependency in its thread pool; in the serve
process, whose engine threads hold the GIL, each hop waits on them) and no
pydantic validation of an answer against a model inferred from the route's
return annotation."""

from __future__ import annotations

import asyncio
import inspect
import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import anyio.to_thread
import httpx
import pytest
from fastapi.dependencies.models import Dependant
from fastapi.routing import APIRoute

from treadle.server.http.app import create_app


def _app() -> Any:
    data_dir = Path(tempfile.mkdtemp(prefix="treadle-route-cost-"))  # the console's secret
    ctx = SimpleNamespace(
        session=None,
        instance_id="test",
        config=SimpleNamespace(max_message_bytes=1 << 20, data_dir=data_dir, tls=None),
        auth=SimpleNamespace(enabled=False, authenticate=lambda metadata: "tenant-a"),
    )
    return create_app(ctx)  # type: ignore[arg-type]


def _calls(dependant: Dependant) -> list[Any]:
    out = []
    for dep in dependant.dependencies:
        out.append(dep.call)
        out += _calls(dep)
    return out


def test_every_route_and_dependency_runs_on_the_event_loop_without_response_model() -> None:
    routes = [r for r in _app().routes if isinstance(r, APIRoute)]
    assert len(routes) > 30  # every routes_* module's routes are there
    for route in routes:
        assert inspect.iscoroutinefunction(route.endpoint), route.path
        for call in _calls(route.dependant):
            assert inspect.iscoroutinefunction(call), (route.path, call)
        assert route.response_model is None, route.path
        assert route.response_field is None, route.path


def test_a_request_with_tenant_and_state_takes_no_thread(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    def no_thread(*args: Any, **kw: Any) -> Any:
        raise AssertionError("a thread hop in an HTTP request")

    monkeypatch.setattr(anyio.to_thread, "run_sync", no_thread)
    app = _app()

    async def go() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return [
                await client.post("/api/v1/retrieve_future", json={"request_id": "nope"}),
                await client.post("/api/v1/cancel_future", json={"request_id": "nope"}),
            ]

    gone, cancel = asyncio.run(go())
    assert gone.status_code == 410, gone.text
    assert cancel.status_code == 200 and cancel.json() == {"cancelled": False}
