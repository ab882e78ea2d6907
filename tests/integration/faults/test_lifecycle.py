"""What a shared service does over time: client sessions and heartbeats, idle
models unloaded after their TTL and brought back transparently, checkpoints
deleted (behind the tenant wall)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

import treadle
from tests.conftest import make_server
from tests.helpers import char_ids, next_token_datum
from treadle.common.db import models as db
from treadle.errors import FailedPreconditionError, NotFoundError
from treadle.server.db import queries
from treadle.server.embedded import EmbeddedServer
from treadle.v1 import session_pb2

TTL_S = 1.0
ADAM = treadle.AdamParams(learning_rate=1e-2)


def _datum(text: str = "12+3=15") -> treadle.Datum:
    return next_token_datum([1, *char_ids(text), 2])


def _wait_for(predicate: Callable[[], bool], timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.05)


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[EmbeddedServer]:
    server = make_server(
        tmp_path_factory.mktemp("lifecycle"),
        {"tiny": tiny_model_dir},
        model_ttl_s=TTL_S,
        ttl_sweep_s=0.1,
        heartbeat_interval_s=0.2,
    )
    yield server
    server.stop()


def _client(srv: EmbeddedServer, **kwargs: object) -> treadle.ServiceClient:
    return treadle.ServiceClient(srv.address, api_key=getattr(srv, "api_key", None), **kwargs)  # type: ignore[arg-type]


@pytest.fixture
def client(srv: EmbeddedServer) -> Iterator[treadle.ServiceClient]:
    """No session: only calls keep its models loaded."""
    with _client(srv, session=False) as c:
        yield c


def _loaded(srv: EmbeddedServer, model_id: str) -> bool:
    return model_id in srv.ctx.dispatcher.engine.models  # type: ignore[union-attr, attr-defined]


def _status(srv: EmbeddedServer, model_id: str) -> str:
    with srv.ctx.sessions() as s:  # type: ignore[union-attr]
        row = s.get(db.Model, model_id)
        assert row is not None
        return row.status


# ---- sessions ----------------------------------------------------------------------------


def test_session_heartbeats_keep_models_loaded(srv: EmbeddedServer) -> None:
    c = _client(srv)
    tc = c.create_lora_training_client("tiny", rank=2)
    session_id = c.session_id
    assert session_id and tc.get_info().session_id == session_id
    tc.forward_backward([_datum()]).result()
    tc.optim_step(ADAM).result()

    time.sleep(3 * TTL_S)  # no calls, but heartbeats every 0.2 s
    assert _loaded(srv, tc.model_id) and tc.get_info().status == "active"
    assert c._session is not None and c._session.beats >= 5
    with srv.ctx.sessions() as s:  # type: ignore[union-attr]
        row = s.get(db.ClientSession, session_id)
        assert row is not None and row.ended_at is None
        assert time.time() - row.last_heartbeat_at.timestamp() < 1.0

    c.close()  # ends the session: now only the TTL counts
    with srv.ctx.sessions() as s:  # type: ignore[union-attr]
        row = s.get(db.ClientSession, session_id)
        assert row is not None and row.ended_at is not None
    _wait_for(lambda: _status(srv, tc.model_id) == "unloaded")


def test_session_rpcs_reject_unknown_and_ended_sessions(srv: EmbeddedServer) -> None:
    with _client(srv, heartbeat_s=60) as c:
        stub, caller = c._session._stub, c._caller  # type: ignore[union-attr]
        with pytest.raises(NotFoundError):
            caller.call(
                stub.Heartbeat, session_pb2.HeartbeatRequest(session_id="sess-nope"), lambda r: r
            ).result()
        session_id = c.session_id
        assert session_id
        caller.call(
            stub.EndSession, session_pb2.EndSessionRequest(session_id=session_id), lambda r: r
        ).result()
        with pytest.raises(NotFoundError, match="session_id"):
            c.create_lora_training_client("tiny", rank=2)  # created in an ended session
        with pytest.raises(NotFoundError):
            caller.call(
                stub.Heartbeat, session_pb2.HeartbeatRequest(session_id=session_id), lambda r: r
            ).result()


# ---- TTL unload and restore ------------------------------------------------------------------


def test_idle_model_unloads_and_comes_back_on_its_next_call(
    srv: EmbeddedServer, client: treadle.ServiceClient
) -> None:
    tc = client.create_lora_training_client("tiny", rank=4, seed=7)
    datum = _datum()
    for _ in range(2):
        tc.forward_backward([datum])
        tc.optim_step(ADAM)
    before = tc.forward_logprobs([datum]).result().loss_fn_outputs[0].logprobs  # seq 5

    _wait_for(lambda: _status(srv, tc.model_id) == "unloaded")
    assert not _loaded(srv, tc.model_id)
    info = tc.get_info()
    assert (info.status, info.version, info.next_seq_id) == ("unloaded", 2, 6)
    auto = [c for c in tc.list_checkpoints() if c.name == "auto"]
    assert len(auto) == 1 and auto[0].seq_id == 5 and auto[0].step == 2

    # The next call restores it, at the same seq_id, with the same weights.
    again = tc.forward_logprobs([datum]).result().loss_fn_outputs[0].logprobs  # seq 6
    np.testing.assert_array_equal(again, before)
    assert _loaded(srv, tc.model_id) and tc.get_info().status == "active"
    tc.forward_backward([datum])
    assert tc.optim_step(ADAM).result().step == 3  # optimizer state came back too

    _wait_for(lambda: _status(srv, tc.model_id) == "unloaded")
    info = tc.restore()  # the explicit way back
    assert (info.status, info.version, info.next_seq_id) == ("active", 3, 9)
    sampler = tc.sync_weights()
    out = sampler.sample(datum.model_input, 1, treadle.SamplingParams(max_tokens=3, seed=0))
    assert len(out.result().sequences[0].tokens) == 3


def test_sampling_a_model_restores_it(srv: EmbeddedServer, client: treadle.ServiceClient) -> None:
    tc = client.create_lora_training_client("tiny", rank=2)
    sampler = tc.sync_weights()
    sampler.sample(_datum().model_input, 1, treadle.SamplingParams(max_tokens=2)).result()
    _wait_for(lambda: _status(srv, tc.model_id) == "unloaded")
    out = sampler.sample(_datum().model_input, 2, treadle.SamplingParams(max_tokens=2, seed=1))
    assert len(out.result().sequences) == 2
    assert _loaded(srv, tc.model_id)


def test_pending_gradients_keep_a_model_loaded(
    srv: EmbeddedServer, client: treadle.ServiceClient
) -> None:
    tc = client.create_lora_training_client("tiny", rank=2)
    tc.forward_backward([_datum()]).result()  # a step half done: a checkpoint cannot hold it
    time.sleep(3 * TTL_S)
    assert _loaded(srv, tc.model_id) and _status(srv, tc.model_id) == "active"
    assert tc.optim_step(ADAM).result().step == 1
    _wait_for(lambda: _status(srv, tc.model_id) == "unloaded")


def test_unloaded_model_can_be_deleted_and_is_walled(
    srv: EmbeddedServer, client: treadle.ServiceClient
) -> None:
    tc = client.create_lora_training_client("tiny", rank=2)
    _wait_for(lambda: _status(srv, tc.model_id) == "unloaded")
    path = f"treadle://{tc.model_id}/state/auto"
    with pytest.raises(FailedPreconditionError, match="unloaded"):
        client.delete_checkpoint(path)  # it is what brings the model back
    client.delete_model(tc.model_id)
    with pytest.raises(NotFoundError):
        tc.get_info()
    with pytest.raises(NotFoundError):
        tc.forward_logprobs([_datum()]).result()
    assert not _loaded(srv, tc.model_id)


def test_unloaded_model_survives_a_restart(tmp_path: Path, tiny_model_dir: Path) -> None:
    kwargs = {"model_ttl_s": TTL_S, "ttl_sweep_s": 0.1}
    first = make_server(tmp_path, {"tiny": tiny_model_dir}, **kwargs)  # type: ignore[arg-type]
    try:
        with _client(first, session=False) as c:
            tc = c.create_lora_training_client("tiny", rank=2)
            tc.forward_backward([_datum()])
            tc.optim_step(ADAM).result()
            model_id = tc.model_id
            _wait_for(lambda: _status(first, model_id) == "unloaded")
    finally:
        first.stop()
    second = make_server(tmp_path, {"tiny": tiny_model_dir}, model_ttl_s=0)
    try:
        assert not _loaded(second, model_id)  # stays unloaded until used
        with _client(second, session=False) as c:
            tc = c.get_training_client(model_id)
            assert tc.get_info().status == "unloaded"
            tc.forward_backward([_datum()])
            assert tc.optim_step(ADAM).result().step == 2
    finally:
        second.stop()


# ---- deleting checkpoints ------------------------------------------------------------------


def test_delete_checkpoint_removes_row_and_files(
    srv: EmbeddedServer, client: treadle.ServiceClient
) -> None:
    tc = client.create_lora_training_client("tiny", rank=2)
    tc.forward_backward([_datum()])
    tc.optim_step(ADAM)
    a = tc.save_state("a").result()
    tc.forward_backward([_datum()])
    tc.optim_step(ADAM)
    b = tc.save_state("b").result()
    with srv.ctx.sessions() as s:  # type: ignore[union-attr]
        tenant = s.get(db.Model, tc.model_id).tenant_id  # type: ignore[union-attr]
        dirs = {
            c.uri: Path(c.storage_path) for c in queries.list_checkpoints(s, tenant, tc.model_id)
        }
    assert dirs[b.path].is_dir() and dirs[a.path].is_dir()

    tc.delete_checkpoint(b.path)
    assert not dirs[b.path].exists() and dirs[a.path].is_dir()
    assert [c.path for c in tc.list_checkpoints()] == [a.path]
    # A restart would bring the model back at the newest checkpoint left.
    with srv.ctx.sessions() as s:  # type: ignore[union-attr]
        row = s.get(db.Model, tc.model_id)
        assert row is not None and row.last_checkpoint_seq_id == a.seq_id
    with pytest.raises(NotFoundError):
        tc.delete_checkpoint(b.path)  # already gone
    with pytest.raises(NotFoundError):
        tc.load_state(b.path).result()
    client.delete_checkpoint(a.path)  # the ServiceClient way
    assert tc.list_checkpoints() == [] and not dirs[a.path].exists()


def test_delete_checkpoint_of_another_tenant_is_not_found(
    srv: EmbeddedServer, client: treadle.ServiceClient, tmp_path: Path
) -> None:
    """Another tenant's checkpoint answers exactly like one that does not exist, and
    stays where it is."""
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "weights.safetensors").write_bytes(b"x")
    with srv.ctx.sessions() as s:  # type: ignore[union-attr]
        other = queries.ensure_tenant(s, "lifecycle-other-tenant")
        model = queries.create_model(
            s,
            tenant_id=other.id,
            base_model="tiny",
            lora_rank=2,
            lora_alpha=2.0,
            seed=0,
            dtype="float32",
        )
        uri = f"treadle://{model.id}/state/mine"
        queries.add_checkpoint(
            s,
            tenant_id=other.id,
            model_id=model.id,
            name="mine",
            uri=uri,
            storage_path=str(theirs),
            seq_id=1,
            step=1,
            kind="state",
            size_bytes=1,
        )
        s.commit()
    with pytest.raises(NotFoundError) as theirs_err:
        client.delete_checkpoint(uri)
    with pytest.raises(NotFoundError) as missing_err:
        client.delete_checkpoint(f"treadle://{model.id}/state/never")
    assert str(theirs_err.value).replace(uri, "?") == str(missing_err.value).replace(
        f"treadle://{model.id}/state/never", "?"
    )
    assert (theirs / "weights.safetensors").exists()
    with srv.ctx.sessions() as s:  # type: ignore[union-attr]
        assert queries.get_checkpoint_by_uri(s, other.id, uri) is not None


def test_unload_and_restore_through_an_s3_store(tmp_path: Path, tiny_model_dir: Path) -> None:
    """With checkpoints in S3 the unload's checkpoint goes to the bucket and the
    restore comes back from it; delete_checkpoint removes its objects."""
    import boto3

    from tests.integration.services import moto_s3

    with moto_s3("lifecycle") as endpoint:
        srv = make_server(
            tmp_path,
            {"tiny": tiny_model_dir},
            model_ttl_s=TTL_S,
            ttl_sweep_s=0.1,
            store="s3://lifecycle/ckpt",
            s3_endpoint_url=endpoint,
        )
        try:
            with _client(srv, session=False) as c:
                tc = c.create_lora_training_client("tiny", rank=2)
                tc.forward_backward([_datum()])
                tc.optim_step(ADAM)
                before = tc.forward_logprobs([_datum()]).result().loss_fn_outputs[0].logprobs
                _wait_for(lambda: _status(srv, tc.model_id) == "unloaded")
                s3 = boto3.client("s3", endpoint_url=endpoint)

                def keys() -> list[str]:
                    listed = s3.list_objects_v2(Bucket="lifecycle", Prefix="ckpt/")
                    return [o["Key"] for o in listed.get("Contents", [])]

                assert any(k.endswith(f"{tc.model_id}/auto/manifest.json") for k in keys())
                after = tc.forward_logprobs([_datum()]).result().loss_fn_outputs[0].logprobs
                np.testing.assert_array_equal(after, before)
                assert tc.optim_step(ADAM).result().step == 2
                path = f"treadle://{tc.model_id}/state/auto"
                tc.delete_checkpoint(path)  # loaded again, so the auto checkpoint may go
                assert not any(f"{tc.model_id}/auto/" in k for k in keys())
        finally:
            srv.stop()
