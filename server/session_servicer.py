"""SessionService: SDK clients open a session and heart-beat while they run; the
models they create stay loaded while the beats come (see ``lifecycle``)."""

from __future__ import annotations

import grpc

from treadle.errors import NotFoundError
from treadle.server.context import ServerContext
from treadle.server.db import models as db
from treadle.server.db import queries
from treadle.v1 import session_pb2, session_pb2_grpc


class SessionServicer(session_pb2_grpc.SessionServiceServicer):
    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx

    async def CreateSession(
        self, request: session_pb2.CreateSessionRequest, context: grpc.aio.ServicerContext
    ) -> session_pb2.SessionInfo:
        tenant = self.ctx.tenant(context)
        with self.ctx.session() as s:
            row = queries.create_session(s, tenant, request.client)
            return session_pb2.SessionInfo(
                session_id=row.id,
                heartbeat_interval_s=self.ctx.config.heartbeat_interval_s,
                created_at=row.created_at.timestamp(),
            )

    async def Heartbeat(
        self, request: session_pb2.HeartbeatRequest, context: grpc.aio.ServicerContext
    ) -> session_pb2.HeartbeatResponse:
        tenant = self.ctx.tenant(context)
        with self.ctx.session() as s:
            row = queries.get_session(s, tenant, request.session_id)
            if row is None or row.ended_at is not None:
                raise NotFoundError(f"session_id: session {request.session_id!r} not found")
            row.last_heartbeat_at = db.utcnow()
        return session_pb2.HeartbeatResponse()

    async def EndSession(
        self, request: session_pb2.EndSessionRequest, context: grpc.aio.ServicerContext
    ) -> session_pb2.EndSessionResponse:
        """Idempotent. The session's models stay; only their heartbeats stop."""
        tenant = self.ctx.tenant(context)
        with self.ctx.session() as s:
            row = queries.get_session(s, tenant, request.session_id)
            if row is None:
                raise NotFoundError(f"session_id: session {request.session_id!r} not found")
            if row.ended_at is None:
                row.ended_at = db.utcnow()
        return session_pb2.EndSessionResponse()
