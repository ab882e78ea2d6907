"""Small builders the tests share (one definition each)."""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

import treadle
from treadle.errors import TreadleError
from treadle.server.auth import generate_key, hash_key
from treadle.server.db import queries

#: the repository's root
ROOT = Path(__file__).resolve().parents[1]


def script_check(script: str) -> subprocess.CompletedProcess[str]:
    """``scripts/<script> --check`` run from the repository root (a generator's
    drift check); what it printed is in the result."""
    return subprocess.run(
        [sys.executable, str(ROOT / "scripts" / script), "--check"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )


def char_ids(text: str) -> list[int]:
    """``text`` in the tiny model's character ids (``workers.model.tiny``)."""
    return [3 + (ord(c) - 32) for c in text]


def next_token_datum(
    tokens: Sequence[int], weights: Sequence[float] | None = None
) -> treadle.Datum:
    """A datum that trains each token on the next one: inputs ``tokens[:-1]``,
    targets ``tokens[1:]``, weights 1 unless given."""
    tokens = [int(t) for t in tokens]
    n = len(tokens) - 1
    return treadle.Datum(
        model_input=treadle.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": tokens[1:],
            "weights": list(weights) if weights is not None else [1.0] * n,
        },
    )


class _Auth(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    """Adds an API key to raw calls (the SDK does this itself)."""

    def __init__(self, key: str | None) -> None:
        self.metadata = (("authorization", f"Bearer {key}"),) if key else ()

    def _details(self, details: Any) -> Any:
        return details._replace(metadata=[*(details.metadata or ()), *self.metadata])

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)


def raw_channel(server: Any) -> grpc.Channel:
    """A plain gRPC channel to an embedded ``server`` that sends its API key (or
    ``TREADLE_API_KEY``) with every call: for tests that send raw requests."""
    key = getattr(server, "api_key", None) or os.environ.get("TREADLE_API_KEY")
    return grpc.intercept_channel(grpc.insecure_channel(server.address), _Auth(key))


#: the names an embedded server answers on
LOCAL_NAMES: list[x509.GeneralName] = [
    x509.DNSName("localhost"),
    x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
]


def self_signed(
    directory: Path,
    sans: Sequence[x509.GeneralName] = tuple(LOCAL_NAMES),
    days: float = 1.0,
    common_name: str = "localhost",
) -> tuple[Path, Path]:
    """A CA-less certificate and its key (PEM files ``server.crt``/``server.key`` in
    ``directory``) for the names ``sans``, valid until ``days`` from now (negative:
    already expired)."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    now = dt.datetime.now(dt.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(days=2))
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.SubjectAlternativeName(list(sans)), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    directory.mkdir(parents=True, exist_ok=True)
    cert_path, key_path = directory / "server.crt", directory / "server.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_path, key_path


def tenant_key(srv: Any, name: str) -> str:
    """A new API key of tenant ``name`` (made if need be) of an embedded server,
    written straight to its database."""
    assert srv.ctx is not None
    key = generate_key()
    with srv.ctx.sessions() as s:
        tenant = queries.ensure_tenant(s, name)
        queries.create_api_key(s, tenant.id, hash_key(key), key[:12])
        s.commit()
    return key


def assert_connection_refused(address: str, api_key: str | None, root: Path | None) -> None:
    """A client trusting ``root`` (None: plaintext) gets no call served at ``address``:
    the handshake fails, UNAVAILABLE, without retries."""
    with (
        treadle.ServiceClient(
            address,
            api_key=api_key,
            root_certificates=root.read_bytes() if root is not None else None,
            timeout_s=5,
            max_retries=0,
        ) as client,
        pytest.raises(TreadleError) as info,
    ):
        client.get_server_info()
    assert info.value.code == "UNAVAILABLE"
