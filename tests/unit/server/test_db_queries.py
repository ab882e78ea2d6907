"""Query functions on a SQLite file whose schema comes from the migrations."""

from __future__ import annotations

import datetime as dt

import pytest
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from treadle.common.db.models import Model
from treadle.errors import AlreadyExistsError
from treadle.server.db import ops_log
from treadle.server.db import queries as q
from treadle.server.db import session_queries as sq


def _model(s: Session, tenant_id: str) -> Model:
    return q.create_model(
        s,
        tenant_id=tenant_id,
        base_model="tiny-llama",
        lora_rank=8,
        lora_alpha=16.0,
        seed=0,
        dtype="float32",
    )


def _checkpoint(s: Session, model: Model, name: str, seq_id: int = 1):
    return q.add_checkpoint(
        s,
        tenant_id=model.tenant_id,
        model_id=model.id,
        name=name,
        uri=f"treadle://{model.id}/state/{name}",
        storage_path=f"/ckpt/{model.id}/{name}",
        seq_id=seq_id,
        step=seq_id,
        kind="state",
        size_bytes=5 * 2**30,  # over 2**31: needs the BIGINT column
    )


def test_ensure_tenant_is_idempotent_and_keys_find_it(session: Session) -> None:
    alice = q.ensure_tenant(session, "alice")
    assert q.ensure_tenant(session, "alice").id == alice.id
    key = q.create_api_key(session, alice.id, key_hash="ab" * 32, prefix="tdl_ab12")
    assert q.find_tenant_by_key_hash(session, "ab" * 32) == alice
    assert q.find_tenant_by_key_hash(session, "cd" * 32) is None
    key.revoked_at = dt.datetime.now(dt.timezone.utc)
    assert q.find_tenant_by_key_hash(session, "ab" * 32) is None


def test_another_tenants_model_is_not_found(session: Session) -> None:
    alice, bob = q.ensure_tenant(session, "alice"), q.ensure_tenant(session, "bob")
    model = _model(session, alice.id)
    assert model.id.startswith("m-") and model.version == 0 and model.status == "active"
    assert q.get_model(session, alice.id, model.id) is model
    assert q.get_model(session, bob.id, model.id) is None
    assert q.list_models(session, bob.id) == []
    assert q.mark_model_deleted(session, bob.id, model.id) is None
    assert q.mark_model_deleted(session, alice.id, model.id) is model
    assert q.get_model(session, alice.id, model.id) is None
    assert q.list_models(session, alice.id) == []


def test_timestamps_come_back_utc_aware(session: Session) -> None:
    tenant = q.ensure_tenant(session, "alice")
    model = _model(session, tenant.id)
    session.commit()
    session.expire_all()
    reloaded = q.get_model(session, tenant.id, model.id)
    assert reloaded is not None
    assert reloaded.created_at.tzinfo == dt.timezone.utc


def test_checkpoints_unique_name_progress_and_tenant_filter(session: Session) -> None:
    alice, bob = q.ensure_tenant(session, "alice"), q.ensure_tenant(session, "bob")
    model = _model(session, alice.id)
    first = _checkpoint(session, model, "step1", seq_id=1)
    with pytest.raises(AlreadyExistsError):
        _checkpoint(session, model, "step1", seq_id=2)
    second = _checkpoint(session, model, "step2", seq_id=2)

    assert [c.name for c in q.list_checkpoints(session, alice.id, model.id)] == ["step1", "step2"]
    assert q.list_checkpoints(session, bob.id, model.id) == []
    assert q.get_checkpoint_by_uri(session, alice.id, first.uri) is first
    assert q.get_checkpoint_by_uri(session, bob.id, first.uri) is None

    q.update_model_progress(session, model.id, version=2, last_checkpoint=second)
    session.commit()
    session.expire_all()
    reloaded = q.get_model(session, alice.id, model.id)
    assert reloaded is not None
    assert (reloaded.version, reloaded.last_checkpoint_id) == (2, second.id)
    assert reloaded.last_checkpoint_seq_id == 2
    assert reloaded.last_checkpoint is not None and reloaded.last_checkpoint.size_bytes == 5 * 2**30


def test_the_database_enforces_unique_checkpoint_names(session: Session) -> None:
    tenant = q.ensure_tenant(session, "alice")
    model = _model(session, tenant.id)
    _checkpoint(session, model, "step1")
    # Bypass add_checkpoint's friendly check: the constraint is the backstop for races.
    from treadle.common.db.models import Checkpoint

    session.add(
        Checkpoint(
            id="c-dup",
            tenant_id=tenant.id,
            model_id=model.id,
            name="step1",
            uri="treadle://other",
            storage_path="/x",
            seq_id=1,
            step=1,
            kind="state",
            size_bytes=1,
        )
    )
    with pytest.raises(IntegrityError):
        session.flush()


def test_weight_versions_release_all_but_latest(session: Session) -> None:
    tenant = q.ensure_tenant(session, "alice")
    model = _model(session, tenant.id)
    for v in range(1, 6):
        q.add_weight_version(session, model.id, v, f"treadle://{model.id}/v/{v}")
    assert [w.version for w in q.release_weight_versions(session, model.id, keep_latest=2)] == [
        3,
        2,
        1,
    ]
    assert q.release_weight_versions(session, model.id, keep_latest=2) == []


def test_samplers_are_tenant_scoped(session: Session) -> None:
    alice, bob = q.ensure_tenant(session, "alice"), q.ensure_tenant(session, "bob")
    model = _model(session, alice.id)
    sampler = q.create_sampler(
        session, tenant_id=alice.id, base_model="tiny-llama", mode="latest", model_id=model.id
    )
    assert sampler.id.startswith("s-")
    assert q.get_sampler(session, alice.id, sampler.id) is sampler
    assert q.get_sampler(session, bob.id, sampler.id) is None


def test_ops_log(session: Session) -> None:
    tenant = q.ensure_tenant(session, "alice")
    model = _model(session, tenant.id)
    op = ops_log.record_op(session, model.id, 1, "FORWARD_BACKWARD", "sha256:aa")
    assert (op.status, op.finished_at, op.error_code) == ("pending", None, None)
    ops_log.record_op(session, model.id, 2, "OPTIM_STEP", "sha256:bb")
    done = ops_log.finish_op(session, model.id, 1, "done")
    failed = ops_log.finish_op(session, model.id, 2, "failed", error_code="UNAVAILABLE")
    assert done.status == "done" and done.finished_at is not None
    assert (failed.status, failed.error_code) == ("failed", "UNAVAILABLE")
    assert ops_log.get_op(session, model.id, 3) is None
    session.commit()
    session.expunge_all()
    with pytest.raises(IntegrityError):  # (model_id, seq_id) is recorded once
        ops_log.record_op(session, model.id, 1, "FORWARD_BACKWARD", "sha256:aa")


def test_a_call_failed_unavailable_and_applied_on_its_repeat_ends_done_once(
    session: Session,
) -> None:
    tenant = q.ensure_tenant(session, "alice")
    model = _model(session, tenant.id)
    session.commit()
    conn = session.connection()
    assert ops_log.insert_op_if_new(conn, model.id, 1, "forward_backward", "sha256:aa")
    assert ops_log.insert_op_if_new(conn, model.id, 2, "forward_backward", "sha256:bb")
    assert ops_log.finish_pending_op(conn, model.id, 1, "failed", "UNAVAILABLE")
    assert ops_log.finish_pending_op(conn, model.id, 2, "failed", "INVALID_ARGUMENT")
    # the repeat of 1 is not recorded again; applied, it ends the row, once
    assert not ops_log.insert_op_if_new(conn, model.id, 1, "forward_backward", "sha256:aa")
    assert not ops_log.finish_pending_op(conn, model.id, 1, "failed", "ABORTED", "sha256:aa")
    # another call numbered 1 again (after a resync) does not end it
    assert not ops_log.finish_pending_op(conn, model.id, 1, "done", None, "sha256:cc")
    assert ops_log.finish_pending_op(conn, model.id, 1, "done", None, "sha256:aa")
    assert not ops_log.finish_pending_op(conn, model.id, 1, "done", None, "sha256:aa")
    assert not ops_log.finish_pending_op(conn, model.id, 2, "done", None, "sha256:bb")  # final
    session.commit()
    session.expunge_all()
    assert ops_log.get_op(session, model.id, 1).status == "done"  # type: ignore[union-attr]
    assert ops_log.get_op(session, model.id, 2).status == "failed"  # type: ignore[union-attr]


def test_deleting_the_last_checkpoint_points_the_model_at_the_newest_remaining(
    session: Session,
) -> None:
    tenant = q.ensure_tenant(session, "alice")
    model = _model(session, tenant.id)
    first, second = _checkpoint(session, model, "a", 3), _checkpoint(session, model, "b", 7)
    q.update_model_progress(session, model.id, last_checkpoint=second)
    q.delete_checkpoint(session, first)  # not the last one: the model keeps pointing at b
    assert (model.last_checkpoint_id, model.last_checkpoint_seq_id) == (second.id, 7)
    third = _checkpoint(session, model, "c", 9)
    q.update_model_progress(session, model.id, last_checkpoint=third)
    q.delete_checkpoint(session, third)
    assert (model.last_checkpoint_id, model.last_checkpoint_seq_id) == (second.id, 7)
    q.delete_checkpoint(session, second)
    assert (model.last_checkpoint_id, model.last_checkpoint_seq_id) == (None, 0)
    assert q.list_checkpoints(session, tenant.id, model.id) == []


def test_model_status_sessions_and_checkpoint_flags_change_through_queries(
    session: Session,
) -> None:
    tenant = q.ensure_tenant(session, "alice")
    client = sq.create_session(session, tenant.id, "sdk")
    model = q.create_model(
        session,
        tenant_id=tenant.id,
        base_model="tiny-llama",
        lora_rank=8,
        lora_alpha=16.0,
        seed=0,
        dtype="float32",
        session_id=client.id,
    )
    assert model.session_id == client.id
    assert q.set_model_status(session, model.id, "unloaded", version=4) is model
    assert (model.status, model.version) == ("unloaded", 4)
    assert q.set_model_status(session, model.id, "active") is model
    assert (model.status, model.version) == ("active", 4)
    assert q.set_model_status(session, "m-missing", "lost") is None

    before = client.last_heartbeat_at
    sq.record_heartbeat(session, client)
    assert client.last_heartbeat_at >= before
    sq.end_session(session, client)
    ended = client.ended_at
    assert ended is not None
    sq.end_session(session, client)  # ended once: the first end stays
    assert client.ended_at == ended

    ckpt = _checkpoint(session, model, "a")
    when = dt.datetime(2030, 1, 1, tzinfo=dt.timezone.utc)
    q.set_checkpoint_expiry(session, ckpt, when)
    q.set_checkpoint_public(session, ckpt, True)
    assert q.expired_checkpoints(session, when + dt.timedelta(seconds=1)) == [ckpt]
    assert q.get_public_checkpoint(session, ckpt.uri) is ckpt
    q.set_checkpoint_expiry(session, ckpt, None)
    assert q.expired_checkpoints(session, when + dt.timedelta(seconds=1)) == []


def test_record_version_writes_the_step_in_one_statement_and_knows_no_missing_model(
    session: Session,
) -> None:
    from treadle.errors import NotFoundError

    model = _model(session, q.ensure_tenant(session, "alice").id)
    session.commit()
    q.record_version(session.connection(), model.id, 7)
    session.commit()
    session.expire_all()
    row = session.get(Model, model.id)
    assert row is not None and row.version == 7
    with pytest.raises(NotFoundError, match="no model"):
        q.record_version(session.connection(), "m-missing", 1)


@pytest.fixture(params=["sqlite", "postgresql"])
def any_db(request: pytest.FixtureRequest) -> Session:
    """``session`` (SQLite), and the same schema on the test PostgreSQL."""
    if request.param == "sqlite":
        return request.getfixturevalue("session")
    from treadle.server.db import make_engine, make_session_factory, upgrade_to_head

    engine = make_engine(request.getfixturevalue("postgres_url"))
    upgrade_to_head(engine)
    s = make_session_factory(engine)()
    request.addfinalizer(engine.dispose)
    request.addfinalizer(s.close)
    return s


def test_session_search_pages_through_batches_ties_and_metadata(
    any_db: Session, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pages follow (created_at, id) newest first, ties included, with the metadata
    filtered after SQL across several read batches: every match once, in order,
    never another tenant's (on SQLite and PostgreSQL)."""
    import contextlib
    import types

    from treadle.server.service import sessions as service
    from treadle.server.service.types import SessionQuery

    session = any_db

    monkeypatch.setattr(service, "_BATCH", 2)
    alice, bob = q.ensure_tenant(session, "alice"), q.ensure_tenant(session, "bob")
    same = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)
    rows = []
    for i in range(7):
        row = sq.create_session(session, alice.id, user_metadata={"k": "x" if i % 2 else "y"})
        row.created_at = same if i < 4 else same + dt.timedelta(seconds=i)
        rows.append(row)
    sq.create_session(session, bob.id, user_metadata={"k": "x"})
    session.flush()
    want = sorted(
        (r for r in rows if r.user_metadata == {"k": "x"}),
        key=lambda r: (r.created_at, r.id),
        reverse=True,
    )
    ctx = types.SimpleNamespace(session=lambda: contextlib.nullcontext(session))
    svc = service.SessionService(ctx)  # type: ignore[arg-type]
    for limit in (1, 2, 3):
        got, after = [], None
        for _ in range(5):
            query = SessionQuery(user_metadata=(("k", "x"),), limit=limit, after=after)
            page = svc.search(alice.id, query)
            got += [s.session_id for s in page.sessions]
            after = page.next_after
            if after is None:
                break
        assert got == [r.id for r in want] and len(got) == 3, limit
    sq.end_session(session, rows[1], "errored", "boom")
    sq.end_session(session, rows[1], "success")  # the first end stays
    ended = svc.search(alice.id, SessionQuery(statuses=frozenset({"errored"})))
    assert [(s.session_id, s.finish_reason, s.finish_detail) for s in ended.sessions] == [
        (rows[1].id, "errored", "boom")
    ]
    assert svc.search(alice.id, SessionQuery(statuses=frozenset())).sessions == ()
    with pytest.raises(Exception, match="limit"):
        svc.search(alice.id, SessionQuery(limit=201))
