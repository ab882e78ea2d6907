"""What the console's pages show, read from the service layer and the database.

Each function here blocks on the database: the routes run them in a worker
thread (``asyncio.to_thread``), never on the event loop that serves gRPC and the
API. They return plain values for the templates; another tenant's id raises
NotFoundError exactly as a missing one does.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import hashlib
import platform
import sys
from dataclasses import dataclass
from typing import Any

from treadle.common.db import workers as wq
from treadle.common.db.models import Tenant
from treadle.common.engine.domain import TenantQueue
from treadle.common.engine.report import EngineReport, MemoryReading
from treadle.common.store import state_uri
from treadle.errors import NotFoundError, UnauthenticatedError
from treadle.server.console.cookies import ConsoleSession
from treadle.server.context import ServerContext
from treadle.server.db import console_queries, tenancy
from treadle.server.service.types import CheckpointRecord, ModelRecord


@dataclass(frozen=True)
class Viewer:
    """Who is looking: a signed-in tenant, and whether it sees the operator pages."""

    tenant_id: str
    tenant_name: str
    operator: bool
    session: ConsoleSession


def sign_in(ctx: ServerContext, key: str) -> tuple[str, str]:
    """(tenant id, key id) of a live API key; UNAUTHENTICATED for any other."""
    if not ctx.config.auth:
        return ctx.auth.default_tenant_id, ""
    key = key.strip()
    if key.startswith("tml-"):  # the tinker SDK's form of a treadle key
        key = key[4:]
    if not key or len(key) > 256:
        raise UnauthenticatedError("the API key is not valid")
    with ctx.sessions() as s:
        row = console_queries.live_key(s, hashlib.sha256(key.encode()).hexdigest())
        if row is None:
            raise UnauthenticatedError("the API key is not valid")
        return row.tenant_id, row.id


def viewer(ctx: ServerContext, session: ConsoleSession) -> Viewer:
    """The viewer of a session whose key is still live (else UNAUTHENTICATED)."""
    with ctx.sessions() as s:
        if ctx.config.auth and not console_queries.key_is_live(
            s, session.key_id, session.tenant_id
        ):
            raise UnauthenticatedError("signed out: the key was revoked")
        name = console_queries.tenant_name(s, session.tenant_id)
    if not name:
        raise UnauthenticatedError("signed out: the tenant is gone")
    admin = ctx.config.admin_tenant
    return Viewer(session.tenant_id, name, bool(admin) and name == admin, session)


def _when(t: dt.datetime | float | None) -> str:
    if t is None:
        return ""
    if isinstance(t, float | int):
        t = dt.datetime.fromtimestamp(t, dt.timezone.utc)
    return t.strftime("%Y-%m-%d %H:%M:%S UTC")


def _kind(m: ModelRecord) -> str:
    return f"LoRA r{m.lora_rank}" if m.is_lora else "full"


def runs(ctx: ServerContext, tenant: str) -> list[dict[str, Any]]:
    models = ctx.service.models.list(tenant)
    with ctx.sessions() as s:
        activity = console_queries.last_activity(s, tenant)
    out = []
    for m in models:
        last = activity.get(m.model_id)
        out.append(
            {
                "id": m.model_id,
                "base": m.base_model,
                "kind": _kind(m),
                "status": m.status,
                "version": m.version,
                "next_seq_id": m.next_seq_id,
                "created": _when(m.created_at),
                "last_activity": _when(last) if last else _when(m.created_at),
                "sort": (last.timestamp() if last else m.created_at),
            }
        )
    out.sort(key=lambda r: r["sort"], reverse=True)
    return out


def checkpoint_row(c: CheckpointRecord) -> dict[str, Any]:
    return {
        "name": c.name,
        "path": c.path,
        "step": c.step,
        "seq_id": c.seq_id,
        "size": human_bytes(c.size_bytes),
        "created": _when(c.created_at),
        "expires": _when(c.expires_at) if c.expires_at is not None else "never",
    }


def run(ctx: ServerContext, tenant: str, model_id: str) -> dict[str, Any]:
    m = ctx.service.models.info(tenant, model_id)  # NOT_FOUND for another tenant's
    checkpoints = ctx.service.checkpoints.list(tenant, model_id)
    with ctx.sessions() as s:
        samplers = [
            {
                "id": x.id,
                "mode": x.mode,
                "version": x.pinned_version if x.mode == "version" else x.mode,
                "created": _when(x.created_at),
            }
            for x in console_queries.model_samplers(s, tenant, model_id)
        ]
        versions = [
            {
                "version": v.version,
                "uri": v.uri,
                "created": _when(v.created_at),
                "released": v.released,
            }
            for v in console_queries.model_versions(s, model_id)
        ]
    return {
        "id": m.model_id,
        "base": m.base_model,
        "kind": _kind(m),
        "dtype": m.dtype,
        "status": m.status,
        "version": m.version,
        "next_seq_id": m.next_seq_id,
        "session_id": m.session_id,
        "created": _when(m.created_at),
        "checkpoints": [checkpoint_row(c) for c in reversed(checkpoints)],
        "samplers": samplers,
        "versions": versions,
    }


def checkpoint(ctx: ServerContext, tenant: str, model_id: str, name: str) -> CheckpointRecord:
    """The tenant's checkpoint of its model (NOT_FOUND for anything else)."""
    uri = state_uri(model_id, name)
    for c in ctx.service.checkpoints.list(tenant, model_id):
        if c.path == uri:
            return c
    raise NotFoundError(f"checkpoint {name!r} not found")


def curves(ctx: ServerContext, tenant: str, model_id: str) -> dict[str, Any]:
    c = ctx.service.runs.curves(tenant, model_id)
    return {"steps": c.steps, "logged": c.logged}


def operator(ctx: ServerContext) -> dict[str, Any]:
    """Tenants with quotas and usage, workers, the queue per tenant, the build and
    configuration (never a key or a secret)."""
    prices = ctx.config.prices
    with ctx.sessions() as s:
        tenants = list(tenancy.list_tenants(s))
        usage = console_queries.usage_per_tenant(s)
        live = console_queries.live_models_per_tenant(s)
        workers = console_queries.workers(s)
        per_worker = console_queries.models_per_worker(s)
    rows = []
    for t in tenants:
        limits = ctx.quotas.limits(t.id)
        trained, sampled, scored, calls, device_s = usage.get(t.id, (0, 0, 0, 0, 0.0))
        rows.append(
            {
                "name": t.name,
                "models": live.get(t.id, 0),
                "max_models": limits.max_models or "unlimited",
                "in_flight": ctx.quotas.in_flight(t.id),
                "max_in_flight": limits.max_calls_in_flight or "unlimited",
                "tokens_per_minute": limits.tokens_per_minute or "unlimited",
                "tokens_trained": trained,
                "tokens_sampled": sampled,
                "tokens_scored": scored,
                "calls": calls,
                "device_s": f"{device_s:.2f}",
                "cost": (
                    f"{prices.cost(trained, sampled, scored, device_s):.4f} {prices.currency}"
                    if prices.set
                    else ""
                ),
            }
        )
    reports: list[tuple[str, EngineReport]] = []  # (worker, its engine's report)
    worker_rows = []
    local = ctx.engine_metrics.engine_report()
    if local is not None:  # the embedded server's engine: asked now
        reports.append((IN_PROCESS, local))
        worker_rows.append(
            _worker_row(
                IN_PROCESS,
                role="both",
                host=platform.node(),
                base_models=ctx.catalog.base_model_names(),
                capacity="",  # the engine takes models until its memory refuses
                status="live",
                heartbeat="",
                report=local,
            )
        )
    for w in workers:
        # as of the worker's last heartbeat; a stopped or dead worker holds nothing now
        report = wq.report_of(w) if w.status in wq.SERVING else None
        if report is not None:
            reports.append((w.id, report))
        worker_rows.append(
            _worker_row(
                w.id,
                role=w.role,  # both, trainer or sampler (``treadle worker --role``)
                host=w.hostname,
                base_models=wq.base_models_of(w),
                capacity=w.capacity,
                status=w.status,
                heartbeat=_when(w.heartbeat_at),
                report=report,
                placed=per_worker.get(w.id, 0),
            )
        )
    return {
        "tenants": rows,
        "workers": worker_rows,
        "queue": _queue(tenants, rows, reports),
        "build": _build(ctx),
        "config": _config(ctx),
    }


IN_PROCESS = "in-process engine"


def _worker_row(
    worker_id: str,
    *,
    role: str,
    host: str,
    base_models: list[str],
    capacity: int | str,
    status: str,
    heartbeat: str,
    report: EngineReport | None,
    placed: int | None = None,
) -> dict[str, Any]:
    """A worker as the page shows it: what the server keeps (role, status, the
    models placed on it) and what its engine reported (device, memory, the models
    and adapters it holds); "" where it reported nothing yet."""
    return {
        "id": worker_id,
        "role": role,
        "host": host,
        "device": report.device if report else "",
        "memory": _memory(report.memory) if report else "",
        "models": ", ".join(base_models),
        "loaded": report.models if report else "",
        "placed": "" if placed is None else placed,
        "adapters": report.adapters if report else "",
        "served": report.served if report and report.served else "",
        "capacity": capacity,
        "status": status,
        "heartbeat": heartbeat,
    }


def _memory(m: MemoryReading) -> str:
    used = f"{human_bytes(m.used_bytes)} used"
    if not m.total_bytes:
        return used
    return f"{used}, {human_bytes(m.free_bytes)} free of {human_bytes(m.total_bytes)}"


def _queue(
    tenants: list[Tenant], rows: list[dict[str, Any]], reports: list[tuple[str, EngineReport]]
) -> list[dict[str, Any]]:
    """Per tenant: its calls in flight (this server's admission count), the calls
    waiting and running in the engines' schedulers (summed over the workers that
    reported), and each engine's fair-share deficit: every worker runs its own
    scheduler, so deficits are per worker and never added up."""
    by_tenant: dict[str, list[tuple[str, TenantQueue]]] = {}
    for worker_id, report in reports:
        for q in report.queue:
            by_tenant.setdefault(q.tenant_id, []).append((worker_id, q))
    queue = []
    for t, r in zip(tenants, rows, strict=True):
        engines = by_tenant.get(t.id, [])
        if r["in_flight"] == 0 and not engines:
            continue
        queue.append(
            {
                "tenant": r["name"],
                "in_flight": r["in_flight"],
                "waiting": sum(q.waiting for _, q in engines) if engines else "",
                "running": sum(q.running for _, q in engines) if engines else "",
                "deficits": [{"worker": w, "value": q.deficit} for w, q in engines],
            }
        )
    return queue


def _build(ctx: ServerContext) -> dict[str, str]:
    return {
        "treadle": _version(),
        "python": sys.version.split()[0],
        "instance": ctx.instance_id,
        "engine": "in-process" if ctx.dispatcher.engine_in_process else "Celery workers",
    }


def _config(ctx: ServerContext) -> dict[str, str]:
    config = {
        k: v
        for k, v in dataclasses.asdict(ctx.config).items()
        if k not in ("bootstrap_api_key",) and "secret" not in k
    }
    for secretive in ("database_url", "broker"):
        if config.get(secretive):
            config[secretive] = _hide_password(str(config[secretive]))
    return {k: str(v) for k, v in sorted(config.items())}


def _hide_password(url: str) -> str:
    from sqlalchemy import make_url

    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:
        return "(set)"


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("treadle")
    except PackageNotFoundError:
        return "unknown"


def human_bytes(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"
