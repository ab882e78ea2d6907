"""Quotas through the service: over quota is RESOURCE_EXHAUSTED with a retry delay
in the trailers; the SDK waits it out by itself (saying so) and then succeeds;
refusals that waiting cannot fix are not retried and do not stall later calls."""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

import treadle
from tests.helpers import next_token_datum, tenant_key
from treadle._convert import datums_to_wire
from treadle.errors import ResourceExhaustedError
from treadle.server.config import ServerConfig
from treadle.server.db import tenancy
from treadle.server.embedded import EmbeddedServer
from treadle.v1 import common_pb2, training_pb2
from treadle.wire.metadata import RETRY_AFTER_KEY

BASE = "tiny"


def _datum(n: int) -> treadle.Datum:
    return next_token_datum([1 + i % 60 for i in range(n + 1)])


@pytest.fixture(scope="module")
def server(
    tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path
) -> Iterator[EmbeddedServer]:
    config = ServerConfig(
        data_dir=tmp_path_factory.mktemp("quotas") / "data",
        models={BASE: tiny_model_dir},
        port=0,
        threads=1,
        quota_max_models=2,
        quota_calls_in_flight=1,
        quota_tokens_per_request=1000,
        quota_tokens_per_minute=600,  # 10 tokens a second, at most 600 at once
    )
    srv = EmbeddedServer(config).start()
    yield srv
    srv.stop()


def test_tokens_per_minute_is_waited_out_by_the_sdk(
    server: EmbeddedServer, caplog: pytest.LogCaptureFixture
) -> None:
    key = tenant_key(server, "rate")
    with treadle.ServiceClient(server.address, api_key=key) as client:
        trainer = client.create_lora_training_client(BASE, rank=2)
        # 600 tokens: the whole minute's worth, admitted at once
        trainer.forward_backward([_datum(100)] * 6, "cross_entropy").result()
        # the raw RPC: refused, with the delay in the trailers
        request = training_pb2.ForwardBackwardRequest(
            model_id=trainer.model_id,
            seq_id=trainer.get_info().next_seq_id,
            loss_fn=common_pb2.LossFn.Value("CROSS_ENTROPY"),
        )
        request.data.extend(datums_to_wire([_datum(10)]))
        with grpc.insecure_channel(server.address) as channel:
            stub = channel.unary_unary(
                "/treadle.v1.TrainingService/ForwardBackward",
                request_serializer=training_pb2.ForwardBackwardRequest.SerializeToString,
                response_deserializer=training_pb2.ForwardOutput.FromString,
            )
            with pytest.raises(grpc.RpcError) as info:
                stub(request, metadata=(("authorization", f"Bearer {key}"),))
        err = info.value
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "tokens_per_minute" in (err.details() or "")
        delay = dict(err.trailing_metadata() or ())[RETRY_AFTER_KEY]
        assert 0 < float(delay) <= 1.1  # 10 tokens at 10 a second
        # through the SDK: it waits and succeeds, and says so
        caplog.set_level(logging.WARNING, logger="treadle")
        t0 = time.monotonic()
        out = trainer.forward_backward([_datum(10)], "cross_entropy").result(timeout=30)
        waited = time.monotonic() - t0
        (lp,) = [o.logprobs for o in out.loss_fn_outputs]
        assert lp.shape == (10,) and np.isfinite(lp).all() and (lp <= 0).all()
        warned = [r for r in caplog.records if r.name == "treadle" and "over quota" in r.message]
        assert warned and all("tokens_per_minute" in r.message for r in warned)
        # the SDK waited what the server asked for (plus up to 25% spread) before
        # sending it again
        delays = [float(re.search(r"retrying in ([0-9.]+)s", r.message)[1]) for r in warned]
        assert 0 < delays[0] <= 1.1 * 1.25 and waited >= delays[0], (delays, waited)


def test_calls_in_flight_are_retried_until_they_fit(
    server: EmbeddedServer, caplog: pytest.LogCaptureFixture
) -> None:
    key = tenant_key(server, "busy")
    caplog.set_level(logging.WARNING, logger="treadle")
    with treadle.ServiceClient(server.address, api_key=key) as client:
        sampler = client.create_sampling_client(base_model=BASE)
        params = treadle.SamplingParams(max_tokens=24, seed=3)
        futures = [
            sampler.sample(treadle.ModelInput.from_ints([1, 2, 3]), 2, params) for _ in range(6)
        ]
        results = [f.result(timeout=60) for f in futures]
    assert all(len(r.sequences) == 2 for r in results)
    warned = [r.message for r in caplog.records if "max_calls_in_flight" in r.message]
    assert warned, "no call was ever refused: the test did not exercise the quota"


def test_ordered_calls_in_flight_do_not_deadlock(server: EmbeddedServer) -> None:
    """Calls sent ahead hold the only slot while the one they wait for is refused:
    that one is let in anyway, so they all finish."""
    key = tenant_key(server, "ahead")
    with treadle.ServiceClient(server.address, api_key=key) as client:
        trainer = client.create_lora_training_client(BASE, rank=2)
        futures = [trainer.forward_logprobs([_datum(4)]) for _ in range(6)]
        assert all(len(f.result(timeout=60).loss_fn_outputs) == 1 for f in futures)
        assert trainer.get_info().next_seq_id == 7


def test_tokens_per_request_is_final_and_takes_its_seq_id(
    server: EmbeddedServer, caplog: pytest.LogCaptureFixture
) -> None:
    key = tenant_key(server, "big")
    with treadle.ServiceClient(server.address, api_key=key) as client:
        assert client.get_server_info().max_tokens_per_request == 1000  # the quota shows
        trainer = client.create_lora_training_client(BASE, rank=2)
        caplog.set_level(logging.WARNING, logger="treadle")
        with pytest.raises(ResourceExhaustedError, match="max_tokens_per_request") as info:
            trainer.forward_backward([_datum(101)] * 10, "cross_entropy").result(timeout=30)
        assert info.value.retry_after_s is None
        assert not _retries(caplog)  # final: the SDK did not send it again
        # the refused call took its seq_id: the next one does not wait for it
        assert len(trainer.forward_logprobs([_datum(4)]).result(timeout=30).loss_fn_outputs) == 1


def test_max_models_and_a_tenant_override(server: EmbeddedServer) -> None:
    key = tenant_key(server, "many")
    with treadle.ServiceClient(server.address, api_key=key) as client:
        first = client.create_lora_training_client(BASE, rank=2)
        client.create_lora_training_client(BASE, rank=2)
        with pytest.raises(ResourceExhaustedError, match="max_models") as info:
            client.create_lora_training_client(BASE, rank=2)
        assert info.value.retry_after_s is None
        client.delete_model(first.model_id)
        client.create_lora_training_client(BASE, rank=2)  # room again
        assert server.ctx is not None
        with server.ctx.sessions() as s:
            tenancy.set_quota(s, tenancy.find_tenant(s, "many"), max_models=3)
            s.commit()
        server.ctx.quotas.refresh_s = 0  # pick the override up now, not within 30 s
        client.create_lora_training_client(BASE, rank=2)
        with pytest.raises(ResourceExhaustedError):
            client.create_lora_training_client(BASE, rank=2)


def test_one_tenant_over_quota_leaves_others_alone(
    server: EmbeddedServer, caplog: pytest.LogCaptureFixture
) -> None:
    hog, other = tenant_key(server, "hog"), tenant_key(server, "calm")
    with treadle.ServiceClient(server.address, api_key=hog) as client:
        trainer = client.create_lora_training_client(BASE, rank=2)
        trainer.forward_backward([_datum(100)] * 6, "cross_entropy").result()  # bucket empty
    caplog.set_level(logging.WARNING, logger="treadle")
    with treadle.ServiceClient(server.address, api_key=other, max_retries=0) as client:
        trainer = client.create_lora_training_client(BASE, rank=2)
        out = trainer.forward_backward([_datum(100)] * 5, "cross_entropy").result(timeout=30)
        assert len(out.loss_fn_outputs) == 5
        assert not _retries(caplog)  # admitted at once: never refused, never waited


def _retries(caplog: pytest.LogCaptureFixture) -> list[str]:
    """The SDK's warnings that it sends a call again (over quota, or unavailable)."""
    return [
        m for r in caplog.records if r.name == "treadle" and "retrying" in (m := r.getMessage())
    ]
