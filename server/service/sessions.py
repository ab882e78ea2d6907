"""A tenant's client sessions: an SDK opens one and heart-beats while it runs;
the models created in it stay loaded while the beats come (``server.lifecycle``)."""

from __future__ import annotations

from sqlalchemy.orm import Session

from treadle.common.db import models as db
from treadle.errors import InvalidArgumentError, NotFoundError
from treadle.server.context import ServerContext
from treadle.server.db import session_queries
from treadle.server.service.types import (
    FINISH_REASONS,
    SessionInfo,
    SessionPage,
    SessionQuery,
    SessionSummary,
    SessionTimeline,
    TimelineCall,
)


class SessionService:
    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx

    def create(
        self,
        tenant: str,
        client: str = "",
        *,
        display_name: str | None = None,
        user_metadata: dict[str, str] | None = None,
    ) -> SessionInfo:
        """``client`` says what opened it (an SDK and its version), for operators;
        ``display_name`` and ``user_metadata`` are the client's own, for search."""
        with self.ctx.session() as s:
            row = session_queries.create_session(
                s, tenant, client, display_name=display_name, user_metadata=user_metadata
            )
            return SessionInfo(
                session_id=row.id,
                heartbeat_interval_s=self.ctx.config.heartbeat_interval_s,
                created_at=row.created_at.timestamp(),
            )

    def heartbeat(self, tenant: str, session_id: str) -> None:
        """NOT_FOUND for an ended session, another tenant's, or none."""
        with self.ctx.session() as s:
            row = session_queries.get_session(s, tenant, session_id)
            if row is None or row.ended_at is not None:
                raise NotFoundError(f"session_id: session {session_id!r} not found")
            session_queries.record_heartbeat(s, row)

    def members(self, tenant: str, session_id: str) -> tuple[list[str], list[str]]:
        """(model ids, sampler ids) created in the session; NOT_FOUND for another tenant's."""
        with self.ctx.session() as s:
            _found(s, tenant, session_id)
            return session_queries.session_members(s, tenant, session_id)

    def list_ids(self, tenant: str) -> list[str]:
        """The tenant's session ids, newest first."""
        with self.ctx.session() as s:
            return [row.id for row in session_queries.list_sessions(s, tenant)]

    def end(
        self, tenant: str, session_id: str, reason: str | None = None, detail: str | None = None
    ) -> None:
        """Idempotent. The session's models stay; only their heartbeats stop.
        ``reason``: the client's, when it finishes the session itself (``FINISH_REASONS``)."""
        if reason is not None and reason not in FINISH_REASONS:
            raise InvalidArgumentError(f"reason: {reason!r}; one of {', '.join(FINISH_REASONS)}")
        with self.ctx.session() as s:
            row = _found(s, tenant, session_id)
            session_queries.end_session(s, row, reason, detail)

    def check(self, tenant: str, session_id: str) -> None:
        """NOT_FOUND for another tenant's session, or none (ended ones exist)."""
        with self.ctx.session() as s:
            _found(s, tenant, session_id)

    def timeline(self, tenant: str, session_id: str) -> SessionTimeline:
        """NOT_FOUND for another tenant's session, or none."""
        with self.ctx.session() as s:
            row = _found(s, tenant, session_id)
            models, ops, samplers = session_queries.session_timeline(s, tenant, session_id)
            return SessionTimeline(
                session_id=row.id,
                created_at=row.created_at,
                ended_at=row.ended_at,
                models=tuple((m.id, m.created_at) for m in models),
                calls=tuple(
                    TimelineCall(
                        o.model_id,
                        o.seq_id,
                        o.kind,
                        o.status,
                        o.error_code,
                        o.created_at,
                        o.finished_at,
                    )
                    for o in ops
                ),
                samplers=tuple((x.id, x.model_id, x.created_at) for x in samplers),
            )

    def search(self, tenant: str, query: SessionQuery) -> SessionPage:
        """One page of the tenant's sessions matching ``query``, newest first. The
        metadata pairs are matched here, not in SQL (JSON differs across databases):
        candidates are read in batches until the page is full."""
        if not 1 <= query.limit <= 200:
            raise InvalidArgumentError(f"limit: {query.limit}; from 1 to 200")
        wanted = dict(query.user_metadata)
        words = query.display_name.split() if query.display_name else []
        found: list[db.ClientSession] = []
        after = query.after
        with self.ctx.session() as s:
            while len(found) <= query.limit:
                batch = session_queries.search_sessions(
                    s,
                    tenant,
                    session_id=query.session_id,
                    name_words=words,
                    statuses=query.statuses,
                    before=after,
                    batch=_BATCH,
                )
                found += [r for r in batch if _holds(r.user_metadata, wanted)]
                if len(batch) < _BATCH:
                    break
                after = (batch[-1].created_at, batch[-1].id)
            page = found[: query.limit]
            stored = session_queries.session_checkpoints(s, tenant, [r.id for r in page])
            sessions = tuple(_summary(r, stored.get(r.id, (0, 0))) for r in page)
        more = len(found) > query.limit
        last = page[-1] if page else None
        return SessionPage(sessions, (last.created_at, last.id) if more and last else None)


#: sessions read from the database at a time while filling a search's page
_BATCH = 200


def _found(s: Session, tenant: str, session_id: str) -> db.ClientSession:
    row = session_queries.get_session(s, tenant, session_id)
    if row is None:
        raise NotFoundError(f"session_id: session {session_id!r} not found")
    return row


def _holds(metadata: dict[str, str] | None, wanted: dict[str, str]) -> bool:
    return all((metadata or {}).get(k) == v for k, v in wanted.items())


def _summary(row: db.ClientSession, stored: tuple[int, int]) -> SessionSummary:
    return SessionSummary(
        session_id=row.id,
        created_at=row.created_at,
        display_name=row.display_name,
        user_metadata=row.user_metadata,
        active=row.ended_at is None,
        finish_reason=row.finish_reason,
        finish_detail=row.finish_detail,
        checkpoints=stored[0],
        checkpoint_bytes=stored[1],
    )
