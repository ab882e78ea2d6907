"""Query functions for tenants, API keys, quota overrides and usage (the admin side).

Like ``queries``: a session first, flush but never commit. Keys are stored only
as their sha256; the key itself is seen once, when it is made.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sqlalchemy import func, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from treadle.common.db.models import ApiKey, Checkpoint, Model, Tenant, Usage, utcnow
from treadle.errors import NotFoundError

QUOTA_FIELDS = ("max_models", "max_calls_in_flight", "max_tokens_per_request", "tokens_per_minute")


# --- tenants --------------------------------------------------------------------


def get_tenant_by_name(s: Session, name: str) -> Tenant | None:
    return s.scalars(select(Tenant).where(Tenant.name == name)).one_or_none()


def find_tenant(s: Session, name_or_id: str) -> Tenant:
    """A tenant by name or id (the admin CLI takes either)."""
    tenant = get_tenant_by_name(s, name_or_id) or s.get(Tenant, name_or_id)
    if tenant is None:
        raise NotFoundError(f"tenant {name_or_id!r} not found")
    return tenant


def list_tenants(s: Session) -> Sequence[Tenant]:
    return s.scalars(select(Tenant).order_by(Tenant.name)).all()


def set_quota(s: Session, tenant: Tenant, **limits: int | None) -> Tenant:
    """Override some of a tenant's quotas; None puts one back to the server default."""
    for name, value in limits.items():
        if name not in QUOTA_FIELDS:
            raise ValueError(f"unknown quota {name!r}")
        setattr(tenant, name, value)
    s.flush()
    return tenant


def count_live_models(s: Session, tenant_id: str) -> int:
    """Models that hold a place in the tenant's quota (not deleted, not lost)."""
    stmt = select(func.count()).where(
        Model.tenant_id == tenant_id, Model.status.not_in(("deleted", "lost"))
    )
    return int(s.scalar(stmt) or 0)


# --- keys -----------------------------------------------------------------------


def has_any_key(s: Session, tenant_id: str) -> bool:
    """Whether the tenant was ever given a key (revoked ones count)."""
    return s.scalars(select(ApiKey.id).where(ApiKey.tenant_id == tenant_id)).first() is not None


def is_live_key(s: Session, key_hash: str) -> bool:
    stmt = select(ApiKey.id).where(ApiKey.key_hash == key_hash, ApiKey.revoked_at.is_(None))
    return s.scalars(stmt).first() is not None


def list_keys(s: Session, tenant_id: str | None = None) -> Sequence[ApiKey]:
    stmt = select(ApiKey).order_by(ApiKey.created_at, ApiKey.id)
    if tenant_id is not None:
        stmt = stmt.where(ApiKey.tenant_id == tenant_id)
    return s.scalars(stmt).all()


def revoke_key(s: Session, key_id: str) -> ApiKey:
    """Revoke a key by its id; revoking twice keeps the first time."""
    key = s.get(ApiKey, key_id)
    if key is None:
        raise NotFoundError(f"api key {key_id!r} not found")
    if key.revoked_at is None:
        key.revoked_at = utcnow()
        s.flush()
    return key


# --- usage ----------------------------------------------------------------------


@dataclass(frozen=True)
class UsageDelta:
    tokens_sampled: int = 0
    tokens_trained: int = 0
    tokens_scored: int = 0
    calls: int = 0
    compute_s: float = 0.0

    def __add__(self, other: UsageDelta) -> UsageDelta:
        return UsageDelta(
            self.tokens_sampled + other.tokens_sampled,
            self.tokens_trained + other.tokens_trained,
            self.tokens_scored + other.tokens_scored,
            self.calls + other.calls,
            self.compute_s + other.compute_s,
        )


def add_usage(s: Session, tenant_id: str, model_id: str, base_model: str, d: UsageDelta) -> None:
    """Add to a usage row in the database (UPDATE ... SET x = x + d), so concurrent
    writers (several servers on one PostgreSQL) never lose each other's counts."""
    key = (Usage.tenant_id == tenant_id, Usage.model_id == model_id, Usage.base_model == base_model)
    values = {
        "tokens_sampled": Usage.tokens_sampled + d.tokens_sampled,
        "tokens_trained": Usage.tokens_trained + d.tokens_trained,
        "tokens_scored": Usage.tokens_scored + d.tokens_scored,
        "calls": Usage.calls + d.calls,
        "compute_s": Usage.compute_s + d.compute_s,
        "updated_at": utcnow(),
    }
    stmt = update(Usage).where(*key).values(**values).execution_options(synchronize_session=False)
    if s.execute(stmt).rowcount:  # type: ignore[attr-defined]
        return
    try:
        with s.begin_nested():
            s.add(
                Usage(
                    tenant_id=tenant_id,
                    model_id=model_id,
                    base_model=base_model,
                    tokens_sampled=d.tokens_sampled,
                    tokens_trained=d.tokens_trained,
                    tokens_scored=d.tokens_scored,
                    calls=d.calls,
                    compute_s=d.compute_s,
                )
            )
    except IntegrityError:  # another writer inserted it first: add to theirs
        s.execute(stmt)


@dataclass(frozen=True)
class UsageLine:
    tenant: str
    model_id: str  # "" = sampling a bare base model
    base_model: str
    tokens_sampled: int
    tokens_trained: int
    tokens_scored: int
    calls: int
    compute_s: float
    checkpoints: int
    checkpoint_bytes: int


def usage_report(s: Session, tenant_id: str | None = None) -> list[UsageLine]:
    """Usage per tenant and model; checkpoints stored are counted from ``checkpoints``."""
    names = {t.id: t.name for t in list_tenants(s)}
    stored: dict[tuple[str, str], tuple[int, int]] = {}
    ckpt = select(
        Checkpoint.tenant_id,
        Checkpoint.model_id,
        func.count(),
        func.coalesce(func.sum(Checkpoint.size_bytes), 0),
    ).group_by(Checkpoint.tenant_id, Checkpoint.model_id)
    if tenant_id is not None:
        ckpt = ckpt.where(Checkpoint.tenant_id == tenant_id)
    for t_id, m_id, count, size in s.execute(ckpt):
        stored[(t_id, m_id)] = (int(count), int(size))
    rows = select(Usage).order_by(Usage.tenant_id, Usage.model_id, Usage.base_model)
    if tenant_id is not None:
        rows = rows.where(Usage.tenant_id == tenant_id)
    lines: list[UsageLine] = []
    for u in s.scalars(rows):
        count, size = stored.pop((u.tenant_id, u.model_id), (0, 0))
        lines.append(
            UsageLine(
                names.get(u.tenant_id, u.tenant_id),
                u.model_id,
                u.base_model,
                u.tokens_sampled,
                u.tokens_trained,
                u.tokens_scored,
                u.calls,
                u.compute_s,
                count,
                size,
            )
        )
    if stored:  # models with checkpoints but no usage recorded (e.g. from before 0002)
        bases: dict[str, str] = dict(
            s.execute(
                select(Model.id, Model.base_model).where(Model.id.in_(m for _, m in stored))
            ).all()
        )
        for (t_id, m_id), (count, size) in sorted(stored.items()):
            lines.append(
                UsageLine(
                    names.get(t_id, t_id), m_id, bases.get(m_id, ""), 0, 0, 0, 0, 0.0, count, size
                )
            )
    return lines


def quota_overrides(s: Session, tenant_id: str) -> dict[str, int | None]:
    """The tenant's own quotas (None = the server default); {} for an unknown tenant."""
    tenant = s.get(Tenant, tenant_id)
    return {name: getattr(tenant, name) for name in QUOTA_FIELDS} if tenant else {}
