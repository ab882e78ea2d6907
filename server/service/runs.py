"""A run (a training model) as people and scripts follow it: its usage and cost,
its curves (the metrics its calls returned and those its client logged), for
any transport and the console."""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from collections.abc import Mapping

from sqlalchemy import func, select

from treadle.common.db import models as db
from treadle.errors import InvalidArgumentError, NotFoundError
from treadle.server.context import ServerContext
from treadle.server.db import queries, run_metrics
from treadle.server.service.types import RunCurves, RunUsageRecord

#: at most this many metrics in one log_metrics call
MAX_LOGGED_METRICS = 256
MAX_METRIC_NAME = 128


def check_logged(step: int, values: Mapping[str, float]) -> dict[str, float]:
    """INVALID_ARGUMENT naming the field for a step or metric a run cannot keep."""
    if step < 0:
        raise InvalidArgumentError(f"step: must be >= 0 (got {step})")
    if not values:
        raise InvalidArgumentError("metrics: give at least one name: value")
    if len(values) > MAX_LOGGED_METRICS:
        raise InvalidArgumentError(
            f"metrics: at most {MAX_LOGGED_METRICS} in one call (got {len(values)})"
        )
    checked: dict[str, float] = {}
    for name, value in values.items():
        if not name or len(name) > MAX_METRIC_NAME or not name.isprintable():
            raise InvalidArgumentError(
                f"metrics: name {name[:40]!r} must be 1-{MAX_METRIC_NAME} printable characters"
            )
        value = float(value)
        if not math.isfinite(value):
            raise InvalidArgumentError(f"metrics[{name!r}]: must be a finite number (got {value})")
        checked[name] = value
    return checked


#: runs whose curves are kept computed (a page polls them every 2 s)
CURVES_CACHED = 64


class RunService:
    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx
        #: model id -> (fingerprint, curves): read again only when the rows changed
        self._curves: OrderedDict[str, tuple[tuple[object, ...], RunCurves]] = OrderedDict()
        self._lock = threading.Lock()

    def _require(self, tenant: str, model_id: str) -> None:
        with self.ctx.session() as s:
            if queries.get_model(s, tenant, model_id) is None:
                raise NotFoundError(f"model {model_id!r} not found")

    def log_metrics(
        self, tenant: str, model_id: str, step: int, values: Mapping[str, float]
    ) -> int:
        """Keep the client's metrics of a step; how many were kept."""
        checked = check_logged(step, values)
        self._require(tenant, model_id)
        with self.ctx.connection() as conn:
            run_metrics.log_metrics(conn, model_id, step, checked)
        return len(checked)

    def usage(self, tenant: str, model_id: str) -> RunUsageRecord:
        """The run's usage: what is in the database plus what is counted and not yet
        written (read on the event loop that writes it, so nothing is missed or
        counted twice), and its cost at the operator's prices."""
        self._require(tenant, model_id)
        # a call already answered is counted once its end is written (behind the
        # answer, with the engine in this process): write the queued ends first
        self.ctx.service.op_endings.flush()
        u = db.Usage
        with self.ctx.session() as s:
            row = s.execute(
                select(
                    func.coalesce(func.sum(u.tokens_trained), 0),
                    func.coalesce(func.sum(u.tokens_sampled), 0),
                    func.coalesce(func.sum(u.tokens_scored), 0),
                    func.coalesce(func.sum(u.calls), 0),
                    func.coalesce(func.sum(u.compute_s), 0.0),
                ).where(u.tenant_id == tenant, u.model_id == model_id)
            ).one()
        trained, sampled, scored, calls = int(row[0]), int(row[1]), int(row[2]), int(row[3])
        device_s = float(row[4])
        if self.ctx.usage is not None:
            for (t, m, _), d in self.ctx.usage.pending().items():
                if t == tenant and m == model_id:
                    trained += d.tokens_trained
                    sampled += d.tokens_sampled
                    scored += d.tokens_scored
                    calls += d.calls
                    device_s += d.compute_s
        prices = self.ctx.config.prices
        cost = prices.cost(trained, sampled, scored, device_s) if prices.set else None
        return RunUsageRecord(
            model_id, trained, sampled, scored, calls, device_s, cost, prices.currency
        )

    def metric_points(self, model_ids: list[str]) -> list[run_metrics.MetricPoint]:
        """Every metric value of these runs (already the caller's: a session's)."""
        with self.ctx.sessions.kw["bind"].connect() as conn:
            return run_metrics.metric_points(conn, model_ids)

    def curves(self, tenant: str, model_id: str) -> RunCurves:
        """The run's curves (a database read: call it off the event loop)."""
        self._require(tenant, model_id)
        with self.ctx.sessions.kw["bind"].connect() as conn:
            seen = run_metrics.fingerprint(conn, model_id)
            with self._lock:
                cached = self._curves.get(model_id)
            if cached is not None and cached[0] == seen:
                return cached[1]
            curves = RunCurves(
                run_metrics.step_series(conn, model_id), run_metrics.logged_series(conn, model_id)
            )
        with self._lock:
            self._curves[model_id] = (seen, curves)
            self._curves.move_to_end(model_id)
            while len(self._curves) > CURVES_CACHED:
                self._curves.popitem(last=False)
        return curves
