"""The server's replay log (``treadle.server.replay_log``) on SQLite: what it keeps
of the calls applied since a model's last checkpoint, when it releases them, its
bound, and when it cannot replay (then the model stays lost)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy.orm import Session, sessionmaker

from treadle.common.db.models import Model
from treadle.common.engine.domain import (
    AdamConfig,
    DatumData,
    ForwardBackwardOp,
    ForwardLogprobsOp,
    OptimStepOp,
    RejectedOp,
)
from treadle.server.db import make_engine, make_session_factory, ops_log, upgrade_to_head
from treadle.server.db import queries as q
from treadle.server.replay_log import ReplayLog

from .test_db_queries import _checkpoint, _model


@pytest.fixture
def sessions(tmp_path: Path) -> Iterator[sessionmaker[Session]]:
    engine = make_engine(f"sqlite:///{tmp_path / 'treadle.db'}")
    upgrade_to_head(engine)
    yield make_session_factory(engine)
    engine.dispose()


def _fb(n: int) -> ForwardBackwardOp:
    import numpy as np

    tokens = np.arange(n, dtype=np.int32)
    datum = DatumData(tokens, {"target_tokens": tokens, "weights": np.ones(n, np.float32)})
    return ForwardBackwardOp((datum,), "cross_entropy", {})


def _applied(
    sessions: sessionmaker[Session], log: ReplayLog, model_id: str, seq_id: int, op: object
) -> None:
    """What the servicer and the dispatcher do for a call the worker applied."""
    with sessions() as s:
        ops_log.insert_op_if_new(s.connection(), model_id, seq_id, "op", f"sha256:{seq_id}")
        s.commit()
    log.record(model_id, seq_id, op)  # type: ignore[arg-type]
    with sessions() as s:
        ops_log.finish_pending_op(s.connection(), model_id, seq_id, "done")
        s.commit()


@pytest.fixture
def model_id(sessions: sessionmaker[Session]) -> str:
    with sessions() as s:
        model = _model(s, q.ensure_tenant(s, "alice").id)
        s.commit()
        return model.id


def test_keeps_every_call_since_the_checkpoint_in_order(
    sessions: sessionmaker[Session], model_id: str
) -> None:
    log = ReplayLog(sessions, 1 << 20)
    assert log.calls_since(model_id, 0) == []
    ops = [_fb(8), OptimStepOp(AdamConfig(learning_rate=0.1)), _fb(5)]
    for seq, op in enumerate(ops, 1):
        _applied(sessions, log, model_id, seq, op)
    calls = log.calls_since(model_id, 0)
    assert calls is not None and [c.seq_id for c in calls] == [1, 2, 3]
    assert calls[1].op == ops[1] and calls[2].digest == "sha256:3"
    assert (calls[0].op.data[0].tokens == ops[0].data[0].tokens).all()  # type: ignore[union-attr]
    assert [c.seq_id for c in log.calls_since(model_id, 2) or []] == [3]


def test_a_forward_logprobs_is_kept_as_a_marker_of_its_seq_id(
    sessions: sessionmaker[Session], model_id: str
) -> None:
    log = ReplayLog(sessions, 1 << 20)
    data = _fb(2000).data
    _applied(sessions, log, model_id, 1, ForwardLogprobsOp(data))
    (call,) = log.calls_since(model_id, 0) or []
    assert isinstance(call.op, RejectedOp) and call.op.error.code == "FAILED_PRECONDITION"


def test_released_at_the_step_after_a_checkpoint(
    sessions: sessionmaker[Session], model_id: str
) -> None:
    log = ReplayLog(sessions, 1 << 20)
    for seq in (1, 2):
        _applied(sessions, log, model_id, seq, _fb(4))
    with sessions() as s:
        ckpt = _checkpoint(s, s.get(Model, model_id), "s2", seq_id=2)  # type: ignore[arg-type]
        q.update_model_progress(s, model_id, last_checkpoint=ckpt)
        s.commit()
    _applied(sessions, log, model_id, 3, OptimStepOp(AdamConfig()))
    assert log.calls_since(model_id, 0) is None  # 1 and 2 are gone: not from 0 any more
    assert [c.seq_id for c in log.calls_since(model_id, 2) or []] == [3]


def test_over_its_bound_the_log_is_dropped_until_the_next_checkpoint(
    sessions: sessionmaker[Session], model_id: str
) -> None:
    log = ReplayLog(sessions, 3000)
    _applied(sessions, log, model_id, 1, _fb(10))
    assert log.calls_since(model_id, 0) is not None
    _applied(sessions, log, model_id, 2, _fb(400))  # ~5 kB: over
    assert log.calls_since(model_id, 0) is None
    _applied(sessions, log, model_id, 3, _fb(10))  # not kept either
    assert log.calls_since(model_id, 0) is None


def test_a_call_applied_without_its_payload_cannot_be_replayed(
    sessions: sessionmaker[Session], model_id: str
) -> None:
    log = ReplayLog(sessions, 1 << 20)
    _applied(sessions, log, model_id, 1, _fb(4))
    _applied(sessions, ReplayLog(sessions, 0), model_id, 2, _fb(4))  # a server with the log off
    assert log.calls_since(model_id, 0) is None
