"""TLS on the gRPC port: a self-signed certificate made here, the SDK trusting it
as its root, and a plaintext client refused."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

import treadle
from tests.conftest import make_server
from tests.helpers import assert_connection_refused, self_signed
from treadle.errors import InvalidArgumentError
from treadle.server.config import ServerConfig
from treadle.server.embedded import EmbeddedServer


def _key(srv: EmbeddedServer) -> str | None:
    return getattr(srv, "api_key", None)  # set once the server has API keys


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return self_signed(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="module")
def tls_server(
    tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path, certs: tuple[Path, Path]
) -> Iterator[EmbeddedServer]:
    cert, key = certs
    srv = make_server(
        tmp_path_factory.mktemp("tls-server"),
        {"tiny": tiny_model_dir},
        tls_cert=cert,
        tls_key=key,
        http_port=0,
    )
    yield srv
    srv.stop()


@pytest.mark.parametrize("host", ["localhost", "127.0.0.1"])
def test_sdk_trusting_the_root_runs_a_step(
    tls_server: EmbeddedServer, certs: tuple[Path, Path], host: str
) -> None:
    root = certs[0].read_bytes()
    with treadle.ServiceClient(
        f"{host}:{tls_server.port}", api_key=_key(tls_server), root_certificates=root
    ) as client:
        assert client.get_server_info().base_models[0].name == "tiny"
        tc = client.create_lora_training_client("tiny", rank=2)
        datum = treadle.Datum(
            model_input=treadle.ModelInput.from_ints([5, 6, 7]),
            loss_fn_inputs={"target_tokens": [6, 7, 8], "weights": [1.0, 1.0, 1.0]},
        )
        out = tc.forward_backward([datum]).result(timeout=30)
        assert out.metrics["loss:sum"] > 0
        assert tc.optim_step().result(timeout=30).step == 1
        assert client.get_tokenizer("tiny").encode("1+1") != []


def test_plaintext_client_is_refused(tls_server: EmbeddedServer) -> None:
    assert_connection_refused(tls_server.address, _key(tls_server), None)


def test_untrusted_certificate_is_refused(tls_server: EmbeddedServer, tmp_path: Path) -> None:
    other_root, _ = self_signed(tmp_path)  # same names, another key: not the server's
    assert_connection_refused(tls_server.address, _key(tls_server), other_root)


def test_http_api_takes_the_same_certificate(
    tls_server: EmbeddedServer, certs: tuple[Path, Path]
) -> None:
    """The tinker-compatible HTTP API is served over TLS with the gRPC port's
    certificate; plaintext HTTP gets no answer."""
    import httpx

    url = tls_server.http_url
    assert url is not None and url.startswith("https://")
    assert httpx.get(f"{url}/api/v1/healthz", verify=str(certs[0])).status_code == 200
    with pytest.raises(httpx.HTTPError):
        httpx.get(url.replace("https://", "http://") + "/api/v1/healthz", timeout=10)


def test_config_needs_both_files(tmp_path: Path, certs: tuple[Path, Path]) -> None:
    cert, key = certs
    with pytest.raises(InvalidArgumentError, match="tls_cert, tls_key"):
        ServerConfig(data_dir=tmp_path, tls_cert=cert)
    with pytest.raises(InvalidArgumentError, match="tls_key"):
        ServerConfig(data_dir=tmp_path, tls_cert=cert, tls_key=tmp_path / "missing.key")
