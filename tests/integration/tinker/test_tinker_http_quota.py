"""The tenant's quota over the tinker HTTP API: a sample over the tokens-per-minute
budget answers 429 on the request itself, with the delay the SDK waits out."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

tinker = pytest.importorskip("tinker")
httpx = pytest.importorskip("httpx")

from tinker import types as T  # noqa: E402

from tests.helpers import tenant_key  # noqa: E402
from tests.integration.tinker.test_tinker_sdk import BASE  # noqa: E402
from treadle.server.config import ServerConfig  # noqa: E402
from treadle.server.embedded import EmbeddedServer  # noqa: E402


@pytest.fixture(scope="module")
def server(
    tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path
) -> Iterator[EmbeddedServer]:
    config = ServerConfig(
        data_dir=tmp_path_factory.mktemp("tinker-quota") / "data",
        models={BASE: tiny_model_dir},
        port=0,
        http_port=0,
        threads=1,
        quota_tokens_per_minute=120,  # 2 tokens a second, at most 120 at once
    )
    srv = EmbeddedServer(config).start()
    yield srv
    srv.stop()


def _datum(n: int) -> T.Datum:
    tokens = [1 + i % 60 for i in range(n + 1)]
    return T.Datum(
        model_input=T.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": T.TensorData.from_numpy(np.asarray(tokens[1:], np.int64)),
            "weights": T.TensorData.from_numpy(np.ones(n, np.float32)),
        },
    )


def test_sampling_over_quota_is_429_and_the_sdk_waits_it_out(server: EmbeddedServer) -> None:
    assert server.http_url
    key = "tml-" + tenant_key(server, "sampling-quota")
    sc = tinker.ServiceClient(base_url=server.http_url, api_key=key)
    try:
        tc = sc.create_lora_training_client(base_model=BASE, rank=2).result()
        sampler = sc.create_sampling_client(base_model=BASE).result()
        created = httpx.post(
            f"{server.http_url}/api/v1/create_sampling_session",
            json={"base_model": BASE},
            headers={"X-API-Key": key},
            timeout=30,
        )
        assert created.status_code == 200, created.text
        body = {
            "sampling_session_id": created.json()["sampling_session_id"],
            "seq_id": 1,
            "num_samples": 1,
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2]}]},
            "sampling_params": {"max_tokens": 8, "temperature": 1.0},
        }
        # the whole minute's budget, spent at once
        tc.forward_backward([_datum(20)] * 6, "cross_entropy").result()
        # the raw request: refused on the request itself, with the delay
        res = httpx.post(
            f"{server.http_url}/api/v1/asample", json=body, headers={"X-API-Key": key}, timeout=30
        )
        assert res.status_code == 429, res.text
        assert "tokens_per_minute" in res.json()["error"]
        assert 2 <= int(res.headers["Retry-After"]) <= 5  # 10 tokens at 2 a second
        # through the SDK: it waits and succeeds
        t0 = time.monotonic()
        out = sampler.sample(
            T.ModelInput.from_ints([1, 2]), 1, T.SamplingParams(max_tokens=8)
        ).result(timeout=60)
        assert len(out.sequences) == 1
        assert time.monotonic() - t0 >= 1.0
    finally:
        sc.close("success").result()
