"""Observability of the embedded server: the Prometheus endpoint after a few
calls (series and labels; a tenant label is a tenant id, never a key), and the
request id the SDK sends on the server's log lines, text or JSON."""

from __future__ import annotations

import json
import logging
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

import treadle
from tests.conftest import make_server
from tests.helpers import next_token_datum
from treadle import _rpc
from treadle.common.logs import JsonFormatter
from treadle.errors import NotFoundError, TreadleError
from treadle.server.embedded import EmbeddedServer
from treadle.v1 import server_pb2, server_pb2_grpc

BASE = "tiny"

Samples = dict[str, list[tuple[dict[str, str], float]]]


def scrape(port: int) -> tuple[str, Samples]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
        text = r.read().decode()
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples.setdefault(s.name, []).append((dict(s.labels), float(s.value)))
    return text, samples


def value(samples: Samples, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    return sum(
        v for got, v in samples.get(name, []) if all(got.get(k) == x for k, x in labels.items())
    )


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[EmbeddedServer]:
    s = make_server(tmp_path_factory.mktemp("observe"), {BASE: tiny_model_dir}, metrics_port=0)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def traffic(srv: EmbeddedServer) -> str:
    """A few calls of each kind, one refused for a missing model and one without a
    valid key; the default tenant's id."""
    assert srv.api_key is not None and srv.ctx is not None
    with treadle.ServiceClient(srv.address, api_key=srv.api_key) as client:
        tc = client.create_lora_training_client(BASE, rank=2, seed=0)
        tc.forward_backward([next_token_datum([1, 2, 3, 4, 5])], "cross_entropy").result(
            timeout=120
        )
        tc.optim_step(treadle.AdamParams(learning_rate=1e-3)).result(timeout=120)
        sampler = tc.sync_weights()
        sampler.sample([1, 2, 3], 2, treadle.SamplingParams(max_tokens=3)).result(timeout=120)
        tc.save_state("m1").result(timeout=120)
        with pytest.raises(NotFoundError):
            client.get_model_info("no-such-model")
    with (
        treadle.ServiceClient(srv.address, api_key="tdl-" + "C" * 43, max_retries=0) as bad,
        pytest.raises(TreadleError),
    ):
        bad.list_models()
    assert srv.ctx.default_key is not None
    return srv.ctx.default_key.tenant_id


def test_metrics_endpoint_reports_calls_engine_and_process(
    srv: EmbeddedServer, traffic: str
) -> None:
    assert srv.ctx is not None and srv.ctx.metrics is not None
    endpoint = srv.ctx.metrics.endpoint
    assert endpoint is not None
    text, samples = scrape(endpoint.port)
    tenant = traffic

    calls = "treadle_rpc_calls_total"
    fb = "TrainingService/ForwardBackward"
    assert value(samples, calls, rpc=fb, status="OK", tenant=tenant) == 1
    assert value(samples, calls, rpc="TrainingService/OptimStep", status="OK", tenant=tenant) == 1
    assert value(samples, calls, rpc="SamplingService/Sample", status="OK", tenant=tenant) >= 1
    assert value(samples, calls, status="NOT_FOUND", tenant=tenant) >= 1
    assert value(samples, calls, status="UNAUTHENTICATED", tenant="") >= 1
    assert value(samples, "treadle_rpc_latency_seconds_count", rpc=fb) == 1
    assert value(samples, "treadle_rpc_latency_seconds_sum", rpc=fb) > 0
    assert "treadle_rpc_in_flight" in samples
    assert value(samples, "treadle_rpc_in_flight") == 0  # every call was answered

    # the engine's stats: tokens, passes, sampler slots, queues, models, checkpoints
    assert value(samples, "treadle_tokens_trained_total", base_model=BASE) >= 4
    assert value(samples, "treadle_tokens_sampled_total", base_model=BASE) >= 2
    assert value(samples, "treadle_training_passes_total", base_model=BASE) >= 1
    assert value(samples, "treadle_training_pass_calls_total", base_model=BASE) >= 1
    assert value(samples, "treadle_sampler_slots", base_model=BASE) > 0
    assert "treadle_sampler_slots_used" in samples
    assert value(samples, "treadle_engine_models") == 1
    # forward_backward, optim_step, sync_weights, save_state: each waited in the queue
    assert value(samples, "treadle_queue_wait_seconds_count", tenant=tenant) >= 4
    assert value(samples, "treadle_queue_depth", tenant=tenant) == 0
    assert value(samples, "treadle_checkpoints_total") >= 1
    assert value(samples, "treadle_checkpoint_bytes_total") > 0
    assert value(samples, "process_open_fds") > 0
    assert value(samples, "process_resident_memory_bytes") > 0

    # every tenant label is a tenant id (or "" for no valid key), never a key
    tenants = {
        labels["tenant"]
        for series in samples.values()
        for labels, _ in series
        if "tenant" in labels
    }
    assert tenants <= {tenant, ""}, tenants
    assert srv.api_key is not None and srv.api_key not in text
    assert "tdl-" not in text


def test_the_sdks_request_id_is_on_the_servers_log_lines(
    srv: EmbeddedServer,
    traffic: str,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    caplog.set_level(logging.INFO, logger="treadle")
    monkeypatch.setattr(_rpc, "new_request_id", lambda: "rid-sdk-0001")
    with treadle.ServiceClient(srv.address, api_key=srv.api_key) as client:
        client.list_models()
    # a caller of its own (another language's client) sends its id in the metadata
    with grpc.insecure_channel(srv.address) as ch:
        stub = server_pb2_grpc.ServerServiceStub(ch)
        stub.GetServerInfo(
            server_pb2.GetServerInfoRequest(),
            metadata=(("authorization", f"Bearer {srv.api_key}"), ("treadle-request-id", "own-42")),
            timeout=30,
        )
        # none sent: the server makes one
        stub.GetServerInfo(
            server_pb2.GetServerInfoRequest(),
            metadata=(("authorization", f"Bearer {srv.api_key}"),),
            timeout=30,
        )
    access = [r for r in caplog.records if r.name == "treadle.server.access"]
    by_id = {getattr(r, "request_id", ""): r for r in access}
    assert "rid-sdk-0001" in by_id and "own-42" in by_id
    assert by_id["own-42"].rpc == "ServerService/GetServerInfo"  # type: ignore[attr-defined]
    assert all(getattr(r, "request_id", "") for r in access)
    assert len(by_id) == len(access), "a request id was reused"

    line = json.loads(JsonFormatter("serve").format(by_id["rid-sdk-0001"]))
    assert line["request_id"] == "rid-sdk-0001"
    assert line["rpc"] == "TrainingService/ListModels"
    assert line["status"] == "OK" and line["tenant"] == traffic and line["process"] == "serve"
    assert {"ts", "level", "logger", "msg", "duration_ms"} <= set(line)
