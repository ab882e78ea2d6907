"""The worker fleet's queries: registration, heartbeats, declaring the dead once,
their models lost, and placement loads."""

from __future__ import annotations

import datetime as dt
from dataclasses import replace

from sqlalchemy.orm import Session

from treadle.common.db import workers as wq
from treadle.common.db.models import Model, Worker, utcnow
from treadle.common.engine.domain import TenantQueue
from treadle.common.engine.report import EngineReport, MemoryReading
from treadle.server.db import queries as q


def _model(s: Session, tenant_id: str, worker_id: str) -> str:
    row = q.create_model(
        s,
        tenant_id=tenant_id,
        base_model="tiny",
        lora_rank=4,
        lora_alpha=4.0,
        seed=0,
        dtype="float32",
    )
    wq.place_model(s, row.id, worker_id)
    return row.id


def test_register_heartbeat_and_loads(session: Session) -> None:
    s = session
    w = wq.register_worker(s, "w-1", hostname="gpu-1", base_models=["tiny", "big"], capacity=2)
    assert wq.base_models_of(w) == ["big", "tiny"] and w.status == "live"
    wq.register_worker(s, "w-2", hostname="gpu-2", base_models=["tiny"], capacity=2)
    tenant = q.ensure_tenant(s, "alice").id
    a, _ = _model(s, tenant, "w-1"), _model(s, tenant, "w-1")
    _model(s, tenant, "w-2")
    q.mark_model_deleted(s, tenant, a)
    assert wq.worker_loads(s) == {"w-1": 1, "w-2": 1}  # deleted models free their place
    assert wq.heartbeat(s, "w-1") == "live"
    assert wq.heartbeat(s, "nobody") is None
    fresh = utcnow() - dt.timedelta(seconds=5)
    assert [w.id for w in wq.live_workers(s, fresh)] == ["w-1", "w-2"]


def test_dead_once_models_lost_and_no_revival(session: Session) -> None:
    s = session
    wq.register_worker(s, "w-1", hostname="h", base_models=["tiny"], capacity=4)
    wq.register_worker(s, "w-2", hostname="h", base_models=["tiny"], capacity=4)
    tenant = q.ensure_tenant(s, "alice").id
    lost, kept = _model(s, tenant, "w-1"), _model(s, tenant, "w-2")
    s.get(Worker, "w-1").heartbeat_at = utcnow() - dt.timedelta(seconds=60)  # type: ignore[union-attr]
    s.flush()
    stale = utcnow() - dt.timedelta(seconds=15)
    assert wq.declare_dead(s, stale) == ["w-1"]
    assert wq.declare_dead(s, stale) == []  # a second server finds it declared already
    assert wq.stopped_workers_with_models(s) == ["w-1"]
    assert wq.mark_models_lost(s, ["w-1"]) == [lost]
    assert wq.stopped_workers_with_models(s) == []
    assert s.get(Model, lost).status == "lost"  # type: ignore[union-attr]
    assert s.get(Model, kept).status == "active"  # type: ignore[union-attr]
    assert wq.gone_workers(s, ["w-1", "w-2", "w-9"]) == {"w-1", "w-9"}
    # a worker declared dead is not revived by a late heartbeat: it must stop
    assert wq.heartbeat(s, "w-1") == "dead"
    assert [w.id for w in wq.live_workers(s, stale)] == ["w-2"]
    # ... unless it registers again (a restart), empty
    wq.register_worker(s, "w-1", hostname="h", base_models=["tiny"], capacity=4)
    assert wq.heartbeat(s, "w-1") == "live"


def test_a_draining_worker_serves_but_takes_no_new_models(session: Session) -> None:
    """Draining: still serving (heart-beats, not gone, its models not lost), not
    placeable; silent too long, it is declared dead like a live one; once it has
    stopped, the models it still had are lost."""
    s = session
    wq.register_worker(s, "w-1", hostname="h", base_models=["tiny"], capacity=4)
    wq.register_worker(s, "w-2", hostname="h", base_models=["tiny"], capacity=4)
    tenant = q.ensure_tenant(s, "alice").id
    moving = _model(s, tenant, "w-1")
    wq.set_worker_status(s, "w-1", "draining")
    fresh = utcnow() - dt.timedelta(seconds=5)
    assert wq.heartbeat(s, "w-1") == "draining"
    assert [w.id for w in wq.live_workers(s, fresh)] == ["w-2"]
    assert wq.draining_workers(s) == {"w-1"}
    assert wq.gone_workers(s, ["w-1", "w-2"]) == set()
    assert wq.stopped_workers_with_models(s) == []  # draining: its models are not lost
    assert wq.declare_dead(s, utcnow() - dt.timedelta(seconds=15)) == []
    wq.set_worker_status(s, "w-1", "stopped")
    assert wq.draining_workers(s) == set()
    assert wq.gone_workers(s, ["w-1"]) == {"w-1"}
    assert wq.stopped_workers_with_models(s) == ["w-1"]
    assert wq.mark_models_lost(s, ["w-1"]) == [moving]
    # a draining worker that goes silent dies like a live one
    wq.set_worker_status(s, "w-2", "draining")
    s.get(Worker, "w-2").heartbeat_at = utcnow() - dt.timedelta(seconds=60)  # type: ignore[union-attr]
    s.flush()
    assert wq.declare_dead(s, utcnow() - dt.timedelta(seconds=15)) == ["w-2"]


def test_a_heartbeat_carries_the_engines_report(session: Session) -> None:
    """The report a heartbeat writes reads back as it was sent; a heartbeat without
    one keeps the last; a dead worker's late heartbeat writes nothing; a worker that
    registers again (a restart) has reported nothing yet."""
    s = session
    wq.register_worker(s, "w-1", hostname="h", base_models=["tiny"], capacity=4)
    row = s.get(Worker, "w-1")
    assert row is not None and wq.report_of(row) is None
    sent = EngineReport(
        device="cuda:1",
        memory=MemoryReading(used_bytes=3 << 30, free_bytes=60 << 30, total_bytes=80 << 30),
        models=3,
        adapters=2,
        served=1,
        queue=(TenantQueue("t-a", 4, 1, -250), TenantQueue("t-b", 0, 2, 120)),
    )
    assert wq.heartbeat(s, "w-1", sent) == "live"
    s.refresh(row)
    assert wq.report_of(row) == sent
    wq.heartbeat(s, "w-1")  # a reading failed on the worker: the last report stays
    s.refresh(row)
    assert wq.report_of(row) == sent
    wq.set_worker_status(s, "w-1", "dead")
    wq.heartbeat(s, "w-1", replace(sent, models=9))
    s.refresh(row)
    assert wq.report_of(row) == sent
    wq.register_worker(s, "w-1", hostname="h", base_models=["tiny"], capacity=4)
    assert wq.report_of(row) is None
    row.report = '{"device": "cpu"}'  # another release's form: not read as a report
    assert wq.report_of(row) is None
