"""A run's curves in the database: the metrics its applied calls returned and
those its client logged, written in batches and read back as series per step.

Writes are idempotent: a call's metrics are keyed by its ``seq_id`` (a retry's
second write is ignored), a logged metric by (step, name) (a second log of it
replaces the value).
"""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from sqlalchemy import Connection, delete, func, insert, select

from treadle.common.db.models import LoggedMetric, StepMetric, utcnow
from treadle.rl.metrics import merge_metrics


@dataclass(frozen=True)
class CallMetrics:
    """The metrics one applied call returned."""

    model_id: str
    seq_id: int
    kind: str
    step: int | None  # the version an optim_step made; None for the other calls
    values: Mapping[str, float]


def write_call_metrics(conn: Connection, batch: Sequence[CallMetrics]) -> int:
    """Insert the calls' metrics, skipping those already written; rows written."""
    if not batch:
        return 0
    keys = {(c.model_id, c.seq_id) for c in batch}
    seen = {
        (m, s)
        for m, s in conn.execute(
            select(StepMetric.model_id, StepMetric.seq_id)
            .where(StepMetric.model_id.in_({m for m, _ in keys}))
            .where(StepMetric.seq_id.in_({s for _, s in keys}))
            .distinct()
        )
    }
    now = utcnow()
    rows = [
        {
            "model_id": c.model_id,
            "seq_id": c.seq_id,
            "name": name[:128],
            "kind": c.kind,
            "step": c.step,
            "value": float(value),
            "created_at": now,
        }
        for c in batch
        if (c.model_id, c.seq_id) not in seen
        for name, value in c.values.items()
        if math.isfinite(value)
    ]
    if rows:
        conn.execute(insert(StepMetric), rows)
    return len(rows)


def log_metrics(conn: Connection, model_id: str, step: int, values: Mapping[str, float]) -> None:
    """The client's metrics of a step (replacing what it logged before for them)."""
    names = list(values)
    conn.execute(
        delete(LoggedMetric).where(
            LoggedMetric.model_id == model_id,
            LoggedMetric.step == step,
            LoggedMetric.name.in_(names),
        )
    )
    now = utcnow()
    conn.execute(
        insert(LoggedMetric),
        [
            {"model_id": model_id, "step": step, "name": n, "value": float(v), "logged_at": now}
            for n, v in values.items()
        ],
    )


#: name -> [(step, value)], steps ascending
Series = dict[str, list[tuple[int, float]]]


def step_series(conn: Connection, model_id: str) -> Series:
    """The calls' metrics per optimizer step. An optim_step's metrics are at the
    version it made; the forward_backward calls before it are merged into the same
    step as ``treadle.rl.merge_metrics`` merges a step's calls (losses are sums and
    add up; means are token means; min and max take the extreme). Calls after the
    last optim_step are a step in progress and are left out."""
    rows = conn.execute(
        select(
            StepMetric.seq_id, StepMetric.kind, StepMetric.step, StepMetric.name, StepMetric.value
        )
        .where(StepMetric.model_id == model_id)
        .order_by(StepMetric.seq_id)
    ).all()
    series: Series = {}
    pending: dict[int, dict[str, float]] = {}  # seq_id -> a forward_backward's metrics
    for r in rows:
        if r.kind == "forward_backward":
            pending.setdefault(int(r.seq_id), {})[r.name] = float(r.value)
        elif r.kind == "optim_step" and r.step is not None:
            step = int(r.step)
            before = [pending.pop(q) for q in sorted(pending) if q < r.seq_id]
            for name, value in merge_metrics(before).items():
                series.setdefault(name, []).append((step, value))
            series.setdefault(r.name, []).append((step, float(r.value)))
    for points in series.values():
        points.sort()
    return series


def logged_series(conn: Connection, model_id: str) -> Series:
    series: Series = {}
    for step, name, value in conn.execute(
        select(LoggedMetric.step, LoggedMetric.name, LoggedMetric.value)
        .where(LoggedMetric.model_id == model_id)
        .order_by(LoggedMetric.step)
    ):
        series.setdefault(name, []).append((int(step), float(value)))
    return series


@dataclass(frozen=True)
class MetricPoint:
    """One value of a run's metric, for its session's trace: a call's (``seq_id``)
    or one the client logged (``seq_id`` None, ``step`` its step)."""

    model_id: str
    seq_id: int | None
    step: int | None
    name: str
    value: float
    at: dt.datetime


def metric_points(conn: Connection, model_ids: Iterable[str]) -> list[MetricPoint]:
    ids = list(model_ids)
    if not ids:
        return []
    calls = conn.execute(
        select(
            StepMetric.model_id,
            StepMetric.seq_id,
            StepMetric.step,
            StepMetric.name,
            StepMetric.value,
            StepMetric.created_at,
        ).where(StepMetric.model_id.in_(ids))
    ).all()
    logged = conn.execute(
        select(
            LoggedMetric.model_id,
            LoggedMetric.step,
            LoggedMetric.name,
            LoggedMetric.value,
            LoggedMetric.logged_at,
        ).where(LoggedMetric.model_id.in_(ids))
    ).all()
    return [MetricPoint(m, int(q), s, n, float(v), t) for m, q, s, n, v, t in calls] + [
        MetricPoint(m, None, int(s), n, float(v), t) for m, s, n, v, t in logged
    ]


def fingerprint(conn: Connection, model_id: str) -> tuple[object, ...]:
    """What changes when a run's curves do: rows and the newest of each table (two
    index-only aggregates, far cheaper than reading the curves)."""
    calls = conn.execute(
        select(func.count(), func.max(StepMetric.seq_id)).where(StepMetric.model_id == model_id)
    ).one()
    logged = conn.execute(
        select(func.count(), func.max(LoggedMetric.logged_at)).where(
            LoggedMetric.model_id == model_id
        )
    ).one()
    return (*calls, *logged)
