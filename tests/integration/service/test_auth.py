"""API keys: no key, a wrong key or a revoked key is UNAUTHENTICATED on every RPC;
health and reflection stay open; the embedded server's default key; the admin CLI
against SQLite and PostgreSQL."""

from __future__ import annotations

import json
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from sqlalchemy import text

import treadle
from tests.integration.rpc_walk import all_methods, call_raw, request_class
from treadle import _convert
from treadle.errors import InvalidArgumentError, UnauthenticatedError
from treadle.server import cli
from treadle.server.auth import Authenticator, generate_key, hash_key
from treadle.server.config import ServerConfig
from treadle.server.db import make_engine, make_session_factory, queries, upgrade_to_head
from treadle.server.embedded import EmbeddedServer
from treadle.v1 import sampling_pb2, server_pb2


def _server(data_dir: Path, model_dir: Path, **overrides: Any) -> EmbeddedServer:
    config = ServerConfig(
        data_dir=data_dir, models={"tiny": model_dir}, port=0, threads=1, **overrides
    )
    return EmbeddedServer(config).start()


@pytest.fixture(scope="module")
def server(
    tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path
) -> Iterator[EmbeddedServer]:
    srv = _server(tmp_path_factory.mktemp("auth") / "data", tiny_model_dir, auth_cache_s=0)
    yield srv
    srv.stop()


def admin(args: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert cli.main(["admin", *args]) == 0
    return capsys.readouterr().out


def _db_args(srv: EmbeddedServer) -> list[str]:
    c = srv.config
    return ["--database-url", c.database_url] if c.database_url else ["--data-dir", str(c.data_dir)]


def test_every_rpc_wants_a_key(server: EmbeddedServer) -> None:
    """Walks every method of every treadle service: one added later is covered too."""
    methods = all_methods()
    assert len(methods) >= 15
    with grpc.insecure_channel(server.address) as channel:
        for method in methods:
            for metadata in ((), (("authorization", f"Bearer {generate_key()}"),)):
                code, details, _ = call_raw(channel, method, request_class(method)(), metadata)
                assert code == grpc.StatusCode.UNAUTHENTICATED, (method.full_name, code, details)


def test_no_key_wrong_key_malformed_header(
    server: EmbeddedServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("TREADLE_API_KEY", raising=False)
    with (
        treadle.ServiceClient(server.address) as client,
        pytest.raises(UnauthenticatedError, match="no API key"),
    ):
        client.get_server_info()
    for key in (generate_key(), "not-a-key"):
        with (
            treadle.ServiceClient(server.address, api_key=key) as client,
            pytest.raises(UnauthenticatedError, match="not valid"),
        ):
            client.list_models()
    with grpc.insecure_channel(server.address) as channel:
        stub = channel.unary_unary(
            "/treadle.v1.ServerService/GetServerInfo",
            request_serializer=server_pb2.GetServerInfoRequest.SerializeToString,
            response_deserializer=server_pb2.ServerInfo.FromString,
        )
        for header in (f"Basic {server.api_key}", "Bearer", f"{server.api_key}"):
            with pytest.raises(grpc.RpcError) as info:
                stub(server_pb2.GetServerInfoRequest(), metadata=(("authorization", header),))
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        stub(
            server_pb2.GetServerInfoRequest(),
            metadata=(("authorization", f"bearer {server.api_key}"),),
        )


def test_health_and_reflection_stay_open(server: EmbeddedServer) -> None:
    with grpc.insecure_channel(server.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        reply = health.Check(health_pb2.HealthCheckRequest(service=""))
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        replies = list(
            stub.ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")])
            )
        )
        names = {s.name for s in replies[0].list_services_response.service}
        assert "treadle.v1.TrainingService" in names


def test_health_watch_streams_the_status(server: EmbeddedServer) -> None:
    """Watch (a streaming RPC whose handler writes with ``context.write`` and returns
    nothing) goes through every interceptor: its first answer is the status."""
    with grpc.insecure_channel(server.address) as channel:
        watch = health_pb2_grpc.HealthStub(channel).Watch(
            health_pb2.HealthCheckRequest(service=""), timeout=30
        )
        first = next(watch)
        watch.cancel()
    assert first.status == health_pb2.HealthCheckResponse.SERVING


def test_default_key_file(server: EmbeddedServer) -> None:
    path = server.config.data_dir / "api_key"
    assert path.read_text().strip() == server.api_key
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert server.api_key is not None and len(server.api_key) >= 4 + 43  # 256 bits
    with treadle.ServiceClient(server.address, api_key=server.api_key) as client:
        assert client.get_server_info().base_models


def test_revoked_key_and_new_tenant_via_admin_cli(
    server: EmbeddedServer, capsys: pytest.CaptureFixture[str]
) -> None:
    db = _db_args(server)
    key = admin([*db, "create-tenant", "carol"], capsys).strip().splitlines()[-1]
    assert key.startswith("tdl-")
    with treadle.ServiceClient(server.address, api_key=key) as client:
        assert client.list_models() == []
        listing = admin([*db, "list-keys", "carol"], capsys)
        (key_id,) = [line.split()[0] for line in listing.splitlines() if line.startswith("k-")]
        assert key not in listing and key[:12] in listing  # only the prefix is shown
        second = admin([*db, "create-key", "carol"], capsys).strip()
        assert "revoked" in admin([*db, "revoke-key", key_id], capsys)
        with pytest.raises(UnauthenticatedError):  # auth_cache_s=0: at once
            client.list_models()
    with treadle.ServiceClient(server.address, api_key=second) as client:
        assert client.list_models() == []  # the tenant's other key still works
    assert cli.main(["admin", *db, "create-tenant", "carol"]) == 2  # exists
    assert cli.main(["admin", *db, "revoke-key", "k-nope"]) == 2


def test_keys_are_stored_hashed(server: EmbeddedServer) -> None:
    engine = make_engine(server.config.resolved_database_url)
    with engine.connect() as conn:
        rows = conn.execute(text("SELECT key_hash, prefix FROM api_keys")).all()
    engine.dispose()
    assert server.api_key is not None
    assert (hash_key(server.api_key), server.api_key[:12]) in [tuple(r) for r in rows]
    assert all(server.api_key not in (h, p) for h, p in rows)


def test_restart_keeps_the_key_and_revocation_sticks(
    tmp_path: Path, tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = tmp_path / "data"
    first = _server(data, tiny_model_dir, bootstrap_api_key=generate_key())
    key = first.api_key
    first.stop()
    again = _server(data, tiny_model_dir)
    assert again.api_key == key  # read back, not a second key
    again.stop()
    listing = admin(["--data-dir", str(data), "list-keys", "default"], capsys)
    (key_id,) = [line.split()[0] for line in listing.splitlines() if line.startswith("k-")]
    admin(["--data-dir", str(data), "revoke-key", key_id], capsys)
    third = _server(data, tiny_model_dir)
    try:
        assert third.api_key is None  # a revoked default key is not silently replaced
        with (
            treadle.ServiceClient(third.address, api_key=key) as client,
            pytest.raises(UnauthenticatedError),
        ):
            client.list_models()
    finally:
        third.stop()


def test_no_auth_is_loopback_only(tmp_path: Path, tiny_model_dir: Path) -> None:
    with pytest.raises(InvalidArgumentError, match="loopback"):
        ServerConfig(data_dir=tmp_path, auth=False, host="0.0.0.0")
    srv = _server(tmp_path / "data", tiny_model_dir, auth=False)
    try:
        assert srv.api_key is None
        with treadle.ServiceClient(srv.address, api_key="") as client:
            client.create_lora_training_client("tiny", rank=2)
            assert len(client.list_models()) == 1  # everyone is the default tenant
    finally:
        srv.stop()


def test_lookups_are_cached_for_cache_s(tmp_path: Path) -> None:
    engine = make_engine(f"sqlite:///{tmp_path / 'a.db'}")
    upgrade_to_head(engine)
    sessions = make_session_factory(engine)
    key = generate_key()
    with sessions() as s:
        tenant = queries.ensure_tenant(s, "t")
        row = queries.create_api_key(s, tenant.id, hash_key(key), key[:12])
        s.commit()
        tenant_id, key_id = tenant.id, row.id
    now = [0.0]
    auth = Authenticator(sessions, "unused", cache_s=5.0, clock=lambda: now[0])
    metadata = (("authorization", f"Bearer {key}"),)
    assert auth.authenticate(metadata) == tenant_id
    from treadle.server.db import tenancy

    with sessions() as s:
        tenancy.revoke_key(s, key_id)
        s.commit()
    now[0] = 4.9
    assert auth.authenticate(metadata) == tenant_id  # still cached
    now[0] = 5.0
    with pytest.raises(UnauthenticatedError):
        auth.authenticate(metadata)
    engine.dispose()


# ---- the admin CLI on both databases --------------------------------------------------


@pytest.mark.parametrize(
    "backend", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]
)
def test_admin_cli_tenants_keys_usage(
    backend: str,
    tmp_path: Path,
    tiny_model_dir: Path,
    capsys: pytest.CaptureFixture[str],
    request: pytest.FixtureRequest,
) -> None:
    url = request.getfixturevalue("postgres_url") if backend == "postgres" else ""
    db = ["--database-url", url] if url else ["--data-dir", str(tmp_path / "data")]
    key = admin([*db, "create-tenant", "dora"], capsys).strip()
    srv = _server(tmp_path / "data", tiny_model_dir, database_url=url, usage_flush_s=0.2)
    try:
        with treadle.ServiceClient(srv.address, api_key=key) as client:
            trainer = client.create_lora_training_client("tiny", rank=2)
            datum = treadle.Datum(
                model_input=treadle.ModelInput.from_ints([1, 2, 3, 4]),
                loss_fn_inputs={"target_tokens": [2, 3, 4, 5], "weights": [1.0] * 4},
            )
            trainer.forward_backward([datum, datum], "cross_entropy").result()
            trainer.optim_step(treadle.AdamParams(learning_rate=1e-3)).result()
            trainer.save_state("one").result()
            sampler = client.create_sampling_client(base_model="tiny")
            params = treadle.SamplingParams(max_tokens=3, seed=1)
            out = sampler.sample(treadle.ModelInput.from_ints([1, 2]), 2, params).result()
            generated = sum(len(s.tokens) for s in out.sequences)
            model_id = trainer.model_id
    finally:
        srv.stop()  # writes the last usage counters
    lines = admin([*db, "usage", "dora", "--json"], capsys)
    rows = {r["model_id"]: r for r in map(json.loads, lines.splitlines())}
    assert rows[model_id]["tokens_trained"] == 8
    assert rows[model_id]["calls"] == 3
    assert rows[model_id]["compute_s"] > 0
    assert rows[model_id]["checkpoints"] == 1 and rows[model_id]["checkpoint_bytes"] > 0
    assert rows[""]["tokens_sampled"] == generated and rows[""]["base_model"] == "tiny"
    table = admin([*db, "usage"], capsys)
    assert "dora" in table and model_id in table and "(base)" in table
    assert "default" not in admin([*db, "usage", "dora"], capsys)  # one tenant's usage only
    assert "max_models" in admin([*db, "set-quota", "dora", "--max-models", "2"], capsys)
    assert cli.main(["admin", *db, "set-quota", "dora", "--max-models", "x"]) == 2
    assert cli.main(["admin", *db, "usage", "nobody"]) == 2


def test_admin_cli_bad_database_url(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["admin", "--database-url", "postgres://x@y/z", "usage"]) == 2
    assert "postgresql+psycopg://" in capsys.readouterr().err


def test_a_retried_sample_is_counted_once(
    tmp_path: Path, tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A client that sends the same Sample again (same sampler, seq_id and payload:
    a retry) gets the first call's sequences, and usage counts them once."""
    db = ["--data-dir", str(tmp_path / "data")]
    key = admin([*db, "create-tenant", "rita"], capsys).strip()
    srv = _server(tmp_path / "data", tiny_model_dir, usage_flush_s=0.2)
    try:
        with treadle.ServiceClient(srv.address, api_key=key) as client:
            sampler = client.create_sampling_client(base_model="tiny")
            params = treadle.SamplingParams(max_tokens=5, seed=4)
            request = sampling_pb2.SampleRequest(
                sampler_id=sampler.sampler_id,
                seq_id=1,
                num_samples=3,
                params=_convert.sampling_params_to_wire(params),
            )
            _convert.prompt_to_wire(treadle.ModelInput.from_ints([1, 2, 3]), request.prompt)
            md = (("authorization", f"Bearer {key}"),)
            first = client._sampling.Sample(request, metadata=md)
            again = client._sampling.Sample(request, metadata=md)
            assert again == first
            response = _convert.sample_response_from_wire(first)
            generated = sum(len(s.tokens) for s in response.sequences)
            assert generated > 0
    finally:
        srv.stop()
    lines = admin([*db, "usage", "rita", "--json"], capsys)
    rows = {r["model_id"]: r for r in map(json.loads, lines.splitlines())}
    assert rows[""]["tokens_sampled"] == generated
    assert rows[""]["calls"] == 1
