"""What every HTTP route shares: the server context (and its service layer), the
futures the SDK retrieves, and the tinker <-> treadle names."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from starlette.requests import Request

from treadle.server.context import ServerContext
from treadle.server.http.futures import Futures
from treadle.server.http.names import Names

if TYPE_CHECKING:
    from treadle.server.service import Service


@dataclass
class HttpState:
    ctx: ServerContext
    futures: Futures = field(default_factory=Futures)
    names: Names = field(default_factory=Names)
    #: (tenant, session id) of sessions finished here: their heartbeats answer 410
    finished_sessions: set[tuple[str, str]] = field(default_factory=set)

    @property
    def service(self) -> Service:
        return self.ctx.service


def state(request: Request) -> HttpState:
    return request.app.state.http  # type: ignore[no-any-return]
