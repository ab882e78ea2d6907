"""The ends of ordered calls written behind their answers (``OpEndings``): in
order, in one transaction per flush, counted by the call that ended the row, kept
when a flush fails, and all written when the server stops."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from sqlalchemy import Connection, Engine, text
from sqlalchemy.orm import Session

import treadle
from tests.conftest import make_server
from treadle.server.db import ops_log
from treadle.server.db import queries as q
from treadle.server.service.op_endings import Ending, OpEndings


def _pending_ops(session: Session, seq_ids: list[int]) -> tuple[Engine, str]:
    tenant = q.ensure_tenant(session, "t")
    model = q.create_model(
        session,
        tenant_id=tenant.id,
        base_model="tiny",
        lora_rank=2,
        lora_alpha=4.0,
        seed=0,
        dtype="float32",
    )
    session.commit()
    engine = session.get_bind()
    assert isinstance(engine, Engine)
    with engine.begin() as conn:
        for seq in seq_ids:
            assert ops_log.insert_op_if_new(conn, model.id, seq, "forward_backward", f"d{seq}")
    return engine, model.id


def _statuses(engine: Engine, model_id: str) -> list[tuple[int, str, str | None]]:
    with engine.connect() as conn:
        rows = conn.execute(
            text("SELECT seq_id, status, error_code FROM ops WHERE model_id = :m ORDER BY seq_id"),
            {"m": model_id},
        ).all()
    return [tuple(r) for r in rows]  # type: ignore[misc]


class Transactions:
    """A connection factory that counts its transactions (and can fail the next)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.count = 0
        self.fail_next = False

    @contextlib.contextmanager
    def __call__(self) -> Iterator[Connection]:
        if self.fail_next:
            self.fail_next = False
            raise ConnectionError("the database is away")
        self.count += 1
        with self.engine.begin() as conn:
            yield conn


def test_ends_are_written_in_order_in_one_transaction_and_counted_once(session: Session) -> None:
    engine, model = _pending_ops(session, [1, 2])
    tx = Transactions(engine)
    endings = OpEndings(tx)
    counted: list[str] = []
    # seq 1 failed UNAVAILABLE, then its repeat (same payload) was applied; seq 2
    # was applied and answered twice (a repeat that came before the flush)
    endings._queued += [
        Ending(model, 1, "failed", "UNAVAILABLE", "d1", lambda: counted.append("1 failed")),
        Ending(model, 1, "done", None, "d1", lambda: counted.append("1 done")),
        Ending(model, 2, "done", None, "d2", lambda: counted.append("2 done")),
        Ending(model, 2, "done", None, "d2", lambda: counted.append("2 again")),
    ]
    assert _statuses(engine, model) == [(1, "pending", None), (2, "pending", None)]
    assert endings.flush() == 4
    assert tx.count == 1
    assert counted == ["1 failed", "1 done", "2 done"]
    assert _statuses(engine, model) == [(1, "done", None), (2, "done", None)]
    assert endings.flush() == 0 and tx.count == 1  # nothing queued: no transaction


def test_a_failed_flush_keeps_its_ends_for_the_next(session: Session) -> None:
    engine, model = _pending_ops(session, [1, 2])
    tx = Transactions(engine)
    endings = OpEndings(tx, flush_s=60.0)
    counted: list[int] = []

    async def scenario() -> None:
        endings.end(Ending(model, 1, "done", None, "d1", lambda: counted.append(1)))
        tx.fail_next = True
        assert endings.flush() == 0  # logged, kept, retried later
        endings.end(Ending(model, 2, "done", None, "d2", lambda: counted.append(2)))
        assert endings.queued() == 2
        await endings.close()

    asyncio.run(scenario())
    assert counted == [1, 2]
    assert _statuses(engine, model) == [(1, "done", None), (2, "done", None)]


def test_queued_ends_are_written_within_flush_s(session: Session) -> None:
    engine, model = _pending_ops(session, [1])
    endings = OpEndings(Transactions(engine), flush_s=0.01)

    async def scenario() -> None:
        endings.end(Ending(model, 1, "done", None, "d1"))
        assert _statuses(engine, model) == [(1, "pending", None)]  # behind the answer
        for _ in range(500):  # the timer's flush, whatever the machine's load
            await asyncio.sleep(0.01)
            if not endings.queued():
                break

    asyncio.run(scenario())
    assert _statuses(engine, model) == [(1, "done", None)]


@pytest.fixture
def tiny(tiny_model_dir: Path) -> dict[str, Path]:
    return {"tiny": tiny_model_dir}


def test_a_stopping_server_writes_the_ends_it_holds(tmp_path: Path, tiny: dict[str, Path]) -> None:
    """The embedded server answers before it writes a call's end; stopping writes
    every end it holds, and counts each call's usage once."""
    srv = make_server(tmp_path, tiny, usage_flush_s=3600.0)
    try:
        assert srv.ctx is not None
        endings = srv.ctx.service.op_endings
        endings.flush_s = 3600.0  # only the stop writes them
        client = treadle.ServiceClient(srv.address, api_key=srv.api_key)
        try:
            tc = client.create_lora_training_client("tiny", rank=2)
            one = treadle.Datum(
                model_input=treadle.ModelInput.from_ints([5, 6]),
                loss_fn_inputs={"target_tokens": [6, 7]},
            )
            for _ in range(3):
                out = tc.forward_logprobs([one]).result()
                assert np.isfinite(out.loss_fn_outputs[0].logprobs).all()
            model_id = tc.model_id
        finally:
            client.close()
        engine = srv.ctx.sessions.kw["bind"]
        assert _statuses(engine, model_id) == [(s, "pending", None) for s in (1, 2, 3)]
    finally:
        srv.stop()
    assert _statuses(engine, model_id) == [(s, "done", None) for s in (1, 2, 3)]
    with engine.connect() as conn:
        calls = conn.execute(
            text("SELECT SUM(calls) FROM usage WHERE model_id = :m"), {"m": model_id}
        ).scalar()
    assert calls == 3
