"""The HTTP API's timing headers: ``Server-Timing: app;dur=<ms>`` on every
answer, and on a retrieve_future answer with the result the server's
``time.monotonic()`` when it was ready (``x-treadle-ready-monotonic``), which a
client on the same host compares with its own clock."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import numpy as np
import pytest

tinker = pytest.importorskip("tinker")
httpx = pytest.importorskip("httpx")

from tinker.proto import tinker_public_pb2 as sdk_pb  # noqa: E402

from treadle.server.config import ServerConfig  # noqa: E402
from treadle.server.embedded import EmbeddedServer  # noqa: E402

os.environ.setdefault("TINKER_TELEMETRY", "0")
APP = re.compile(r"(?:^|,\s*)app;dur=([0-9.]+)")


def _fb_body(model_id: str) -> bytes:
    msg = sdk_pb.ForwardBackwardRequest(model_id=model_id, seq_id=1, loss_fn="cross_entropy")
    d = msg.data.add()
    d.model_input.add().encoded_text.tokens = np.asarray([1, 2, 3], np.int32).tobytes()
    for name, arr in (
        ("target_tokens", np.asarray([2, 3, 4], np.int64)),
        ("weights", np.ones(3, np.float32)),
    ):
        t = d.loss_fn_inputs[name]
        t.dtype = sdk_pb.DTYPE_INT64 if arr.dtype == np.int64 else sdk_pb.DTYPE_FLOAT32
        t.dense = arr.tobytes()
        t.shape.extend(arr.shape)
    return msg.SerializeToString()


def test_retrieve_future_carries_ready_stamp_and_app_time(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    config = ServerConfig(
        data_dir=tmp_path / "data", models={"tiny": tiny_model_dir}, port=0, http_port=0, threads=1
    )
    srv = EmbeddedServer(config).start()
    assert srv.api_key and srv.http_url
    key = "tml-" + srv.api_key
    sc = tinker.ServiceClient(base_url=srv.http_url, api_key=key)
    try:
        tc = sc.create_lora_training_client(base_model="tiny", rank=2, seed=0).result()
        headers = {"X-API-Key": key}
        url = f"{srv.http_url}/api/v1"
        before = time.monotonic()
        submitted = httpx.post(
            f"{url}/forward_backward",
            content=_fb_body(tc.model_id),
            headers={**headers, "Content-Type": "application/x-protobuf"},
            timeout=60,
        )
        assert submitted.status_code == 200, submitted.text
        assert APP.search(submitted.headers["server-timing"])
        rid = submitted.json()["request_id"]
        t0 = time.perf_counter()
        done = httpx.post(
            f"{url}/retrieve_future", json={"request_id": rid}, headers=headers, timeout=60
        )
        waited_ms = (time.perf_counter() - t0) * 1e3
        after = time.monotonic()
        assert done.status_code == 200, done.text
        ready = float(done.headers["x-treadle-ready-monotonic"])
        assert before <= ready <= after  # one clock: this process's and the server's
        app = APP.search(done.headers["server-timing"])
        assert app is not None and 0.0 <= float(app.group(1)) <= waited_ms
        # an error answer has the app's time too, and no ready stamp
        gone = httpx.post(
            f"{url}/retrieve_future", json={"request_id": "nope"}, headers=headers, timeout=60
        )
        assert gone.status_code == 410
        assert APP.search(gone.headers["server-timing"])
        assert "x-treadle-ready-monotonic" not in gone.headers
    finally:
        sc.close("success").result()
        srv.stop()


def test_client_config_keeps_the_sdk_on_httpx_transport(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """The SDK's pyqwest transport costs more per request on loopback than httpx's
    own (benchmarks/tinker_api.py): the server's client config turns it off, as
    the SDK's own config model reads it."""
    config = ServerConfig(
        data_dir=tmp_path / "data", models={"tiny": tiny_model_dir}, port=0, http_port=0, threads=1
    )
    with EmbeddedServer(config) as srv:
        assert srv.http_url
        answer = httpx.post(f"{srv.http_url}/api/v1/client/config", json={}, timeout=30)
        assert answer.status_code == 200, answer.text
        parsed = tinker.types.ClientConfigResponse.model_validate(answer.json())
        assert parsed.use_pyqwest_transport is False
        assert parsed.sample_use_retrieve_futures is False  # the plain paths stay on
