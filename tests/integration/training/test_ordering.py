"""Ordered, exactly-once per model (DESIGN invariant 1, contract "Sequence numbers"),
driven with raw gRPC requests so seq_ids, repeats and arrival order are ours."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

import treadle
from tests.helpers import char_ids, next_token_datum, raw_channel
from treadle import _convert
from treadle.server.config import ServerConfig
from treadle.server.embedded import EmbeddedServer
from treadle.v1 import training_pb2, training_pb2_grpc

BASE = "tiny"
TIMEOUT = 30.0


def _start(tmp: Path, model_dir: Path, **overrides: object) -> EmbeddedServer:
    # one engine thread: two would fight over 2 shared cores
    config = ServerConfig(
        data_dir=tmp / "data", models={BASE: model_dir}, port=0, threads=1, **overrides
    )  # type: ignore[arg-type]
    return EmbeddedServer(config).start()


@pytest.fixture(scope="module")
def server(
    tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path
) -> Iterator[EmbeddedServer]:
    srv = _start(tmp_path_factory.mktemp("ordering"), tiny_model_dir)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def stub(server: EmbeddedServer) -> Iterator[training_pb2_grpc.TrainingServiceStub]:
    channel = raw_channel(server)
    yield training_pb2_grpc.TrainingServiceStub(channel)
    channel.close()


# ---- raw requests ------------------------------------------------------------------------

TEXTS = ("12+3=15", "9*9=81", "hello world")


def _datum(text: str) -> treadle.Datum:
    return next_token_datum(char_ids(text))


def _fb(model_id: str, seq: int, text: str = TEXTS[0]) -> training_pb2.ForwardBackwardRequest:
    req = training_pb2.ForwardBackwardRequest(
        model_id=model_id, seq_id=seq, loss_fn=_convert.loss_fn_to_wire("cross_entropy")
    )
    req.data.extend(_convert.datums_to_wire([_datum(text)]))
    return req


def _fl(model_id: str, seq: int) -> training_pb2.ForwardLogprobsRequest:
    req = training_pb2.ForwardLogprobsRequest(model_id=model_id, seq_id=seq)
    req.data.extend(_convert.datums_to_wire([_datum(t) for t in TEXTS]))
    return req


def _os(model_id: str, seq: int, lr: float = 1e-2) -> training_pb2.OptimStepRequest:
    adam = _convert.adam_to_wire(treadle.AdamParams(learning_rate=lr))
    return training_pb2.OptimStepRequest(model_id=model_id, seq_id=seq, adam_params=adam)


def _logprobs(out: training_pb2.ForwardOutput) -> list[np.ndarray]:
    return [_convert.forward_output_from_wire(out).loss_fn_outputs[i].logprobs for i in range(3)]


def _new_model(stub: training_pb2_grpc.TrainingServiceStub, seed: int = 0) -> str:
    info = stub.CreateModel(
        training_pb2.CreateModelRequest(base_model=BASE, lora_rank=4, seed=seed), timeout=TIMEOUT
    )
    assert info.next_seq_id == 1
    return info.model_id


def _info(stub: training_pb2_grpc.TrainingServiceStub, model_id: str) -> training_pb2.ModelInfo:
    return stub.GetModelInfo(training_pb2.GetModelInfoRequest(model_id=model_id), timeout=TIMEOUT)


def _control(stub: training_pb2_grpc.TrainingServiceStub, texts: tuple[str, ...]) -> tuple:
    """A fresh model (same seed) that gets each forward_backward once, then one step
    and a forward_logprobs: the reference a correct de-duplication must equal."""
    mid = _new_model(stub)
    for i, text in enumerate(texts, start=1):
        stub.ForwardBackward(_fb(mid, i, text), timeout=TIMEOUT)
    n = len(texts)
    step = stub.OptimStep(_os(mid, n + 1), timeout=TIMEOUT)
    lp = _logprobs(stub.ForwardLogprobs(_fl(mid, n + 2), timeout=TIMEOUT))
    return step, lp


def _assert_same(a: list[np.ndarray], b: list[np.ndarray]) -> None:
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x, y)


# ---- tests ------------------------------------------------------------------------------------


def test_retry_returns_the_recorded_result_and_applies_once(
    stub: training_pb2_grpc.TrainingServiceStub,
) -> None:
    mid = _new_model(stub)
    fb1 = stub.ForwardBackward(_fb(mid, 1), timeout=TIMEOUT)
    fb1_again = stub.ForwardBackward(_fb(mid, 1), timeout=TIMEOUT)
    assert fb1_again == fb1
    step = stub.OptimStep(_os(mid, 2), timeout=TIMEOUT)
    step_again = stub.OptimStep(_os(mid, 2), timeout=TIMEOUT)
    assert step.step == 1 and step_again == step
    info = _info(stub, mid)
    assert info.version == 1 and info.next_seq_id == 3
    lp = _logprobs(stub.ForwardLogprobs(_fl(mid, 3), timeout=TIMEOUT))

    ctl_step, ctl_lp = _control(stub, (TEXTS[0],))
    # Adam's update hardly sees a doubled gradient; its norm does
    assert step.metrics["grad_norm:value"] == ctl_step.metrics["grad_norm:value"]
    assert step.metrics == ctl_step.metrics
    _assert_same(lp, ctl_lp)


def test_repeats_while_pending_share_one_application(
    stub: training_pb2_grpc.TrainingServiceStub,
) -> None:
    mid = _new_model(stub)
    a = stub.ForwardBackward.future(_fb(mid, 2, TEXTS[1]), timeout=TIMEOUT)
    b = stub.ForwardBackward.future(_fb(mid, 2, TEXTS[1]), timeout=TIMEOUT)
    step_f = stub.OptimStep.future(_os(mid, 3), timeout=TIMEOUT)
    time.sleep(0.3)
    assert not (a.done() or b.done() or step_f.done())  # all wait for seq 1
    stub.ForwardBackward(_fb(mid, 1, TEXTS[0]), timeout=TIMEOUT)
    assert a.result() == b.result()
    step = step_f.result()
    lp = _logprobs(stub.ForwardLogprobs(_fl(mid, 4), timeout=TIMEOUT))
    ctl_step, ctl_lp = _control(stub, TEXTS[:2])
    assert step.metrics == ctl_step.metrics
    _assert_same(lp, ctl_lp)


def test_repeat_with_another_payload_is_failed_precondition(
    stub: training_pb2_grpc.TrainingServiceStub,
) -> None:
    mid = _new_model(stub)
    stub.ForwardBackward(_fb(mid, 1, TEXTS[0]), timeout=TIMEOUT)
    with pytest.raises(grpc.RpcError) as err:  # applied, then reused
        stub.ForwardBackward(_fb(mid, 1, TEXTS[1]), timeout=TIMEOUT)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "seq_id" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:  # another kind of call, same seq_id
        stub.OptimStep(_os(mid, 1), timeout=TIMEOUT)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION

    pending = stub.ForwardBackward.future(_fb(mid, 3, TEXTS[1]), timeout=TIMEOUT)
    time.sleep(0.2)
    with pytest.raises(grpc.RpcError) as err:  # still waiting for seq 2, then reused
        stub.ForwardBackward(_fb(mid, 3, TEXTS[2]), timeout=TIMEOUT)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert not pending.done()
    stub.ForwardBackward(_fb(mid, 2, TEXTS[0]), timeout=TIMEOUT)
    first = pending.result()
    # the pending call ran with its own payload: a repeat of it returns the same answer
    assert stub.ForwardBackward(_fb(mid, 3, TEXTS[1]), timeout=TIMEOUT) == first
    assert _info(stub, mid).next_seq_id == 4


def test_calls_sent_out_of_order_are_applied_in_order(
    stub: training_pb2_grpc.TrainingServiceStub,
) -> None:
    mid = _new_model(stub)
    # sent last-first: forward_logprobs(4), optim_step(3), forward_backward(2), (1)
    fl = stub.ForwardLogprobs.future(_fl(mid, 4), timeout=TIMEOUT)
    step_f = stub.OptimStep.future(_os(mid, 3), timeout=TIMEOUT)
    fb2 = stub.ForwardBackward.future(_fb(mid, 2, TEXTS[1]), timeout=TIMEOUT)
    time.sleep(0.3)
    assert not (fl.done() or step_f.done() or fb2.done())
    assert _info(stub, mid).next_seq_id == 1
    stub.ForwardBackward(_fb(mid, 1, TEXTS[0]), timeout=TIMEOUT)
    step, lp = step_f.result(), _logprobs(fl.result())
    fb2.result()
    assert step.step == 1
    ctl_step, ctl_lp = _control(stub, TEXTS[:2])
    assert step.metrics == ctl_step.metrics  # both gradients were in before the step
    _assert_same(lp, ctl_lp)  # and the forward after it saw the new weights
    assert _info(stub, mid).next_seq_id == 5


def test_a_gap_times_out_with_aborted(tmp_path: Path, tiny_model_dir: Path) -> None:
    srv = _start(tmp_path, tiny_model_dir, gap_timeout_s=1.0)
    channel = raw_channel(srv)
    try:
        stub = training_pb2_grpc.TrainingServiceStub(channel)
        mid = _new_model(stub)
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            stub.ForwardBackward(_fb(mid, 2), timeout=TIMEOUT)
        waited = time.monotonic() - t0
        assert err.value.code() == grpc.StatusCode.ABORTED
        assert "seq_id" in err.value.details()
        assert "resync()" in err.value.details()  # what to do about it
        assert 0.9 <= waited < 10
        assert _info(stub, mid).next_seq_id == 1
        # the aborted call was never applied: seq 2 is still free once seq 1 arrives
        stub.ForwardBackward(_fb(mid, 1), timeout=TIMEOUT)
        stub.ForwardBackward(_fb(mid, 2), timeout=TIMEOUT)
        assert _info(stub, mid).next_seq_id == 3
    finally:
        channel.close()
        srv.stop()


def test_model_info_reports_next_and_checkpoint_seq_ids(server: EmbeddedServer) -> None:
    with treadle.ServiceClient(server.address) as service:
        tc = service.create_lora_training_client(BASE, rank=4)
        info = tc.get_info()
        assert (info.next_seq_id, info.last_checkpoint_seq_id) == (1, 0)
        tc.forward_backward([_datum(TEXTS[0])])
        tc.optim_step(treadle.AdamParams(learning_rate=1e-2))
        saved = tc.save_state("ordering-ckpt").result(timeout=TIMEOUT)
        assert saved.seq_id == 3 and saved.step == 1
        tc.forward_backward([_datum(TEXTS[1])]).result(timeout=TIMEOUT)
        info = tc.get_info()
        assert info.next_seq_id == 5
        assert info.last_checkpoint_seq_id == 3
        assert info.version == 1


def test_sdk_calls_in_flight_together_and_barriers(server: EmbeddedServer) -> None:
    with treadle.ServiceClient(server.address) as service:
        tc = service.create_lora_training_client(BASE, rank=4, seed=4)
        data = [_datum(t) for t in TEXTS]
        before = tc.forward_logprobs(data)
        fb = tc.forward_backward(data[:1])
        step = tc.optim_step(treadle.AdamParams(learning_rate=2e-2))
        after = tc.forward_logprobs(data)  # sent behind the barrier, never waited for
        fb2 = tc.forward_backward(data[1:2])
        step2 = tc.optim_step(treadle.AdamParams(learning_rate=2e-2))
        assert step2.result(timeout=TIMEOUT).step == 2
        assert step.result(timeout=TIMEOUT).step == 1
        fb_out, fb2_out = fb.result(timeout=TIMEOUT), fb2.result(timeout=TIMEOUT)
        b = before.result(timeout=TIMEOUT).loss_fn_outputs
        a = after.result(timeout=TIMEOUT).loss_fn_outputs
        # forward_backward saw the weights before the step; forward_logprobs after it.
        # Not bit-equal: a batch of one and a batch of four run differently blocked
        # matmuls (on an AMD EPYC they differed by 5e-7), so within 1e-5, far
        # below what the step changed.
        np.testing.assert_allclose(fb_out.loss_fn_outputs[0].logprobs, b[0].logprobs, atol=1e-5)
        np.testing.assert_allclose(fb2_out.loss_fn_outputs[0].logprobs, a[1].logprobs, atol=1e-5)
        assert np.abs(a[1].logprobs - b[1].logprobs).max() > 1e-3
        assert a[0].logprobs.sum() > b[0].logprobs.sum()  # the trained datum improved
        final = tc.forward_logprobs(data).result(timeout=TIMEOUT).loss_fn_outputs
        assert not np.array_equal(final[0].logprobs, a[0].logprobs)
        assert tc.get_info().next_seq_id == 8
