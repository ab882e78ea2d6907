"""Query functions of client sessions (the SDK's and the tinker SDK's): made,
kept alive, ended, listed, searched, and their timeline; each takes the
caller's session, as ``queries`` does for everything else."""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from typing import TypeVar

from sqlalchemy import and_, false, func, or_, select
from sqlalchemy.orm import Session

from treadle.common.db.models import (
    Base,
    Checkpoint,
    ClientSession,
    Model,
    Op,
    Sampler,
    new_id,
    utcnow,
)

_Row = TypeVar("_Row", bound=Base)


# --- client sessions ----------------------------------------------------------


def create_session(
    s: Session,
    tenant_id: str,
    client: str = "",
    *,
    display_name: str | None = None,
    user_metadata: dict[str, str] | None = None,
) -> ClientSession:
    row = ClientSession(
        id=new_id("sess"),
        tenant_id=tenant_id,
        client=client[:255],
        display_name=display_name[:255] if display_name else None,
        user_metadata=user_metadata or None,
    )
    s.add(row)
    s.flush()  # surface constraint errors here, not at some later commit
    return row


def get_session(s: Session, tenant_id: str, session_id: str) -> ClientSession | None:
    """The tenant's session (ended or not), or None when missing or another tenant's."""
    stmt = select(ClientSession).where(
        ClientSession.id == session_id, ClientSession.tenant_id == tenant_id
    )
    return s.scalars(stmt).one_or_none()


def record_heartbeat(s: Session, row: ClientSession) -> None:
    row.last_heartbeat_at = utcnow()
    s.flush()


def end_session(
    s: Session, row: ClientSession, reason: str | None = None, detail: str | None = None
) -> None:
    """Idempotent: a session ended stays ended at its first end, with that end's
    reason (the client's own: "success", "errored", "interrupted"; None otherwise)."""
    if row.ended_at is None:
        row.ended_at = utcnow()
        row.finish_reason, row.finish_detail = reason, detail
        s.flush()


def session_members(s: Session, tenant_id: str, session_id: str) -> tuple[list[str], list[str]]:
    """(model ids, sampler ids) created in the tenant's session, oldest first."""
    models = s.scalars(
        select(Model.id)
        .where(Model.tenant_id == tenant_id, Model.session_id == session_id)
        .order_by(Model.created_at)
    ).all()
    samplers = s.scalars(
        select(Sampler.id)
        .where(Sampler.tenant_id == tenant_id, Sampler.session_id == session_id)
        .order_by(Sampler.created_at)
    ).all()
    return list(models), list(samplers)


def list_sessions(s: Session, tenant_id: str) -> Sequence[ClientSession]:
    """The tenant's sessions, newest first."""
    stmt = (
        select(ClientSession)
        .where(ClientSession.tenant_id == tenant_id)
        .order_by(ClientSession.created_at.desc(), ClientSession.id)
    )
    return s.scalars(stmt).all()


def search_sessions(
    s: Session,
    tenant_id: str,
    *,
    session_id: str | None,
    name_words: Sequence[str],
    statuses: frozenset[str] | None,
    before: tuple[dt.datetime, str] | None,
    batch: int,
) -> Sequence[ClientSession]:
    """Up to ``batch`` of the tenant's sessions, newest first (then by id, descending),
    older than ``before`` (a page's last (created_at, id)): those whose id is
    ``session_id`` or whose display name holds every one of ``name_words``
    (case-insensitive; either one when both are given), and whose status is one of
    ``statuses`` ("active", or the reason a client finished it with; None: any)."""
    stmt = select(ClientSession).where(ClientSession.tenant_id == tenant_id)
    named = [ClientSession.display_name.ilike(f"%{_like(w)}%", escape="\\") for w in name_words]
    if session_id is not None and named:
        stmt = stmt.where(or_(ClientSession.id == session_id, and_(*named)))
    elif session_id is not None:
        stmt = stmt.where(ClientSession.id == session_id)
    elif named:
        stmt = stmt.where(*named)
    if statuses is not None:
        reasons = sorted(statuses - {"active"})
        either = [ClientSession.finish_reason.in_(reasons)] if reasons else []
        if "active" in statuses:
            either.append(ClientSession.ended_at.is_(None))
        stmt = stmt.where(or_(*either) if either else false())
    if before is not None:
        at, last_id = before
        stmt = stmt.where(
            or_(
                ClientSession.created_at < at,
                and_(ClientSession.created_at == at, ClientSession.id < last_id),
            )
        )
    order = (ClientSession.created_at.desc(), ClientSession.id.desc())
    return s.scalars(stmt.order_by(*order).limit(batch)).all()


def _like(word: str) -> str:
    return word.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")


def session_checkpoints(
    s: Session, tenant_id: str, session_ids: Sequence[str]
) -> dict[str, tuple[int, int]]:
    """session id -> (checkpoints stored of the models created in it, their bytes)."""
    stmt = (
        select(Model.session_id, func.count(Checkpoint.id), func.sum(Checkpoint.size_bytes))
        .join(Model, Checkpoint.model_id == Model.id)
        .where(Checkpoint.tenant_id == tenant_id, Model.session_id.in_(list(session_ids)))
        .group_by(Model.session_id)
    )
    return {str(sid): (int(n), int(size or 0)) for sid, n, size in s.execute(stmt)}


def session_timeline(
    s: Session, tenant_id: str, session_id: str
) -> tuple[Sequence[Model], Sequence[Op], Sequence[Sampler]]:
    """The models created in the tenant's session (oldest first), their ordered
    calls from the ops log (by model, then seq_id), and the samplers made in the
    session or of its models' weights (a sync's own sampler belongs to no session)."""
    models = s.scalars(
        select(Model)
        .where(Model.tenant_id == tenant_id, Model.session_id == session_id)
        .order_by(Model.created_at, Model.id)
    ).all()
    ids = [m.id for m in models]
    ops = s.scalars(select(Op).where(Op.model_id.in_(ids)).order_by(Op.model_id, Op.seq_id)).all()
    samplers = s.scalars(
        select(Sampler)
        .where(
            Sampler.tenant_id == tenant_id,
            or_(Sampler.session_id == session_id, Sampler.model_id.in_(ids)),
        )
        .order_by(Sampler.created_at, Sampler.id)
    ).all()
    return models, ops, samplers
