"""Security checks (issue 24, item 5): how keys are compared and that they never
reach a log, checkpoint names and paths that try to leave their directory, a
tenant's paths resolving only under its own prefix, message size limits on both
ends, and TLS refusing a certificate that is not the server's."""

from __future__ import annotations

import logging
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from hypothesis import given, settings
from hypothesis import strategies as st

import treadle
from tests.conftest import make_server
from tests.helpers import LOCAL_NAMES, assert_connection_refused, self_signed
from tests.integration.rpc_walk import all_methods, call_raw
from tests.reliability.world import MAX_BYTES, Holdings, seed, server_config, tenant_key
from treadle.common.logs import JsonFormatter
from treadle.common.store import LocalStore, check_name, parse_state_uri
from treadle.errors import InvalidArgumentError, TreadleError
from treadle.server import auth as auth_module
from treadle.server.auth import hash_key
from treadle.server.embedded import EmbeddedServer
from treadle.v1 import training_pb2, training_pb2_grpc

BAD_NAMES = [
    "..",
    ".",
    "../x",
    "a/b",
    "/abs",
    "/etc/passwd",
    "a\x00b",
    "a\nb",
    "a\x1bb",
    "a\tb",
    "",
]


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[EmbeddedServer]:
    s = EmbeddedServer(server_config(tmp_path_factory.mktemp("sec") / "data", tiny_model_dir))
    s.start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def owned(srv: EmbeddedServer) -> Holdings:
    assert srv.api_key is not None
    return seed(srv, srv.api_key)


def _meta(key: str | None) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {key}"),) if key else ()


def _code(fn: object, request: object, key: str | None) -> tuple[grpc.StatusCode, str]:
    try:
        fn(request, metadata=_meta(key), timeout=60)  # type: ignore[operator]
    except grpc.RpcError as err:
        return err.code(), err.details() or ""
    return grpc.StatusCode.OK, ""


# ---- API keys -----------------------------------------------------------------------


def test_keys_are_looked_up_by_hash_never_compared(
    srv: EmbeddedServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The raw key is never compared with anything: it is hashed, and the digest is
    the database lookup key. A timing difference can then tell an attacker at most
    how many leading characters of sha256(guess) match a stored digest, which does
    not help find a key (a preimage); ``hmac.compare_digest`` would only add a
    compare after that same lookup."""
    seen: list[str] = []
    real = auth_module.queries.find_tenant_by_key_hash

    def spy(s: object, digest: str) -> object:
        seen.append(digest)
        return real(s, digest)  # type: ignore[arg-type]

    monkeypatch.setattr(auth_module.queries, "find_tenant_by_key_hash", spy)
    assert srv.ctx is not None
    authn = auth_module.Authenticator(srv.ctx.sessions, "x", cache_s=0)
    wrong = "tdl-" + "A" * 43
    with pytest.raises(TreadleError):
        authn.authenticate(_meta(wrong))
    assert srv.api_key is not None
    authn.authenticate(_meta(srv.api_key))
    assert seen == [hash_key(wrong), hash_key(srv.api_key)]
    source = Path(auth_module.__file__).read_text()
    assert "key ==" not in source and "== key" not in source


def test_keys_never_reach_a_log(
    tmp_path: Path,
    tiny_model_dir: Path,
    caplog: pytest.LogCaptureFixture,
    capfd: pytest.CaptureFixture[str],
) -> None:
    """A run with keys, good and bad calls, a key of another tenant; every log line
    (treadle.*, grpc, anything at DEBUG), as text and as the JSON lines of
    ``--log-format json`` (with their request ids and extra fields), the
    process's output and the metrics endpoint are grepped."""
    caplog.set_level(logging.DEBUG)
    srv = make_server(tmp_path, {"tiny": tiny_model_dir}, auth_cache_s=0, metrics_port=0)
    try:
        assert srv.api_key is not None
        other = tenant_key(srv, "sec-logs")
        wrong = "tdl-" + "B" * 43
        methods = all_methods()
        with grpc.insecure_channel(srv.address) as ch:
            for key in (srv.api_key, other, wrong, "not-a-key", None):
                for m in methods[:6]:
                    call_raw(ch, m, b"", _meta(key), timeout=30)
        with treadle.ServiceClient(srv.address, api_key=srv.api_key) as client:
            tc = client.create_lora_training_client("tiny", rank=2)
            tc.save_state("k").result(timeout=60)
        with (
            treadle.ServiceClient(srv.address, api_key=wrong, max_retries=0) as client,
            pytest.raises(TreadleError),
        ):
            client.list_models()
        assert srv.ctx is not None and srv.ctx.metrics is not None
        assert srv.ctx.metrics.endpoint is not None
        url = f"http://127.0.0.1:{srv.ctx.metrics.endpoint.port}/metrics"
        with urllib.request.urlopen(url, timeout=30) as r:
            scraped = r.read().decode()
    finally:
        srv.stop()
    out, err = capfd.readouterr()
    as_json = JsonFormatter("serve")
    json_lines = [as_json.format(r) for r in caplog.records]
    text = "\n".join(r.getMessage() for r in caplog.records) + out + err
    text += "\n".join(json_lines) + scraped
    assert caplog.records, "nothing was logged: the check would pass vacuously"
    assert any('"request_id"' in line for line in json_lines)
    assert "treadle_rpc_calls_total" in scraped
    for secret in (srv.api_key, other, wrong):
        assert secret not in text
        assert secret[len("tdl-") :] not in text
        assert hash_key(secret) not in text


# ---- checkpoint names and paths -----------------------------------------------------


@pytest.mark.parametrize("name", BAD_NAMES)
def test_save_state_refuses_names_that_leave_the_directory(
    srv: EmbeddedServer, owned: Holdings, name: str
) -> None:
    stub = training_pb2_grpc.TrainingServiceStub(grpc.insecure_channel(srv.address))
    info = stub.GetModelInfo(
        training_pb2.GetModelInfoRequest(model_id=owned.model_id), metadata=_meta(srv.api_key)
    )
    req = training_pb2.SaveStateRequest(model_id=owned.model_id, seq_id=info.next_seq_id, name=name)
    code, details = _code(stub.SaveState, req, srv.api_key)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("name"), details


@pytest.mark.parametrize("name", BAD_NAMES)
def test_paths_that_leave_the_directory_are_refused(
    srv: EmbeddedServer, owned: Holdings, name: str
) -> None:
    stub = training_pb2_grpc.TrainingServiceStub(grpc.insecure_channel(srv.address))
    uri = f"treadle://{owned.model_id}/state/{name}"
    for bad in (uri, name, f"/{name}"):
        info = stub.GetModelInfo(
            training_pb2.GetModelInfoRequest(model_id=owned.model_id), metadata=_meta(srv.api_key)
        )
        load = training_pb2.LoadStateRequest(
            model_id=owned.model_id, seq_id=info.next_seq_id, path=bad
        )
        for fn, req, field in (
            (stub.LoadState, load, "path"),
            (stub.DeleteCheckpoint, training_pb2.DeleteCheckpointRequest(path=bad), "path"),
            (
                stub.CreateModel,
                training_pb2.CreateModelRequest(base_model="tiny", lora_rank=2, from_state=bad),
                "from_state",
            ),
        ):
            if not bad and field == "from_state":
                continue  # "" = start from the base model
            code, details = _code(fn, req, srv.api_key)
            assert code == grpc.StatusCode.INVALID_ARGUMENT, (bad, code, details)
            assert details.startswith(field), (bad, details)


def test_another_tenants_paths_are_not_found(srv: EmbeddedServer, owned: Holdings) -> None:
    """B names A's checkpoint: NOT_FOUND, as for a path that never existed."""
    key_b = tenant_key(srv, "sec-paths")
    mine = seed(srv, key_b)
    stub = training_pb2_grpc.TrainingServiceStub(grpc.insecure_channel(srv.address))
    fake = "treadle://m-00000000deadbeef/state/seed"
    answers = []
    for path in (owned.path, fake):
        load = training_pb2.LoadStateRequest(
            model_id=mine.model_id, seq_id=mine.next_seq, path=path
        )
        answers.append(_code(stub.LoadState, load, key_b))
        mine.next_seq += 1
        answers.append(
            _code(stub.DeleteCheckpoint, training_pb2.DeleteCheckpointRequest(path=path), key_b)
        )
    assert {a[0] for a in answers} == {grpc.StatusCode.NOT_FOUND}, answers
    assert answers[0][1].replace(owned.model_id, "m-00000000deadbeef") == answers[2][1]


@settings(max_examples=200, deadline=None, derandomize=True)
@given(
    tenant=st.sampled_from(["t-1", "t-2"]), model=st.text(max_size=20), name=st.text(max_size=20)
)
def test_local_store_paths_stay_under_the_tenant(
    tmp_path_factory: pytest.TempPathFactory, tenant: str, model: str, name: str
) -> None:
    """Whatever a name is, it either is refused or lands under root/tenant/model."""
    root = tmp_path_factory.getbasetemp() / "store-prop"
    try:
        check_name(name)
        model_id, _ = parse_state_uri(f"treadle://{model}/state/{name}")
    except InvalidArgumentError:
        return
    if model_id != model or not model or "/" in model:
        return
    path = Path(LocalStore(root).state_path(tenant, "m-1", name)).resolve()
    assert path.is_relative_to((root / tenant / "m-1").resolve())


# ---- message size limits --------------------------------------------------------------


def test_a_message_over_the_servers_limit_is_resource_exhausted(srv: EmbeddedServer) -> None:
    """A raw client with no send limit: the server refuses, quickly, and serves on."""
    method = next(m for m in all_methods() if m.name == "ListModels")
    with grpc.insecure_channel(srv.address) as ch:
        # an unknown length-delimited field 9999 of MAX_BYTES bytes: well-formed, too big
        pad = _varint((9999 << 3) | 2) + _varint(MAX_BYTES) + b"\0" * MAX_BYTES
        code, details, _ = call_raw(ch, method, pad, _meta(srv.api_key), timeout=30)
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, details
        assert call_raw(ch, method, b"", _meta(srv.api_key), timeout=30)[0] == grpc.StatusCode.OK


def test_a_too_big_sdk_call_is_refused_not_hung(srv: EmbeddedServer) -> None:
    """The SDK's channel sets its limits explicitly (``treadle.wire.channel.channel_options``:
    256 MiB each way, gRPC's default receive limit is 4 MiB); a batch over the
    server's limit fails at once RESOURCE_EXHAUSTED, and the connection serves on."""
    with treadle.ServiceClient(srv.address, api_key=srv.api_key, max_retries=0) as client:
        tc = client.create_lora_training_client("tiny", rank=2)
        n = 250_000  # under the tokens-per-request quota, over 4 MiB on the wire
        datum = treadle.Datum(
            model_input=treadle.ModelInput.from_ints([5] * n),
            loss_fn_inputs={"target_tokens": [6] * n, "weights": [1.0] * n},
        )
        with pytest.raises(TreadleError) as info:
            tc.forward_backward([datum]).result(timeout=60)
        assert info.value.code == "RESOURCE_EXHAUSTED", info.value
        assert "larger than max" in str(info.value), info.value
        assert client.list_models() is not None


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


# ---- TLS with a certificate that is not the server's ----------------------------------


@pytest.mark.parametrize(
    "sans, days",
    [([x509.DNSName("other.example")], 1.0), (LOCAL_NAMES, -1.0)],
    ids=["wrong-host", "expired"],
)
def test_tls_refuses_a_certificate_for_another_host_or_expired(
    tmp_path: Path, tiny_model_dir: Path, sans: list[x509.GeneralName], days: float
) -> None:
    """The client trusts the very certificate the server shows, but it names another
    host, or it has expired: the handshake fails (UNAVAILABLE), no call is served."""
    cert, key = self_signed(tmp_path / "tls", sans, days, "treadle-test")
    srv = make_server(tmp_path, {"tiny": tiny_model_dir}, tls_cert=cert, tls_key=key)
    try:
        assert_connection_refused(f"127.0.0.1:{srv.port}", srv.api_key, cert)
    finally:
        srv.stop()


@settings(max_examples=200, deadline=None, derandomize=True)
@given(name=st.text(max_size=20) | st.sampled_from(BAD_NAMES))
def test_s3_store_keys_stay_under_the_tenant_prefix(name: str) -> None:
    """The S3 store's key for any name the server accepts is under
    ``<prefix>/<tenant>/<model>/`` with no empty, ``.`` or ``..`` segment (some
    S3-compatible servers normalise those). No bucket is reached: names only."""
    from treadle.common.s3_store import S3Store

    try:
        check_name(name)
    except InvalidArgumentError:
        return
    store = S3Store("s3://bucket/pre/fix", endpoint_url="http://127.0.0.1:9", check=False)
    path = store.state_path("t-1", "m-1", name)
    assert path.startswith("s3://bucket/pre/fix/t-1/m-1/")
    rest = path[len("s3://bucket/pre/fix/t-1/m-1/") :]
    assert rest == name and "/" not in rest and rest not in ("", ".", "..")
