"""What every HTTP route shares: the server context (and its service layer), the
futures the SDK retrieves, and the tinker <-> treadle names; and the routers'
kind of route.

Per request, a route costs only what it does: ``state`` is a coroutine (FastAPI
runs a plain-function dependency in its thread pool, a thread hop per request
that, in a process whose engine threads hold the GIL, waits for their switch
interval), and a route's return annotation is not made a response model (which
would validate every answer's dict with pydantic before encoding it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter
from fastapi.datastructures import DefaultPlaceholder
from fastapi.routing import APIRoute
from starlette.requests import Request

from treadle.server.context import ServerContext
from treadle.server.http.futures import Futures
from treadle.server.http.names import Names
from treadle.server.http.session_trace import TraceLinks

if TYPE_CHECKING:
    from treadle.server.service import Service


@dataclass
class HttpState:
    ctx: ServerContext
    futures: Futures = field(default_factory=Futures)
    names: Names = field(default_factory=Names)
    #: (tenant, session id) of sessions finished here: their heartbeats answer 410
    finished_sessions: set[tuple[str, str]] = field(default_factory=set)
    #: the key-less download URLs of session traces given out here
    trace_links: TraceLinks = field(default_factory=TraceLinks)

    @property
    def service(self) -> Service:
        return self.ctx.service


async def state(request: Request) -> HttpState:
    return request.app.state.http  # type: ignore[no-any-return]


class Route(APIRoute):
    """A route whose answer is encoded as returned: no response model inferred
    from its annotation (one given explicitly still applies)."""

    def __init__(self, path: str, endpoint: Any, *, response_model: Any = None, **kw: Any) -> None:
        if isinstance(response_model, DefaultPlaceholder):
            response_model = None
        super().__init__(path, endpoint, response_model=response_model, **kw)


def api_router() -> APIRouter:
    """The router of a routes_* module: ``/api/v1``, ``Route``s."""
    return APIRouter(prefix="/api/v1", route_class=Route)
