"""SessionService over gRPC: a translator over ``server.service.sessions``."""

from __future__ import annotations

import grpc

from treadle.server.context import ServerContext
from treadle.server.rpc import convert
from treadle.v1 import session_pb2, session_pb2_grpc


class SessionServicer(session_pb2_grpc.SessionServiceServicer):
    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx
        self.sessions = ctx.service.sessions

    async def CreateSession(
        self, request: session_pb2.CreateSessionRequest, context: grpc.aio.ServicerContext
    ) -> session_pb2.SessionInfo:
        tenant = self.ctx.tenant(context)
        return convert.session_info(self.sessions.create(tenant, request.client))

    async def Heartbeat(
        self, request: session_pb2.HeartbeatRequest, context: grpc.aio.ServicerContext
    ) -> session_pb2.HeartbeatResponse:
        tenant = self.ctx.tenant(context)
        self.sessions.heartbeat(tenant, request.session_id)
        return convert.heartbeat()

    async def EndSession(
        self, request: session_pb2.EndSessionRequest, context: grpc.aio.ServicerContext
    ) -> session_pb2.EndSessionResponse:
        """Idempotent. The session's models stay; only their heartbeats stop."""
        tenant = self.ctx.tenant(context)
        self.sessions.end(tenant, request.session_id)
        return convert.ended_session()
