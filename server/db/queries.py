"""Query functions: a session first, rows out, tenant filtering inside.

They flush but never commit: the handler that opened the session owns the
transaction. Lookups by id take the caller's tenant and answer None for another
tenant's row, exactly as for a missing one (tenants are walls).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from typing import TypeVar

from sqlalchemy import Connection, bindparam, select, update
from sqlalchemy.orm import Session

from treadle.common.db.models import (
    ApiKey,
    Base,
    Checkpoint,
    Model,
    Sampler,
    Tenant,
    TinkerName,
    WeightVersion,
    new_id,
    utcnow,
)
from treadle.errors import AlreadyExistsError, NotFoundError

_Row = TypeVar("_Row", bound=Base)


def _add(s: Session, row: _Row) -> _Row:
    s.add(row)
    s.flush()  # surface constraint errors here, not at some later commit
    return row


# --- tenants and keys ---------------------------------------------------------


def ensure_tenant(s: Session, name: str) -> Tenant:
    tenant = s.scalars(select(Tenant).where(Tenant.name == name)).one_or_none()
    if tenant is None:
        tenant = _add(s, Tenant(id=new_id("t"), name=name))
    return tenant


def create_api_key(s: Session, tenant_id: str, key_hash: str, prefix: str) -> ApiKey:
    return _add(s, ApiKey(id=new_id("k"), tenant_id=tenant_id, key_hash=key_hash, prefix=prefix))


def find_tenant_by_key_hash(s: Session, key_hash: str) -> Tenant | None:
    """The tenant of a live (unrevoked) key."""
    stmt = (
        select(Tenant)
        .join(ApiKey, ApiKey.tenant_id == Tenant.id)
        .where(ApiKey.key_hash == key_hash, ApiKey.revoked_at.is_(None))
    )
    return s.scalars(stmt).one_or_none()


# --- models -------------------------------------------------------------------


def create_model(
    s: Session,
    *,
    tenant_id: str,
    base_model: str,
    lora_rank: int,
    lora_alpha: float,
    seed: int,
    dtype: str,
    worker_id: str | None = None,
    model_id: str | None = None,
    modules: tuple[bool, bool, bool] = (True, True, True),
    session_id: str | None = None,
    user_metadata: dict[str, str] | None = None,
) -> Model:
    """``modules``: (train_attn, train_mlp, train_unembed) of a LoRA model;
    ``session_id``: the client session it lives in (None: none); ``user_metadata``:
    the caller's notes on the run (None or {}: none)."""
    row = Model(
        id=model_id or new_id("m"),
        tenant_id=tenant_id,
        base_model=base_model,
        lora_rank=lora_rank,
        lora_alpha=lora_alpha,
        seed=seed,
        dtype=dtype,
        worker_id=worker_id,
        train_attn=modules[0],
        train_mlp=modules[1],
        train_unembed=modules[2],
        session_id=session_id,
        user_metadata=user_metadata or None,
    )
    return _add(s, row)


def get_model(s: Session, tenant_id: str, model_id: str) -> Model | None:
    """The tenant's model, or None when missing, deleted or another tenant's."""
    stmt = select(Model).where(
        Model.id == model_id, Model.tenant_id == tenant_id, Model.status != "deleted"
    )
    return s.scalars(stmt).one_or_none()


def list_models(s: Session, tenant_id: str) -> Sequence[Model]:
    stmt = (
        select(Model)
        .where(Model.tenant_id == tenant_id, Model.status != "deleted")
        .order_by(Model.created_at, Model.id)
    )
    return s.scalars(stmt).all()


def mark_model_deleted(s: Session, tenant_id: str, model_id: str) -> Model | None:
    """Soft delete: the row stays for its checkpoints and ops. None if not the tenant's."""
    model = get_model(s, tenant_id, model_id)
    if model is not None:
        model.status = "deleted"
        s.flush()
    return model


def update_model_progress(
    s: Session,
    model_id: str,
    *,
    version: int | None = None,
    last_checkpoint: Checkpoint | None = None,
) -> Model:
    """Record what a worker applied; called by dispatch, so not tenant-filtered."""
    model = s.get(Model, model_id)
    if model is None:
        raise NotFoundError(f"model_id: no model {model_id!r}")
    if version is not None:
        model.version = version
    if last_checkpoint is not None:
        model.last_checkpoint = last_checkpoint
        model.last_checkpoint_seq_id = last_checkpoint.seq_id
    s.flush()
    return model


# Every optim_step records the model's new version before it answers: one Core
# UPDATE built once, not a Session's get and flush (~1.4 ms of the event loop a
# step on SQLite, between the engine's last op and the client's next call).
_MODEL_VERSION = update(Model).where(Model.id == bindparam("m")).values(version=bindparam("v"))


def record_version(conn: Connection, model_id: str, version: int) -> None:
    """Record the optimizer steps a worker applied (update_model_progress's
    ``version`` alone, in one statement); not tenant-filtered."""
    if conn.execute(_MODEL_VERSION, {"m": model_id, "v": version}).rowcount != 1:
        raise NotFoundError(f"model_id: no model {model_id!r}")


def set_model_status(
    s: Session, model_id: str, status: str, *, version: int | None = None
) -> Model | None:
    """Record a model's load state as the server changes it ("active" restored,
    "unloaded" for idling, "lost" when it could not be restored); not
    tenant-filtered (the server's own bookkeeping). None when there is no such row."""
    model = s.get(Model, model_id)
    if model is not None:
        model.status = status
        if version is not None:
            model.version = version
        s.flush()
    return model


# --- checkpoints and weight versions ------------------------------------------


def add_checkpoint(
    s: Session,
    *,
    tenant_id: str,
    model_id: str,
    name: str,
    uri: str,
    storage_path: str,
    seq_id: int,
    step: int,
    kind: str,
    size_bytes: int,
    checkpoint_id: str | None = None,
) -> Checkpoint:
    """Raises AlreadyExistsError when the model already has a checkpoint of that name."""
    taken = select(Checkpoint.id).where(Checkpoint.model_id == model_id, Checkpoint.name == name)
    if s.scalars(taken).first() is not None:
        raise AlreadyExistsError(f"name: model {model_id!r} already has a checkpoint {name!r}")
    row = Checkpoint(
        id=checkpoint_id or new_id("c"),
        tenant_id=tenant_id,
        model_id=model_id,
        name=name,
        uri=uri,
        storage_path=storage_path,
        seq_id=seq_id,
        step=step,
        kind=kind,
        size_bytes=size_bytes,
    )
    return _add(s, row)


def put_checkpoint(
    s: Session,
    *,
    tenant_id: str,
    model_id: str,
    name: str,
    uri: str,
    storage_path: str,
    seq_id: int,
    step: int,
    kind: str,
    size_bytes: int,
) -> Checkpoint:
    """The row of a checkpoint just (re)written under ``name``; a retried call (same
    ``seq_id``) finds its own row and keeps it.

    The row is updated in place, never deleted and added again: the model may
    point at it as its last checkpoint (a foreign key), and a delete would fail
    after the engine has already written the new state."""
    existing = get_checkpoint_by_uri(s, tenant_id, uri)
    if existing is None:
        return add_checkpoint(
            s,
            tenant_id=tenant_id,
            model_id=model_id,
            name=name,
            uri=uri,
            storage_path=storage_path,
            seq_id=seq_id,
            step=step,
            kind=kind,
            size_bytes=size_bytes,
        )
    if existing.seq_id != seq_id:
        existing.storage_path = storage_path
        existing.seq_id = seq_id
        existing.step = step
        existing.kind = kind
        existing.size_bytes = size_bytes
        existing.created_at = utcnow()
        s.flush()
    return existing


def set_checkpoint_expiry(s: Session, row: Checkpoint, expires_at: dt.datetime | None) -> None:
    row.expires_at = expires_at
    s.flush()


def set_checkpoint_public(s: Session, row: Checkpoint, public: bool) -> None:
    row.public = public
    s.flush()


def delete_checkpoint(s: Session, row: Checkpoint) -> None:
    """Delete a checkpoint's row; the model whose last checkpoint it was points at
    its newest remaining one instead (none: seq_id 0), which a restart brings back."""
    model = s.get(Model, row.model_id)
    if model is not None and model.last_checkpoint_id == row.id:
        newer = [c for c in list_checkpoints(s, row.tenant_id, model.id) if c.id != row.id]
        model.last_checkpoint = newer[-1] if newer else None
        model.last_checkpoint_seq_id = newer[-1].seq_id if newer else 0
        s.flush()
    s.delete(row)
    s.flush()


def list_checkpoints(s: Session, tenant_id: str, model_id: str) -> Sequence[Checkpoint]:
    stmt = (
        select(Checkpoint)
        .where(Checkpoint.tenant_id == tenant_id, Checkpoint.model_id == model_id)
        .order_by(Checkpoint.seq_id, Checkpoint.created_at)
    )
    return s.scalars(stmt).all()


def get_checkpoint_by_uri(s: Session, tenant_id: str, uri: str) -> Checkpoint | None:
    stmt = select(Checkpoint).where(Checkpoint.uri == uri, Checkpoint.tenant_id == tenant_id)
    return s.scalars(stmt).one_or_none()


def get_public_checkpoint(s: Session, uri: str) -> Checkpoint | None:
    """A checkpoint its owner published, whoever asks."""
    stmt = select(Checkpoint).where(Checkpoint.uri == uri, Checkpoint.public.is_(True))
    return s.scalars(stmt).one_or_none()


def list_tenant_checkpoints(s: Session, tenant_id: str) -> Sequence[Checkpoint]:
    """Every checkpoint of the tenant, newest first."""
    stmt = (
        select(Checkpoint)
        .where(Checkpoint.tenant_id == tenant_id)
        .order_by(Checkpoint.created_at.desc(), Checkpoint.id)
    )
    return s.scalars(stmt).all()


def expired_checkpoints(s: Session, now: dt.datetime) -> Sequence[Checkpoint]:
    stmt = select(Checkpoint).where(
        Checkpoint.expires_at.is_not(None), Checkpoint.expires_at <= now
    )
    return s.scalars(stmt).all()


def put_tinker_name(
    s: Session, tenant_id: str, kind: str, key: str, model_id: str, version: int | None = None
) -> None:
    row = s.get(TinkerName, (tenant_id, kind, key))
    if row is None:
        s.add(
            TinkerName(tenant_id=tenant_id, kind=kind, key=key, model_id=model_id, version=version)
        )
    else:
        row.model_id, row.version, row.created_at = model_id, version, utcnow()
    s.flush()


def get_tinker_name(s: Session, tenant_id: str, kind: str, key: str) -> TinkerName | None:
    return s.get(TinkerName, (tenant_id, kind, key))


def last_tinker_name(s: Session, tenant_id: str, kind: str, model_id: str) -> TinkerName | None:
    """The name of ``kind`` given out last (or given again last) for the model."""
    stmt = (
        select(TinkerName)
        .where(
            TinkerName.tenant_id == tenant_id,
            TinkerName.kind == kind,
            TinkerName.model_id == model_id,
        )
        .order_by(TinkerName.created_at.desc())
        .limit(1)
    )
    return s.scalars(stmt).first()


def add_weight_version(s: Session, model_id: str, version: int, uri: str) -> WeightVersion:
    return _add(s, WeightVersion(model_id=model_id, version=version, uri=uri))


def release_weight_versions(s: Session, model_id: str, keep_latest: int) -> list[WeightVersion]:
    """Mark all but the newest ``keep_latest`` live versions released; returns those
    just released, so the caller can free their storage."""
    stmt = (
        select(WeightVersion)
        .where(WeightVersion.model_id == model_id, WeightVersion.released.is_(False))
        .order_by(WeightVersion.version.desc())
        .offset(max(keep_latest, 0))
    )
    released = list(s.scalars(stmt))
    for row in released:
        row.released = True
    s.flush()
    return released


# --- samplers -----------------------------------------------------------------


def create_sampler(
    s: Session,
    *,
    tenant_id: str,
    base_model: str,
    mode: str,
    model_id: str | None = None,
    pinned_version: int | None = None,
    sampler_id: str | None = None,
    session_id: str | None = None,
    placement: str | None = None,
) -> Sampler:
    row = Sampler(
        id=sampler_id or new_id("s"),
        tenant_id=tenant_id,
        model_id=model_id,
        base_model=base_model,
        mode=mode,
        pinned_version=pinned_version,
        session_id=session_id,
        placement=placement,
    )
    return _add(s, row)


def has_latest_sampler(s: Session, tenant_id: str, model_id: str) -> bool:
    """Whether the tenant has a sampler following the model's latest weights."""
    stmt = select(Sampler.id).where(
        Sampler.tenant_id == tenant_id, Sampler.model_id == model_id, Sampler.mode == "latest"
    )
    return s.scalars(stmt.limit(1)).first() is not None


def get_sampler(s: Session, tenant_id: str, sampler_id: str) -> Sampler | None:
    stmt = select(Sampler).where(Sampler.id == sampler_id, Sampler.tenant_id == tenant_id)
    return s.scalars(stmt).one_or_none()
