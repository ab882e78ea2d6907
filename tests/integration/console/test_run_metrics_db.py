"""The run-metrics queries on both databases: a call's metrics are written once
(a retry's second write is ignored), a re-logged metric replaces its value, and
the per-step series puts each forward_backward at the step of the next optim_step."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from sqlalchemy import Engine

from treadle.common.db.engine import make_engine
from treadle.server.db.run_metrics import (
    CallMetrics,
    log_metrics,
    logged_series,
    step_series,
    write_call_metrics,
)
from treadle.server.db.session import upgrade_to_head


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def engine(request: pytest.FixtureRequest, tmp_path: object) -> Iterator[Engine]:
    if request.param == "sqlite":
        url = f"sqlite:///{request.getfixturevalue('tmp_path') / 'm.db'}"
    else:
        url = request.getfixturevalue("postgres_url")
    eng = make_engine(url)
    upgrade_to_head(eng)
    yield eng
    eng.dispose()


def _fb(seq: int, loss: float, ntok: float, ent: float) -> CallMetrics:
    return CallMetrics(
        "m-1",
        seq,
        "forward_backward",
        None,
        {"loss:sum": loss, "ntokens:sum": ntok, "entropy:mean": ent, "ratio:max": ent},
    )


def test_series_writes_once_and_merges_per_step(engine: Engine) -> None:
    calls = [
        _fb(1, 3.0, 2.0, 1.0),
        _fb(2, 5.0, 6.0, 3.0),
        CallMetrics("m-1", 3, "optim_step", 1, {"grad_norm:value": 0.5}),
        _fb(4, 2.0, 4.0, 2.0),
        CallMetrics("m-1", 5, "sync_weights", None, {"ignored:value": 1.0}),
        CallMetrics("m-1", 6, "optim_step", 2, {"grad_norm:value": 0.25}),
        _fb(7, 9.0, 1.0, 9.0),  # a step in progress: not drawn
        CallMetrics("m-2", 1, "optim_step", 1, {"grad_norm:value": 7.0}),  # another run
    ]
    with engine.begin() as conn:
        written = write_call_metrics(conn, calls)
        assert written == 4 * 4 + 3 + 1
        assert write_call_metrics(conn, calls[:3]) == 0  # a retry writes nothing again
        assert write_call_metrics(conn, [*calls[:1], _fb(8, 1.0, 1.0, float("nan"))]) == 2  # no NaN
    with engine.connect() as conn:
        series = step_series(conn, "m-1")
    assert series["loss:sum"] == [(1, 8.0), (2, 2.0)]
    assert series["entropy:mean"] == [(1, pytest.approx((2 * 1.0 + 6 * 3.0) / 8)), (2, 2.0)]
    assert series["ratio:max"] == [(1, 3.0), (2, 2.0)]
    assert series["grad_norm:value"] == [(1, 0.5), (2, 0.25)]


def test_logging_a_step_again_replaces_its_values(engine: Engine) -> None:
    with engine.begin() as conn:
        log_metrics(conn, "m-1", 2, {"reward": 0.5, "acc": 0.1})
        log_metrics(conn, "m-1", 1, {"reward": 0.25})
        log_metrics(conn, "m-1", 2, {"reward": 0.75})
        log_metrics(conn, "m-2", 1, {"reward": 9.0})
    with engine.connect() as conn:
        series = logged_series(conn, "m-1")
    assert series == {"reward": [(1, 0.25), (2, 0.75)], "acc": [(2, 0.1)]}
