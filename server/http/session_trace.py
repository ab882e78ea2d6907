"""A session's timeline as a trace Perfetto opens (``RestClient.export_session_trace``).

The SDK asks ``GET sessions/{id}/trace_export`` for a download URL that needs no
key, then the caller fetches it with a plain GET. Here the URL carries an
unguessable token this server issued for that tenant's session, valid for an
hour on this server (``TraceLinks``); the trace is built from the database when
it is downloaded, so it is as up to date as the download.

The file is the Chrome trace-event JSON format, which ui.perfetto.dev and
``chrome://tracing`` open as they do a ``.pftrace``: one track per training run,
each ordered call a slice from its admission to its end (queueing included:
``seq_id``, status and error code in its arguments), and instants for the
session's start and end and each sampler made in it or of its runs' weights.
Each run's metrics are counter tracks: what its calls returned (``loss:sum``,
``grad_norm:value``, ...) at the end of the call, and what its client logged
(``log_metrics``) at the time it was logged, prefixed ``client/``. Sampling
requests are not in it: treadle's database does not record them one by one.
"""

from __future__ import annotations

import datetime as dt
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from treadle.server.db.run_metrics import MetricPoint
from treadle.server.service.types import SessionTimeline

#: how long a download URL stays valid (the SDK says "about an hour")
LINK_TTL_S = 3600.0


@dataclass
class TraceLinks:
    """Download tokens: token -> (tenant, session id, expiry on ``time.monotonic()``)."""

    ttl_s: float = LINK_TTL_S
    _links: dict[str, tuple[str, str, float]] = field(default_factory=dict)

    def issue(self, tenant: str, session_id: str) -> str:
        now = time.monotonic()
        self._links = {k: v for k, v in self._links.items() if v[2] > now}
        token = secrets.token_urlsafe(32)
        self._links[token] = (tenant, session_id, now + self.ttl_s)
        return token

    def resolve(self, token: str) -> tuple[str, str] | None:
        """(tenant, session id) of a live token; None for an unknown or expired one."""
        link = self._links.get(token)
        if link is None or link[2] <= time.monotonic():
            return None
        return link[0], link[1]


def trace(t: SessionTimeline, metrics: list[MetricPoint] | None = None) -> dict[str, Any]:
    origin = t.created_at
    events: list[dict[str, Any]] = [_name(0, f"session {t.session_id}")]
    events.append(_instant(0, "session created", _us(t.created_at, origin)))
    if t.ended_at is not None:
        events.append(_instant(0, "session ended", _us(t.ended_at, origin)))
    pid = {model_id: i + 1 for i, (model_id, _) in enumerate(t.models)}
    for model_id, created in t.models:
        events.append(_name(pid[model_id], f"training run {model_id}"))
        events.append(_instant(pid[model_id], "created", _us(created, origin)))
    for call in t.calls:
        args = {"seq_id": call.seq_id, "status": call.status}
        if call.error_code:
            args["error_code"] = call.error_code
        start = _us(call.admitted, origin)
        if call.ended is None:  # not ended yet: where it was admitted
            events.append(_instant(pid[call.model_id], f"{call.kind} (pending)", start, args))
            continue
        events.append(
            {
                "ph": "X",
                "name": call.kind,
                "pid": pid[call.model_id],
                "tid": 1,
                "ts": start,
                "dur": max(0, _us(call.ended, origin) - start),
                "args": args,
            }
        )
    ended = {(c.model_id, c.seq_id): c.ended for c in t.calls if c.ended is not None}
    for p in sorted(metrics or (), key=lambda p: p.at):
        if p.model_id not in pid:
            continue
        name = p.name if p.seq_id is not None else f"client/{p.name}"
        at = ended.get((p.model_id, p.seq_id), p.at) if p.seq_id is not None else p.at
        events.append(
            {
                "ph": "C",
                "name": name,
                "pid": pid[p.model_id],
                "ts": _us(at, origin),
                "args": {name: p.value},
            }
        )
    for sampler_id, model_id, created in t.samplers:
        where = pid.get(model_id or "", 0)
        events.append(_instant(where, f"sampler {sampler_id}", _us(created, origin)))
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "metadata": {"session_id": t.session_id, "created_at": origin.isoformat()},
    }


def _us(when: dt.datetime, origin: dt.datetime) -> int:
    return round((when - origin).total_seconds() * 1e6)


def _name(pid: int, name: str) -> dict[str, Any]:
    return {"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": name}}


def _instant(pid: int, name: str, ts: int, args: dict[str, Any] | None = None) -> dict[str, Any]:
    event = {"ph": "i", "s": "p", "name": name, "pid": pid, "tid": 1, "ts": ts}
    return {**event, "args": args} if args else event
