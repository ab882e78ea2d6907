"""What every servicer shares: config, database sessions, the dispatcher and
its catalog, metrics and draining interfaces, the checkpoint store, the
authenticator, and the tenant lookups they all need."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
from sqlalchemy import Connection
from sqlalchemy.orm import Session, sessionmaker

from treadle.common.db import models as db
from treadle.common.store import Store
from treadle.errors import NotFoundError
from treadle.server.accounting.quotas import QuotaLimits, Quotas
from treadle.server.accounting.step_metrics import StepMetricsRecorder
from treadle.server.accounting.usage import UsageMeter
from treadle.server.auth import Authenticator, DefaultKey, current_tenant
from treadle.server.config import ServerConfig
from treadle.server.db import queries
from treadle.server.dispatch import Catalog, Dispatcher, Draining, EngineMetrics

if TYPE_CHECKING:
    from treadle.server.http.app import HttpServer
    from treadle.server.lifecycle import ModelLifecycle
    from treadle.server.metrics import ServerMetrics
    from treadle.server.restarts import RestorePoint
    from treadle.server.service import Service


@dataclass
class ServerContext:
    config: ServerConfig
    sessions: sessionmaker[Session]
    dispatcher: Dispatcher
    store: Store
    auth: Authenticator
    #: the base models served (the dispatcher's, in both kinds of server)
    catalog: Catalog
    #: live engine stats for ``GetServerInfo``
    engine_metrics: EngineMetrics
    #: models on stopping workers, for the lifecycle to move off
    draining: Draining
    #: model_id -> tenant_id of live models, so the hot path skips a DB read
    owners: dict[str, str] = field(default_factory=dict)
    quotas: Quotas = field(default_factory=lambda: Quotas(QuotaLimits()))
    #: usage counters, written to the database in the background (None: not counted)
    usage: UsageMeter | None = None
    #: the metrics of applied training calls (a run's curves), written in the background
    step_metrics: StepMetricsRecorder | None = None
    #: the default tenant's key and its file (made on the first start)
    default_key: DefaultKey | None = None
    #: this server process, new at each start: stamped on every answer
    #: (``ErrorInterceptor``) so clients learn at once of a restart
    instance_id: str = field(default_factory=lambda: uuid.uuid4().hex[:16])
    #: models this instance loaded back from a checkpoint, and where (``server.restarts``)
    restored: dict[str, RestorePoint] = field(default_factory=dict)
    #: Prometheus metrics (None: no --metrics-port)
    metrics: ServerMetrics | None = None
    #: the tinker-compatible HTTP API, when it is served (``server.http``)
    http: HttpServer | None = None
    #: idle clocks, TTL unloading and transparent restore
    lifecycle: ModelLifecycle = field(init=False)
    #: the transport-free service layer every transport calls (``server.service``)
    service: Service = field(init=False)

    def __post_init__(self) -> None:
        from treadle.server.lifecycle import ModelLifecycle
        from treadle.server.service import Service

        self.lifecycle = ModelLifecycle(self)
        self.service = Service(self)

    def tenant(self, context: grpc.aio.ServicerContext) -> str:
        """The caller's tenant, as ``AuthInterceptor`` established it for this RPC
        (UNAUTHENTICATED if the RPC somehow did not pass through it)."""
        return current_tenant()

    @contextmanager
    def session(self) -> Iterator[Session]:
        with self.sessions() as s:
            yield s
            s.commit()

    @contextmanager
    def connection(self) -> Iterator[Connection]:
        """A Core transaction, for the hot path's writes (half the cost of a Session)."""
        with self.sessions.kw["bind"].begin() as conn:
            yield conn

    def require_model(self, tenant_id: str, model_id: str) -> None:
        """NOT_FOUND for a missing model and for another tenant's (indistinguishable)."""
        owner = self.owners.get(model_id)
        if owner is None or owner != tenant_id:
            raise NotFoundError(f"model {model_id!r} not found")

    def base_model_name(self, name: str) -> str:
        """The served base model ``name`` names: a served name, or the absolute path
        of a served model's directory (so a client that loads its tokenizer by the
        base model's name, as tinker-cookbook does, works offline); ``name``
        unchanged when it is neither (the caller's check then says so)."""
        served = self.catalog.base_model_names()
        if name in served or not name.startswith("/"):
            return name
        wanted = Path(name).resolve()
        for candidate in served:
            try:
                if self.catalog.base_model_path(candidate).resolve() == wanted:
                    return candidate
            except (KeyError, NotFoundError, OSError):
                continue
        return name

    def model_row(self, s: Session, tenant_id: str, model_id: str) -> db.Model:
        row = queries.get_model(s, tenant_id, model_id)
        if row is None:
            raise NotFoundError(f"model {model_id!r} not found")
        return row
