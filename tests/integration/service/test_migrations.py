"""The migrations build the schema the models describe, and undo it, on both backends."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Engine, inspect, text
from sqlalchemy.exc import IntegrityError

from treadle.common.db import workers as wq
from treadle.common.db.models import Base
from treadle.errors import InvalidArgumentError
from treadle.server.db import (
    downgrade,
    make_engine,
    make_session_factory,
    ops_log,
    run_metrics,
    tenancy,
    upgrade_to_head,
)
from treadle.server.db import queries as q
from treadle.server.db import session_queries as sq
from treadle.server.db.session import alembic_config

TABLES = {
    "tenants",
    "api_keys",
    "models",
    "checkpoints",
    "weight_versions",
    "samplers",
    "ops",
    "usage",
    "sessions",
    "workers",
    "step_metrics",
    "logged_metrics",
}


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'treadle.db'}"


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def engine(request: pytest.FixtureRequest) -> Iterator[Engine]:
    url = request.getfixturevalue(f"{request.param}_url")
    engine = make_engine(url)
    yield engine
    engine.dispose()


def _fill_every_table(engine: Engine) -> None:
    with make_session_factory(engine)() as s:
        tenant = q.ensure_tenant(s, "alice")
        q.create_api_key(s, tenant.id, key_hash="ab" * 32, prefix="tdl_ab12")
        model = q.create_model(
            s,
            tenant_id=tenant.id,
            base_model="tiny-llama",
            lora_rank=8,
            lora_alpha=16.0,
            seed=0,
            dtype="float32",
        )
        model.session_id = sq.create_session(s, tenant.id, "treadle-sdk/test").id
        ckpt = q.add_checkpoint(
            s,
            tenant_id=tenant.id,
            model_id=model.id,
            name="step1",
            uri=f"treadle://{model.id}/state/step1",
            storage_path="/ckpt/step1",
            seq_id=3,
            step=1,
            kind="state",
            size_bytes=2**40,
        )
        q.update_model_progress(s, model.id, version=1, last_checkpoint=ckpt)
        q.add_weight_version(s, model.id, 1, f"treadle://{model.id}/v/1")
        q.create_sampler(
            s, tenant_id=tenant.id, base_model="tiny-llama", mode="latest", model_id=model.id
        )
        ops_log.record_op(s, model.id, 1, "OPTIM_STEP", "sha256:aa")
        ops_log.finish_op(s, model.id, 1, "done")
        tenancy.set_quota(s, tenant, max_models=3, tokens_per_minute=2**40)
        delta = tenancy.UsageDelta(tokens_sampled=2**40, tokens_trained=5, calls=2, compute_s=0.5)
        tenancy.add_usage(s, tenant.id, model.id, "tiny-llama", delta)
        tenancy.add_usage(s, tenant.id, "", "tiny-llama", delta)
        wq.register_worker(s, "w-1", hostname="gpu-1", base_models=["tiny-llama"], capacity=8)
        wq.place_model(s, model.id, "w-1")
        s.commit()
    with engine.begin() as conn:
        run_metrics.write_call_metrics(
            conn, [run_metrics.CallMetrics(model.id, 1, "optim_step", 1, {"grad_norm:value": 2.0})]
        )
        run_metrics.log_metrics(conn, model.id, 1, {"reward": 0.5})


def _schema_diffs(engine: Engine) -> list[object]:
    with engine.connect() as conn:
        context = MigrationContext.configure(conn, opts={"compare_type": True})
        return list(compare_metadata(context, Base.metadata))


def test_single_head() -> None:
    assert len(ScriptDirectory.from_config(alembic_config()).get_heads()) == 1


def test_upgrade_fill_downgrade_upgrade(engine: Engine) -> None:
    upgrade_to_head(engine)
    upgrade_to_head(engine)  # already at head: a no-op
    assert set(inspect(engine).get_table_names()) >= TABLES
    _fill_every_table(engine)

    downgrade(engine, "base")
    assert set(inspect(engine).get_table_names()) <= {"alembic_version"}

    upgrade_to_head(engine)
    _fill_every_table(engine)
    assert _schema_diffs(engine) == []


def test_models_match_migrated_schema(engine: Engine) -> None:
    upgrade_to_head(engine)
    assert _schema_diffs(engine) == []


def test_constraints_survive_sqlite_batch_rebuild(sqlite_url: str) -> None:
    """0001 rebuilds `models` on SQLite to add the cyclic foreign key; its CHECK
    constraint and foreign-key enforcement must come through."""
    engine = make_engine(sqlite_url)
    upgrade_to_head(engine)
    with engine.connect() as conn:
        assert conn.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1
        with pytest.raises(IntegrityError):  # no such tenant
            conn.execute(
                text(
                    "INSERT INTO models (id, tenant_id, base_model, lora_rank, lora_alpha, seed,"
                    " dtype, status, created_at, updated_at) VALUES ('m-1', 't-none', 'b', 0,"
                    " 1.0, 0, 'float32', 'active', '2026-01-01', '2026-01-01')"
                )
            )
        conn.rollback()
    with make_session_factory(engine)() as s:
        tenant = q.ensure_tenant(s, "alice")
        model = q.create_model(
            s, tenant_id=tenant.id, base_model="b", lora_rank=0, lora_alpha=1.0, seed=0, dtype="f"
        )
        model.status = "bogus"
        with pytest.raises(IntegrityError):
            s.flush()
    engine.dispose()


@pytest.mark.parametrize(
    ("url", "hint"),
    [
        ("not a url", "cannot parse"),
        ("postgresql://postgres@127.0.0.1:5432/test", "postgresql+psycopg://"),
        ("postgres://postgres@127.0.0.1:5432/test", "postgresql+psycopg://"),
        ("postgresql+psycopg2://postgres@127.0.0.1:5432/test", "postgresql+psycopg://"),
        ("mysql://root@localhost/treadle", "unsupported database"),
    ],
)
def test_bad_url_is_invalid_argument(url: str, hint: str) -> None:
    with pytest.raises(InvalidArgumentError, match="database_url") as info:
        make_engine(url)
    assert hint in str(info.value)
    with pytest.raises(InvalidArgumentError):
        upgrade_to_head(url)


def test_worker_draining_status_and_its_downgrade(engine: Engine) -> None:
    """0005 admits ``draining``; going back to 0004 calls a draining worker stopped,
    and the older constraint refuses ``draining`` again."""
    upgrade_to_head(engine)
    sessions = make_session_factory(engine)
    with sessions() as s:
        wq.register_worker(s, "w-1", hostname="gpu-1", base_models=["b"], capacity=1)
        wq.set_worker_status(s, "w-1", "draining")
        s.commit()
    downgrade(engine, "0004")
    with engine.connect() as conn:
        assert conn.execute(text("SELECT status FROM workers")).scalar() == "stopped"
        with pytest.raises(IntegrityError):
            conn.execute(text("UPDATE workers SET status = 'draining'"))
        conn.rollback()
    upgrade_to_head(engine)
    with sessions() as s:
        wq.set_worker_status(s, "w-1", "draining")
        s.commit()
