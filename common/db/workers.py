"""Queries about the worker fleet: registration, heartbeats, liveness and placement.

Times are the writer's UTC clock (workers and servers keep NTP time); a worker is
dead when its heartbeat is older than the server's ``worker_timeout_s``.
Declaring a worker dead is a conditional UPDATE, so with several servers exactly
one of them declares it and marks its models lost.

A serving worker is ``live`` (it takes new models) or ``draining`` (stopping
gracefully: it serves the models it has while servers move them off to
checkpoints, and takes no new ones). ``stopped`` and ``dead`` workers are gone.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Iterable, Sequence
from typing import Any

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from treadle.common.engine import report as engine_report
from treadle.common.engine.report import EngineReport

from .models import Model, Worker, utcnow

#: statuses of a worker that still answers its queue
SERVING = ("live", "draining")


def register_worker(
    s: Session,
    worker_id: str,
    *,
    hostname: str,
    base_models: Iterable[str],
    capacity: int,
    role: str = "both",
) -> Worker:
    """A worker (re)joins as live; a restarted worker with the same id starts empty."""
    row = s.get(Worker, worker_id)
    now = utcnow()
    if row is None:
        row = Worker(id=worker_id)
        s.add(row)
    row.hostname = hostname[:255]
    row.base_models = json.dumps(sorted(base_models))
    row.capacity = capacity
    row.role = role
    row.status = "live"
    row.started_at = now
    row.heartbeat_at = now
    row.report = None
    s.flush()
    return row


def heartbeat(s: Session, worker_id: str, report: EngineReport | None = None) -> str | None:
    """Record a heartbeat of a serving worker, with what its engine reports (kept
    when None); the worker's status (None: unknown). A worker declared dead is not
    revived: it must stop serving."""
    values: dict[str, Any] = {"heartbeat_at": utcnow()}
    if report is not None:
        values["report"] = json.dumps(engine_report.to_json(report), separators=(",", ":"))
    s.execute(
        update(Worker).where(Worker.id == worker_id, Worker.status.in_(SERVING)).values(**values)
    )
    return s.scalar(select(Worker.status).where(Worker.id == worker_id))


def report_of(row: Worker) -> EngineReport | None:
    """The report of the worker's last heartbeat (None: none yet, or unreadable:
    a worker of another release may write another form)."""
    if not row.report:
        return None
    try:
        return engine_report.from_json(json.loads(row.report))
    except (ValueError, KeyError, TypeError):
        return None


def set_worker_status(s: Session, worker_id: str, status: str) -> None:
    s.execute(update(Worker).where(Worker.id == worker_id).values(status=status))


def base_models_of(row: Worker) -> list[str]:
    return list(json.loads(row.base_models or "[]"))


def live_workers(s: Session, fresh_after: dt.datetime) -> Sequence[Worker]:
    """Workers that take new models (not draining), heard from since ``fresh_after``."""
    stmt = (
        select(Worker)
        .where(Worker.status == "live", Worker.heartbeat_at >= fresh_after)
        .order_by(Worker.id)
    )
    return s.scalars(stmt).all()


def worker_loads(s: Session) -> dict[str, int]:
    """worker id -> active models placed on it."""
    stmt = (
        select(Model.worker_id, func.count())
        .where(Model.status == "active", Model.worker_id.is_not(None))
        .group_by(Model.worker_id)
    )
    return {str(w): int(n) for w, n in s.execute(stmt).all()}


def declare_dead(s: Session, stale_before: dt.datetime) -> list[str]:
    """Serving workers whose last heartbeat is older than ``stale_before`` become dead;
    the ids this call declared (another server may have declared some first)."""
    candidates = s.scalars(
        select(Worker.id).where(Worker.status.in_(SERVING), Worker.heartbeat_at < stale_before)
    ).all()
    declared = []
    for worker_id in candidates:
        result = s.execute(
            update(Worker)
            .where(
                Worker.id == worker_id,
                Worker.status.in_(SERVING),
                Worker.heartbeat_at < stale_before,
            )
            .values(status="dead")
        )
        if getattr(result, "rowcount", 0) == 1:
            declared.append(worker_id)
    return declared


def gone_workers(s: Session, worker_ids: Iterable[str]) -> set[str]:
    """Of these ids, the workers that are dead, stopped or unknown."""
    ids = set(worker_ids)
    if not ids:
        return set()
    serving = s.scalars(
        select(Worker.id).where(Worker.id.in_(ids), Worker.status.in_(SERVING))
    ).all()
    return ids - set(serving)


def draining_workers(s: Session) -> set[str]:
    """Workers stopping gracefully: their models are to be moved off."""
    return set(s.scalars(select(Worker.id).where(Worker.status == "draining")).all())


def mark_models_lost(s: Session, worker_ids: Iterable[str]) -> list[str]:
    """Active models of these (gone) workers become lost; their ids."""
    ids = list(worker_ids)
    if not ids:
        return []
    lost = list(
        s.scalars(select(Model.id).where(Model.worker_id.in_(ids), Model.status == "active")).all()
    )
    if lost:
        s.execute(
            update(Model)
            .where(Model.id.in_(lost), Model.status == "active")
            .values(status="lost", updated_at=utcnow())
        )
    return lost


def place_model(s: Session, model_id: str, worker_id: str) -> None:
    s.execute(
        update(Model)
        .where(Model.id == model_id)
        .values(worker_id=worker_id, status="active", updated_at=utcnow())
    )


def stopped_workers_with_models(s: Session) -> list[str]:
    """Dead or stopped workers that still have active models (a worker that died
    while no server was watching, or that stopped before its drain moved them all)."""
    stmt = (
        select(Worker.id)
        .join(Model, Model.worker_id == Worker.id)
        .where(Worker.status.not_in(SERVING), Model.status == "active")
        .distinct()
    )
    return list(s.scalars(stmt).all())


def active_models_on(s: Session, worker_ids: Iterable[str]) -> set[str]:
    """Active models placed on these workers."""
    return _ids(s, Model.id, Model.worker_id, worker_ids, Model.status == "active")


def unloaded_models(s: Session, model_ids: Iterable[str]) -> set[str]:
    """Of these models, those checkpointed and freed (``unloaded``)."""
    return _ids(s, Model.id, Model.id, model_ids, Model.status == "unloaded")


def stopped_cleanly(s: Session, worker_ids: Iterable[str]) -> set[str]:
    """Of these workers, those that stopped on their own (not declared dead)."""
    return _ids(s, Worker.id, Worker.id, worker_ids, Worker.status == "stopped")


def _ids(s: Session, picked: Any, among_column: Any, among: Iterable[str], *where: Any) -> set[str]:
    """``picked`` of the rows whose ``among_column`` is one of ``among``, and ``where``."""
    values = list(among)
    if not values:
        return set()
    return set(s.scalars(select(picked).where(among_column.in_(values), *where)).all())
