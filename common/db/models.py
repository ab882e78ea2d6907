"""SQLAlchemy rows: the storage kind of type, converted to domain objects elsewhere.

The schema itself is owned by the Alembic migrations in ``treadle.migrations``;
these classes must match it (a test compares them) and are never used with
``create_all`` by the server.
"""

from __future__ import annotations

import datetime as dt
import secrets
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    CheckConstraint,
    DateTime,
    Dialect,
    ForeignKey,
    LargeBinary,
    MetaData,
    String,
    Text,
    UniqueConstraint,
    false,
    text,
    true,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship
from sqlalchemy.types import TypeDecorator

from treadle.common.engine.domain import SAMPLER_PLACEMENTS

# Deterministic constraint names, so migrations can drop and alter them by name
# on every backend (SQLite batch mode included).
NAMING_CONVENTION: dict[str, str] = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

MODEL_STATUSES = ("active", "deleted", "lost", "unloaded")
CHECKPOINT_KINDS = ("state", "auto")
SAMPLER_MODES = ("base", "version", "latest")
OP_STATUSES = ("pending", "done", "failed")
#: live: takes new models; draining: stopping gracefully (serves the models it has
#: while servers move them off, takes no new ones); stopped, dead: gone
WORKER_STATUSES = ("live", "draining", "stopped", "dead")
#: what a worker does: trains and samples (``both``), or one of the two
WORKER_ROLES = ("both", "trainer", "sampler")


def utcnow() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


def new_id(prefix: str) -> str:
    """Server-generated ids read like ``m-3f9c0a1b2c4d5e6f``: the prefix names the kind."""
    return f"{prefix}-{secrets.token_hex(8)}"


def _in(column: str, values: tuple[str, ...]) -> str:
    return f"{column} IN ({', '.join(repr(v) for v in values)})"


class UTCDateTime(TypeDecorator[dt.datetime]):
    """Timezone-aware UTC on the way in and out.

    SQLite has no timezone type and hands back naive values; PostgreSQL hands back
    the session's zone. Both come back as UTC here, and naive inputs are refused
    rather than guessed.
    """

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: dt.datetime | None, dialect: Dialect) -> Any:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError(f"naive datetime {value!r}: pass a timezone-aware UTC datetime")
        return value.astimezone(dt.timezone.utc)

    def process_result_value(
        self, value: dt.datetime | None, dialect: Dialect
    ) -> dt.datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            return value.replace(tzinfo=dt.timezone.utc)
        return value.astimezone(dt.timezone.utc)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map = {dt.datetime: UTCDateTime()}


class Tenant(Base):
    __tablename__ = "tenants"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    name: Mapped[str] = mapped_column(String(255), unique=True)
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    # Quota overrides of this tenant; None = the server's default (``ServerConfig``).
    max_models: Mapped[int | None]
    max_calls_in_flight: Mapped[int | None]
    max_tokens_per_request: Mapped[int | None] = mapped_column(BigInteger)
    tokens_per_minute: Mapped[int | None] = mapped_column(BigInteger)


class ApiKey(Base):
    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"), index=True)
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)  # sha256 hex
    prefix: Mapped[str] = mapped_column(String(16))  # shown to humans, never used to authenticate
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    revoked_at: Mapped[dt.datetime | None]


class ClientSession(Base):
    """An SDK client's session (not a database session): it heart-beats while it runs."""

    __tablename__ = "sessions"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"), index=True)
    client: Mapped[str] = mapped_column(String(255), default="")
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    last_heartbeat_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    ended_at: Mapped[dt.datetime | None]
    # What the client said about itself at creation (tinker's create_session), for
    # search; and, when it finished the session itself, why ("success", "errored",
    # "interrupted") and its detail
    display_name: Mapped[str | None] = mapped_column(String(255))
    user_metadata: Mapped[dict[str, str] | None] = mapped_column(JSON)
    finish_reason: Mapped[str | None] = mapped_column(String(16))
    finish_detail: Mapped[str | None] = mapped_column(Text)


class Model(Base):
    __tablename__ = "models"
    __table_args__ = (CheckConstraint(_in("status", MODEL_STATUSES), name="status"),)

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"), index=True)
    base_model: Mapped[str] = mapped_column(Text)
    lora_rank: Mapped[int]  # 0 = full fine-tune
    lora_alpha: Mapped[float]
    # Which modules a LoRA model adapts (tinker's flags). Rows from before the
    # flags adapted every projection and not the head: the server defaults say so.
    train_attn: Mapped[bool] = mapped_column(default=True, server_default=true())
    train_mlp: Mapped[bool] = mapped_column(default=True, server_default=true())
    train_unembed: Mapped[bool] = mapped_column(default=True, server_default=false())
    seed: Mapped[int]
    dtype: Mapped[str] = mapped_column(String(16))
    status: Mapped[str] = mapped_column(String(16), default="active")
    # Optimizer steps applied; the base model is version 0.
    version: Mapped[int] = mapped_column(default=0, server_default=text("0"))
    # models <-> checkpoints is a cycle: the constraint is added after both tables
    # exist (use_alter) and the ORM writes this column in a second UPDATE (post_update).
    last_checkpoint_id: Mapped[str | None] = mapped_column(
        ForeignKey("checkpoints.id", use_alter=True)
    )
    last_checkpoint_seq_id: Mapped[int] = mapped_column(default=0, server_default=text("0"))
    worker_id: Mapped[str | None] = mapped_column(String(255))
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[dt.datetime] = mapped_column(default=utcnow, onupdate=utcnow)
    # The client session the model was created in: its heartbeats keep the model loaded.
    session_id: Mapped[str | None] = mapped_column(ForeignKey("sessions.id"), index=True)
    #: the caller's notes on the run (tinker's user_metadata), string to string
    user_metadata: Mapped[dict[str, str] | None] = mapped_column(JSON)

    last_checkpoint: Mapped[Checkpoint | None] = relationship(
        foreign_keys=[last_checkpoint_id], post_update=True
    )


class Checkpoint(Base):
    __tablename__ = "checkpoints"
    # The unique constraint's index leads with model_id, so it also serves
    # "checkpoints of this model" without a separate index.
    __table_args__ = (
        UniqueConstraint("model_id", "name"),
        CheckConstraint(_in("kind", CHECKPOINT_KINDS), name="kind"),
    )

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"))
    model_id: Mapped[str] = mapped_column(ForeignKey("models.id"))
    name: Mapped[str] = mapped_column(String(255))
    uri: Mapped[str] = mapped_column(String(1024), unique=True)  # treadle://m-abc/state/step5
    storage_path: Mapped[str] = mapped_column(Text)
    seq_id: Mapped[int]
    step: Mapped[int]
    kind: Mapped[str] = mapped_column(String(16))
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    #: when the lifecycle sweep deletes it (None: kept until deleted)
    expires_at: Mapped[dt.datetime | None]
    #: readable (never writable) by any tenant's key through its path
    public: Mapped[bool] = mapped_column(default=False, server_default=false())


class TinkerName(Base):
    """A name the tinker HTTP API gave out, kept so a server restart still knows it:
    ``kind`` "model" maps an SDK model id (``<session>:train:<n>``) to a model;
    "sampler_weights" maps ``<model_id>/<name>`` to the weight version it published."""

    __tablename__ = "tinker_names"

    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"), primary_key=True)
    kind: Mapped[str] = mapped_column(String(16), primary_key=True)
    key: Mapped[str] = mapped_column(String(512), primary_key=True)
    model_id: Mapped[str] = mapped_column(String(64))
    version: Mapped[int | None]
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)


class WeightVersion(Base):
    __tablename__ = "weight_versions"

    model_id: Mapped[str] = mapped_column(ForeignKey("models.id"), primary_key=True)
    version: Mapped[int] = mapped_column(primary_key=True)
    uri: Mapped[str] = mapped_column(String(1024))  # treadle://m-abc/v/3
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    released: Mapped[bool] = mapped_column(default=False, server_default=false())


class Sampler(Base):
    __tablename__ = "samplers"
    __table_args__ = (
        CheckConstraint(_in("mode", SAMPLER_MODES), name="mode"),
        CheckConstraint(_in("placement", SAMPLER_PLACEMENTS), name="placement"),
    )

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"))
    model_id: Mapped[str | None] = mapped_column(ForeignKey("models.id"), index=True)
    base_model: Mapped[str] = mapped_column(Text)
    mode: Mapped[str] = mapped_column(String(16))
    pinned_version: Mapped[int | None]
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    #: the client session it was created in (tinker's get_session lists it)
    session_id: Mapped[str | None] = mapped_column(ForeignKey("sessions.id"))
    #: where it samples, chosen at creation; None: the server's ``--sampler-placement``
    placement: Mapped[str | None] = mapped_column(String(16))


class Op(Base):
    """The server's dispatch log: one row per (model, seq_id) it sent to a worker."""

    __tablename__ = "ops"
    __table_args__ = (CheckConstraint(_in("status", OP_STATUSES), name="status"),)

    model_id: Mapped[str] = mapped_column(ForeignKey("models.id"), primary_key=True)
    seq_id: Mapped[int] = mapped_column(primary_key=True)
    kind: Mapped[str] = mapped_column(String(64))
    payload_digest: Mapped[str] = mapped_column(String(128))
    status: Mapped[str] = mapped_column(String(16), default="pending")
    error_code: Mapped[str | None] = mapped_column(String(64))
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    finished_at: Mapped[dt.datetime | None]
    #: the call itself (codec bytes) while the model's replay log keeps it
    #: (applied since its last checkpoint: ``treadle.server.replay_log``)
    payload: Mapped[bytes | None] = mapped_column(LargeBinary, deferred=True)


class Worker(Base):
    """A ``treadle worker`` process: the base models it serves, how many training
    models it takes, and its heartbeat. ``models.worker_id`` names where a model lives."""

    __tablename__ = "workers"
    __table_args__ = (
        CheckConstraint(_in("status", WORKER_STATUSES), name="status"),
        CheckConstraint(_in("role", WORKER_ROLES), name="role"),
    )

    id: Mapped[str] = mapped_column(String(255), primary_key=True)
    hostname: Mapped[str] = mapped_column(String(255), default="")
    base_models: Mapped[str] = mapped_column(Text, default="[]")  # JSON list of names
    capacity: Mapped[int]
    status: Mapped[str] = mapped_column(String(16), default="live")
    #: ``both``, ``trainer`` (takes no sampler of the pool) or ``sampler`` (no training model)
    role: Mapped[str] = mapped_column(String(16), default="both", server_default=text("'both'"))
    started_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    heartbeat_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    #: what the worker's engine reported with its last heartbeat (JSON of
    #: ``common.engine.report.EngineReport``: device, memory, models, queue); None: nothing yet
    report: Mapped[str | None] = mapped_column(Text, default=None)


class Usage(Base):
    """What a tenant consumed, per model: running totals the server adds to.

    ``model_id`` is not a foreign key, so usage outlives the model it was spent on;
    it is "" for sampling a bare base model. Checkpoints stored are not kept here:
    they are counted from ``checkpoints``, which is what is stored.
    """

    __tablename__ = "usage"

    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"), primary_key=True)
    model_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    base_model: Mapped[str] = mapped_column(String(255), primary_key=True)
    tokens_sampled: Mapped[int] = mapped_column(BigInteger, default=0, server_default=text("0"))
    tokens_trained: Mapped[int] = mapped_column(BigInteger, default=0, server_default=text("0"))
    tokens_scored: Mapped[int] = mapped_column(BigInteger, default=0, server_default=text("0"))
    calls: Mapped[int] = mapped_column(BigInteger, default=0, server_default=text("0"))
    compute_s: Mapped[float] = mapped_column(default=0.0, server_default=text("0"))
    updated_at: Mapped[dt.datetime] = mapped_column(default=utcnow, onupdate=utcnow)


class StepMetric(Base):
    """A metric an applied training call returned (``loss:sum`` of a
    forward_backward, ``grad_norm:value`` of an optim_step...), one row per call
    and name: keyed by the call's ``seq_id``, so a client's retry of a call writes
    nothing twice. ``step`` is the version an optim_step made; a forward_backward's
    step is that of the first optim_step after it (worked out when read).

    ``model_id`` is not a foreign key, like ``usage``'s: a run's curves outlive it."""

    __tablename__ = "step_metrics"

    model_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    seq_id: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    name: Mapped[str] = mapped_column(String(128), primary_key=True)
    kind: Mapped[str] = mapped_column(String(32))
    step: Mapped[int | None] = mapped_column(BigInteger)
    value: Mapped[float]
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)


class LoggedMetric(Base):
    """A metric the client logged for a step of its run (``log_metrics``: rewards,
    evaluation scores); a name logged again for a step replaces the value."""

    __tablename__ = "logged_metrics"

    model_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    step: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    name: Mapped[str] = mapped_column(String(128), primary_key=True)
    value: Mapped[float]
    logged_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
