"""``treadle serve``'s HTTP port default and a run's user_metadata limits, as parsed."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from treadle.errors import InvalidArgumentError
from treadle.server.config import add_server_flags, config_from_args, http_port_of
from treadle.server.service import run_metadata


def test_the_http_port_follows_the_grpc_port_unless_given() -> None:
    assert http_port_of(50051, None) == 50052
    assert http_port_of(6000, None) == 6001
    assert http_port_of(0, None) == 0  # any free port, as the gRPC one
    assert http_port_of(50051, 9000) == 9000
    assert http_port_of(50051, -1) is None
    with pytest.raises(InvalidArgumentError, match="--http-port"):
        http_port_of(65535, None)


def test_the_flags_give_the_derived_default(
    monkeypatch: pytest.MonkeyPatch, tiny_model_dir: Path
) -> None:
    monkeypatch.delenv("TREADLE_HTTP_PORT", raising=False)
    parser = argparse.ArgumentParser()
    add_server_flags(parser)
    args = parser.parse_args(["--model", str(tiny_model_dir), "--port", "7100"])
    assert config_from_args(args).http_port == 7101
    monkeypatch.setenv("TREADLE_HTTP_PORT", "7200")
    parser = argparse.ArgumentParser()
    add_server_flags(parser)
    args = parser.parse_args(["--model", str(tiny_model_dir), "--port", "7100"])
    assert config_from_args(args).http_port == 7200


def test_user_metadata_limits_name_the_field() -> None:
    assert run_metadata.check(None) == {}
    assert run_metadata.check({"renderer_name": "llama3"}) == {"renderer_name": "llama3"}
    ok = {f"k{i}": "v" * 200 for i in range(64)}
    assert run_metadata.check(ok) == ok
    for bad, message in [
        ({f"k{i}": "v" for i in range(65)}, "user_metadata: 65 keys; at most 64"),
        ({"k": 1}, "user_metadata.k: expected a string, got int"),
        ({"k" * 129: "v"}, "has 129 characters; at most 128"),
        ({"": "v"}, "keys are non-empty strings"),
        ({"k": "v" * 4097}, "user_metadata.k: 4097 characters; at most 4096"),
        ({f"k{i}": "v" * 4000 for i in range(5)}, "bytes as JSON; at most 16384"),
        (["k"], "user_metadata: expected an object"),
    ]:
        with pytest.raises(InvalidArgumentError, match=message.replace(".", r"\.")):
            run_metadata.check(bad)
