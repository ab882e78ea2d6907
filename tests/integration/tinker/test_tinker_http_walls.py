"""The tinker HTTP API's walls and bad input: tenants see only their own (404,
the same as an id that never existed), a retried request is applied once, and
malformed, unauthenticated, unknown, oversized or over-quota requests are refused
with the status the SDK expects, changing no model."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

tinker = pytest.importorskip("tinker")
httpx = pytest.importorskip("httpx")

from tinker import types as T  # noqa: E402
from tinker.proto import tinker_public_pb2 as sdk_pb  # noqa: E402

from tests.helpers import tenant_key  # noqa: E402
from treadle.server.config import ServerConfig  # noqa: E402
from treadle.server.db import tenancy  # noqa: E402
from treadle.server.embedded import EmbeddedServer  # noqa: E402

os.environ.setdefault("TINKER_TELEMETRY", "0")
BASE = "tiny"
FAKE_MODEL = "m-00000000deadbeef"


@dataclass
class World:
    server: EmbeddedServer
    url: str
    key_a: str
    key_b: str
    model_a: str  # A's model, one optimizer step in
    sampler_path_a: str  # A's named sampler weights
    state_path_a: str  # A's training checkpoint

    def post(self, route: str, key: str | None, **kw: object) -> httpx.Response:
        headers = {"X-API-Key": key} if key else {}
        headers.update(kw.pop("headers", {}))  # type: ignore[arg-type]
        return httpx.post(f"{self.url}/api/v1/{route}", headers=headers, timeout=60, **kw)  # type: ignore[arg-type]

    def result(self, key: str, submitted: httpx.Response) -> httpx.Response:
        assert submitted.status_code == 200, submitted.text
        rid = submitted.json()["request_id"]
        return self.post("retrieve_future", key, json={"request_id": rid})

    def version(self, model_id: str) -> int:
        assert self.server.ctx is not None
        return self.server.ctx.dispatcher.model_status(model_id).version


def _datum(tokens: list[int]) -> T.Datum:
    return T.Datum(
        model_input=T.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": T.TensorData.from_numpy(np.asarray(tokens[1:], np.int64)),
            "weights": T.TensorData.from_numpy(np.ones(len(tokens) - 1, np.float32)),
        },
    )


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[World]:
    tmp = tmp_path_factory.mktemp("tinker-walls")
    config = ServerConfig(
        data_dir=tmp / "data", models={BASE: tiny_model_dir}, port=0, http_port=0, threads=1
    )
    srv = EmbeddedServer(config).start()
    assert srv.api_key and srv.http_url
    key_a = "tml-" + srv.api_key
    sc = tinker.ServiceClient(base_url=srv.http_url, api_key=key_a)
    tc = sc.create_lora_training_client(base_model=BASE, rank=2, seed=0).result()
    tc.forward_backward([_datum([1, 2, 3, 4])], "cross_entropy").result()
    tc.optim_step(T.AdamParams(learning_rate=1e-2)).result()
    sampler_path = tc.save_weights_for_sampler("a-weights").result().path
    state_path = tc.save_state("a-state").result().path
    w = World(
        srv,
        srv.http_url,
        key_a,
        "tml-" + tenant_key(srv, "b"),
        tc.model_id,
        sampler_path,
        state_path,
    )
    yield w
    sc.close("success").result()
    srv.stop()


def _fb_body(model_id: str, seq_id: int, tokens: list[int] = [1, 2, 3, 4]) -> bytes:  # noqa: B006
    msg = sdk_pb.ForwardBackwardRequest(model_id=model_id, seq_id=seq_id, loss_fn="cross_entropy")
    d = msg.data.add()
    d.model_input.add().encoded_text.tokens = np.asarray(tokens[:-1], np.int32).tobytes()
    for name, arr in (
        ("target_tokens", np.asarray(tokens[1:], np.int64)),
        ("weights", np.ones(len(tokens) - 1, np.float32)),
    ):
        t = d.loss_fn_inputs[name]
        t.dtype = sdk_pb.DTYPE_INT64 if arr.dtype == np.int64 else sdk_pb.DTYPE_FLOAT32
        t.dense = arr.tobytes()
        t.shape.extend(arr.shape)
    return msg.SerializeToString()


PROTO = {"Content-Type": "application/x-protobuf"}


def test_other_tenants_ids_answer_like_missing_ones(world: World) -> None:
    """(g) B sees none of A's models, samplers or checkpoints: 404, with the very
    body an id that never existed gets."""
    b = world.key_b
    for model_id in (world.model_a, FAKE_MODEL):
        r = world.post("get_info", b, json={"model_id": model_id})
        assert r.status_code == 404
    real = world.post("get_info", b, json={"model_id": world.model_a}).json()
    fake = world.post("get_info", b, json={"model_id": FAKE_MODEL}).json()
    assert real["error"].replace(world.model_a, "X") == fake["error"].replace(FAKE_MODEL, "X")
    r = world.post("forward_backward", b, content=_fb_body(world.model_a, 9), headers=PROTO)
    assert r.status_code == 404
    r = world.post(
        "optim_step", b, json={"model_id": world.model_a, "seq_id": 9, "adam_params": {}}
    )
    assert r.status_code == 404
    r = world.post(
        "create_sampling_session",
        b,
        json={"session_id": "x", "sampling_session_seq_id": 0, "model_path": world.sampler_path_a},
    )
    assert r.status_code == 404
    r = httpx.get(
        f"{world.url}/api/v1/training_runs/{world.model_a}/checkpoints",
        headers={"X-API-Key": b},
    )
    assert r.status_code == 404
    # B's own SDK client cannot load A's checkpoint either
    sc_b = tinker.ServiceClient(base_url=world.url, api_key=b)
    try:
        with pytest.raises(tinker.RequestFailedError, match="not found"):
            sc_b.create_training_client_from_state_with_optimizer(world.state_path_a).result()
    finally:
        sc_b.close("success").result()
    # and A still has everything
    listed = httpx.get(
        f"{world.url}/api/v1/training_runs/{world.model_a}/checkpoints",
        headers={"X-API-Key": world.key_a},
    ).json()
    assert world.state_path_a in [c["tinker_path"] for c in listed["checkpoints"]]


def test_a_retried_request_is_applied_once(world: World) -> None:
    """(h) the same seq_id sent twice (new idempotency keys, as the SDK retries)
    gets the recorded result; the model takes one step, not two."""
    a = world.key_a
    assert world.server.ctx is not None
    next_seq = world.server.ctx.dispatcher.model_status(world.model_a).next_seq_id
    fb = [
        world.result(
            a,
            world.post(
                "forward_backward",
                a,
                content=_fb_body(world.model_a, next_seq),
                headers={**PROTO, "X-Idempotency-Key": f"k{i}"},
            ),
        )
        for i in range(2)
    ]
    assert fb[0].content == fb[1].content and fb[0].status_code == 200
    before = world.version(world.model_a)
    body = {
        "model_id": world.model_a,
        "seq_id": next_seq + 1,
        "adam_params": {"learning_rate": 0.01},
    }
    steps = [world.result(a, world.post("optim_step", a, json=body)).json() for _ in range(2)]
    assert steps[0] == steps[1]
    assert world.version(world.model_a) == before + 1
    # the same seq_id with another payload is refused (409), not applied
    other = dict(body, adam_params={"learning_rate": 0.5})
    failed = world.result(a, world.post("optim_step", a, json=other)).json()
    assert failed["category"] == "user" and "FAILED_PRECONDITION" in failed["error"]
    assert world.version(world.model_a) == before + 1


def test_bad_input_is_refused_and_changes_nothing(world: World) -> None:
    a = world.key_a
    before = world.version(world.model_a)
    r = world.post(
        "optim_step", a, content=b"{not json", headers={"Content-Type": "application/json"}
    )
    assert r.status_code == 400 and "malformed JSON" in r.json()["error"]
    r = world.post("optim_step", a, json={"model_id": world.model_a, "seq_id": "x"})
    assert r.status_code == 400 and r.json()["error"].startswith("seq_id:")
    r = world.post("forward_backward", a, content=b"\xff\xff\xff", headers=PROTO)
    assert r.status_code == 400 and "ForwardBackwardRequest" in r.json()["error"]
    r = world.post("no_such_route", a, json={})
    assert r.status_code == 404
    r = world.post("get_info", None, json={"model_id": world.model_a})
    assert r.status_code == 401
    r = world.post("get_info", "tml-tdl-" + "x" * 43, json={"model_id": world.model_a})
    assert r.status_code == 401
    big = b"\0" * (world.server.config.max_message_bytes + 1)
    r = world.post("forward_backward", a, content=big, headers=PROTO)
    assert r.status_code == 413
    # bad data inside a well-formed request: the future fails naming the field
    assert world.server.ctx is not None
    seq = world.server.ctx.dispatcher.model_status(world.model_a).next_seq_id
    msg = sdk_pb.ForwardBackwardRequest.FromString(_fb_body(world.model_a, seq))
    del msg.data[0].loss_fn_inputs["weights"]
    failed = world.result(
        a, world.post("forward_backward", a, content=msg.SerializeToString(), headers=PROTO)
    ).json()
    assert failed["category"] == "user" and "weights" in failed["error"]
    assert world.version(world.model_a) == before


def test_over_quota_is_429_with_the_retry_delay(world: World) -> None:
    """A tenant over its tokens-a-minute quota gets 429 and the delay to wait
    (Retry-After), on the request itself; nothing is applied."""
    srv = world.server
    assert srv.ctx is not None
    key_c = "tml-" + tenant_key(srv, "c")
    sc = tinker.ServiceClient(base_url=world.url, api_key=key_c)
    try:
        model_c = sc.create_lora_training_client(base_model=BASE, rank=2).result().model_id
        with srv.ctx.session() as s:
            tenancy.set_quota(s, tenancy.find_tenant(s, "c"), tokens_per_minute=10)
        srv.ctx.quotas.refresh_s = 0
        # seq 2 and 3 wait for seq 1 (not sent yet): only the model's next call may
        # run the bucket into debt, so these are metered
        first = world.post(
            "forward_backward", key_c, content=_fb_body(model_c, 2, [1] * 8), headers=PROTO
        )
        assert first.status_code == 200
        over = world.post(
            "forward_backward", key_c, content=_fb_body(model_c, 3, [1] * 8), headers=PROTO
        )
        assert over.status_code == 429
        assert int(over.headers["Retry-After"]) >= 1
        assert over.json()["retry_after_s"] > 0
        # seq 1 unblocks the model (admitted whatever the bucket says); 2 then runs
        one = world.post("forward_backward", key_c, content=_fb_body(model_c, 1), headers=PROTO)
        assert world.result(key_c, one).status_code == 200
        assert world.result(key_c, first).status_code == 200
    finally:
        sc.close("success").result()


def test_futures_and_sessions(world: World) -> None:
    """An unknown (or another tenant's) request id is 410, on which the SDK
    resubmits; heartbeats keep a session alive until it is finished."""
    a, b = world.key_a, world.key_b
    assert world.post("retrieve_future", a, json={"request_id": "nope"}).status_code == 410
    assert world.server.ctx is not None
    seq = world.server.ctx.dispatcher.model_status(world.model_a).next_seq_id
    submitted = world.post(
        "forward_backward", a, content=_fb_body(world.model_a, seq), headers=PROTO
    )
    rid = submitted.json()["request_id"]
    assert world.post("retrieve_future", b, json={"request_id": rid}).status_code == 410
    done = world.post("retrieve_future", a, json={"request_id": rid})
    assert done.headers["content-type"] == "application/x-protobuf"
    out = sdk_pb.ForwardBackwardOutput.FromString(done.content)
    assert "loss:sum" in out.metrics and out.loss_fn_outputs[0].num_datums == 1
    session = world.post("create_session", a, json={"sdk_version": "test"}).json()["session_id"]
    assert world.post("session_heartbeat", a, json={"session_id": session}).status_code == 200
    assert world.post("session_heartbeat", b, json={"session_id": session}).status_code == 404
    assert (
        world.post(f"sessions/{session}/finish", a, json={"reason": "success"}).status_code == 200
    )
    assert (
        world.post("session_heartbeat", a, json={"session_id": session}).status_code == 410
    )  # the SDK stops its heartbeats
    assert world.post("telemetry", a, json={"events": []}).status_code == 200
