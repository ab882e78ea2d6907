"""A tenant's client sessions: an SDK opens one and heart-beats while it runs;
the models created in it stay loaded while the beats come (``server.lifecycle``)."""

from __future__ import annotations

from treadle.errors import NotFoundError
from treadle.server.context import ServerContext
from treadle.server.db import queries
from treadle.server.service.types import SessionInfo


class SessionService:
    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx

    def create(self, tenant: str, client: str = "") -> SessionInfo:
        """``client`` says what opened it (an SDK and its version), for operators."""
        with self.ctx.session() as s:
            row = queries.create_session(s, tenant, client)
            return SessionInfo(
                session_id=row.id,
                heartbeat_interval_s=self.ctx.config.heartbeat_interval_s,
                created_at=row.created_at.timestamp(),
            )

    def heartbeat(self, tenant: str, session_id: str) -> None:
        """NOT_FOUND for an ended session, another tenant's, or none."""
        with self.ctx.session() as s:
            row = queries.get_session(s, tenant, session_id)
            if row is None or row.ended_at is not None:
                raise NotFoundError(f"session_id: session {session_id!r} not found")
            queries.record_heartbeat(s, row)

    def members(self, tenant: str, session_id: str) -> tuple[list[str], list[str]]:
        """(model ids, sampler ids) created in the session; NOT_FOUND for another tenant's."""
        with self.ctx.session() as s:
            if queries.get_session(s, tenant, session_id) is None:
                raise NotFoundError(f"session_id: session {session_id!r} not found")
            return queries.session_members(s, tenant, session_id)

    def list_ids(self, tenant: str) -> list[str]:
        """The tenant's session ids, newest first."""
        with self.ctx.session() as s:
            return [row.id for row in queries.list_sessions(s, tenant)]

    def end(self, tenant: str, session_id: str) -> None:
        """Idempotent. The session's models stay; only their heartbeats stop."""
        with self.ctx.session() as s:
            row = queries.get_session(s, tenant, session_id)
            if row is None:
                raise NotFoundError(f"session_id: session {session_id!r} not found")
            queries.end_session(s, row)
