"""The ops log's insert-if-new tells a new call from a repeat on both backends (on
PostgreSQL it once read every call as a repeat: none was admitted against the
tenant's quota of calls in flight)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import Engine

from treadle.server.db import make_engine, make_session_factory, ops_log, upgrade_to_head
from treadle.server.db import queries as q


@pytest.fixture(params=["sqlite", "postgresql"])
def engine(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Engine]:
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'treadle.db'}"
        e = make_engine(url)
        upgrade_to_head(e)
        yield e
        e.dispose()
        return
    url = request.getfixturevalue("postgres_url")
    e = make_engine(url)
    upgrade_to_head(e)
    yield e
    e.dispose()


def test_insert_op_if_new_tells_a_new_call_from_a_repeat(engine: Engine) -> None:
    with make_session_factory(engine)() as s:
        tenant = q.ensure_tenant(s, "alice")
        model = q.create_model(
            s,
            tenant_id=tenant.id,
            base_model="tiny",
            lora_rank=4,
            lora_alpha=4.0,
            seed=0,
            dtype="float32",
        )
        s.commit()
        model_id = model.id
    with engine.begin() as conn:
        assert ops_log.insert_op_if_new(conn, model_id, 1, "forward_backward", "sha256:aa")
        assert ops_log.insert_op_if_new(conn, model_id, 2, "forward_backward", "sha256:bb")
        assert not ops_log.insert_op_if_new(conn, model_id, 1, "forward_backward", "sha256:aa")
