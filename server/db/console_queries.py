"""What the web console reads that the API does not: a key by id, each run's
last activity, a model's samplers and versions, the workers and every tenant's
usage. Lookups by id take the caller's tenant, as in ``queries``."""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from treadle.common.db.models import (
    ApiKey,
    Model,
    Op,
    Sampler,
    Tenant,
    Usage,
    WeightVersion,
    Worker,
)


def live_key(s: Session, key_hash: str) -> ApiKey | None:
    return s.scalars(
        select(ApiKey).where(ApiKey.key_hash == key_hash, ApiKey.revoked_at.is_(None))
    ).one_or_none()


def key_is_live(s: Session, key_id: str, tenant_id: str) -> bool:
    return (
        s.scalars(
            select(ApiKey.id).where(
                ApiKey.id == key_id, ApiKey.tenant_id == tenant_id, ApiKey.revoked_at.is_(None)
            )
        ).one_or_none()
        is not None
    )


def tenant_name(s: Session, tenant_id: str) -> str:
    return s.scalars(select(Tenant.name).where(Tenant.id == tenant_id)).one_or_none() or ""


def last_activity(s: Session, tenant_id: str) -> dict[str, dt.datetime]:
    """model id -> when its last ordered call was made, for the tenant's models."""
    rows = s.execute(
        select(Op.model_id, func.max(Op.created_at))
        .join(Model, Model.id == Op.model_id)
        .where(Model.tenant_id == tenant_id)
        .group_by(Op.model_id)
    ).all()
    return {m: t for m, t in rows if t is not None}


def model_samplers(s: Session, tenant_id: str, model_id: str) -> Sequence[Sampler]:
    return s.scalars(
        select(Sampler)
        .where(Sampler.tenant_id == tenant_id, Sampler.model_id == model_id)
        .order_by(Sampler.created_at)
    ).all()


def model_versions(s: Session, model_id: str) -> Sequence[WeightVersion]:
    return s.scalars(
        select(WeightVersion)
        .where(WeightVersion.model_id == model_id)
        .order_by(WeightVersion.version)
    ).all()


def workers(s: Session) -> Sequence[Worker]:
    return s.scalars(select(Worker).order_by(Worker.started_at)).all()


def models_per_worker(s: Session) -> dict[str, int]:
    rows = s.execute(
        select(Model.worker_id, func.count())
        .where(Model.status == "active", Model.worker_id.is_not(None))
        .group_by(Model.worker_id)
    ).all()
    return {str(w): int(n) for w, n in rows}


def live_models_per_tenant(s: Session) -> dict[str, int]:
    rows = s.execute(
        select(Model.tenant_id, func.count())
        .where(Model.status == "active")
        .group_by(Model.tenant_id)
    ).all()
    return {t: int(n) for t, n in rows}


def usage_per_tenant(s: Session) -> dict[str, tuple[int, int, int, int, float]]:
    """tenant id -> (tokens trained, sampled, scored, calls, compute seconds)."""
    rows = s.execute(
        select(
            Usage.tenant_id,
            func.sum(Usage.tokens_trained),
            func.sum(Usage.tokens_sampled),
            func.sum(Usage.tokens_scored),
            func.sum(Usage.calls),
            func.sum(Usage.compute_s),
        ).group_by(Usage.tenant_id)
    ).all()
    return {
        t: (int(a or 0), int(b or 0), int(c or 0), int(d or 0), float(e or 0.0))
        for t, a, b, c, d, e in rows
    }
