"""Bad input is refused loudly and changes nothing (DESIGN invariant 3): NOT_FOUND for
unknown ids, INVALID_ARGUMENT naming the field, the model exactly as before (weights,
accumulated gradients, optimizer state), and the rejected call's seq_id consumed."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

import treadle
from tests.helpers import char_ids, raw_channel
from treadle import _convert
from treadle.server.config import ServerConfig
from treadle.server.embedded import EmbeddedServer
from treadle.v1 import sampling_pb2, sampling_pb2_grpc, training_pb2, training_pb2_grpc

BASE = "tiny"
TIMEOUT = 30.0
VOCAB = 104  # the tiny model: 99 tokens rounded up to a multiple of 8
CONTEXT = 2048  # max_position_embeddings of the tiny model
SAMPLER_MAX_LEN = 256


@pytest.fixture(scope="module")
def server(
    tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path
) -> Iterator[EmbeddedServer]:
    config = ServerConfig(
        data_dir=tmp_path_factory.mktemp("bad_input") / "data",
        models={BASE: tiny_model_dir},
        port=0,
        threads=1,  # one engine thread: two would fight over 2 shared cores
        sampler_max_len=SAMPLER_MAX_LEN,
        sampler_slots=8,
    )
    srv = EmbeddedServer(config).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def channel(server: EmbeddedServer) -> Iterator[grpc.Channel]:
    ch = raw_channel(server)
    yield ch
    ch.close()


def _datum(text: str, model_input: list[int] | None = None, **inputs: object) -> treadle.Datum:
    """``text`` as a next-token datum; keyword arguments replace its parts."""
    ids = char_ids(text)
    loss_fn_inputs = {"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1), **inputs}
    tokens = ids[:-1] if model_input is None else model_input
    return treadle.Datum(
        model_input=treadle.ModelInput.from_ints(tokens), loss_fn_inputs=loss_fn_inputs
    )


GOOD1, GOOD2 = _datum("12+3=15"), _datum("hello world")
PROBE = [_datum("9*9=81"), _datum("abcdefg")]
ADAM = treadle.AdamParams(learning_rate=1e-2)


def _lp(tc: treadle.TrainingClient) -> list[np.ndarray]:
    out = tc.forward_logprobs(PROBE).result(timeout=TIMEOUT)
    return [o.logprobs for o in out.loss_fn_outputs]


# ---- NOT_FOUND ---------------------------------------------------------------------------


def test_unknown_model_is_not_found(service: treadle.ServiceClient, channel: grpc.Channel) -> None:
    with pytest.raises(treadle.NotFoundError, match="m-nope"):
        service.get_model_info("m-nope")
    with pytest.raises(treadle.NotFoundError):
        service.get_training_client("m-nope")
    with pytest.raises(treadle.NotFoundError):
        service.delete_model("m-nope")
    stub = training_pb2_grpc.TrainingServiceStub(channel)
    req = training_pb2.ForwardBackwardRequest(model_id="m-nope", seq_id=1, loss_fn=1)
    req.data.extend(_convert.datums_to_wire([GOOD1]))
    with pytest.raises(grpc.RpcError) as err:
        stub.ForwardBackward(req, timeout=TIMEOUT)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.RpcError) as err:
        stub.ListCheckpoints(training_pb2.ListCheckpointsRequest(model_id="m-nope"))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(treadle.NotFoundError):
        service.create_sampling_client(weights="treadle://m-nope/latest")
    with pytest.raises(treadle.NotFoundError, match="base_model"):
        service.create_lora_training_client("no-such-base", rank=4)
    with pytest.raises(treadle.NotFoundError, match="base_model"):
        service.create_sampling_client(base_model="no-such-base")


def test_unknown_version_is_not_found(service: treadle.ServiceClient) -> None:
    tc = service.create_lora_training_client(BASE, rank=4)
    with pytest.raises(treadle.NotFoundError, match="v/7"):
        service.create_sampling_client(weights=f"treadle://{tc.model_id}/v/7")
    v0 = service.create_sampling_client(weights=f"treadle://{tc.model_id}/v/0")
    assert v0.sample(char_ids("ab"), 1, treadle.SamplingParams(max_tokens=2)).result(TIMEOUT)
    keep = 4  # the server default: versions beyond the latest 4 are released
    for _ in range(keep):
        tc.forward_backward([GOOD1])
        tc.optim_step(ADAM)
        synced = tc.sync_weights()
    assert synced.version == keep  # waits for the last sync
    assert tc.get_info().version == keep
    with pytest.raises(treadle.NotFoundError):
        v0.sample(char_ids("ab"), 1, treadle.SamplingParams(max_tokens=2)).result(TIMEOUT)
    with pytest.raises(treadle.NotFoundError):
        service.create_sampling_client(weights=f"treadle://{tc.model_id}/v/0")
    v1 = service.create_sampling_client(weights=f"treadle://{tc.model_id}/v/1")
    assert v1.version == 1


def test_unknown_sampler_is_not_found(channel: grpc.Channel) -> None:
    stub = sampling_pb2_grpc.SamplingServiceStub(channel)
    req = sampling_pb2.SampleRequest(
        sampler_id="s-nope", num_samples=1, params=sampling_pb2.SamplingParams(max_tokens=2)
    )
    _convert.prompt_to_wire(treadle.ModelInput.from_ints(char_ids("ab")), req.prompt)
    with pytest.raises(grpc.RpcError) as err:
        stub.Sample(req, timeout=TIMEOUT)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert "sampler" in err.value.details()


# ---- INVALID_ARGUMENT on training calls: nothing changes ----------------------------------


def _raw_fb(loss_fn: int, data: list[treadle.Datum]) -> Callable:
    """A ForwardBackward the SDK would refuse locally, sent on the client's seq_ids."""

    def call(tc: treadle.TrainingClient) -> treadle.APIFuture:
        req = training_pb2.ForwardBackwardRequest(model_id=tc.model_id, loss_fn=loss_fn)
        req.data.extend(_convert.datums_to_wire(data))
        req.seq_id = tc._take_seq()
        service = tc._service
        return treadle.APIFuture(
            service._caller.call(
                service._training.ForwardBackward, req, _convert.forward_output_from_wire
            )
        )

    return call


BAD_TRAINING_CALLS: dict[str, tuple[Callable, str, type]] = {
    "token_outside_vocab": (
        lambda tc: tc.forward_backward([_datum("abcd", model_input=[5, 6, VOCAB])]),
        "model_input",
        treadle.InvalidArgumentError,
    ),
    "negative_token": (
        lambda tc: tc.forward_logprobs([_datum("abcd", model_input=[5, -1, 7])]),
        "model_input",
        treadle.InvalidArgumentError,
    ),
    "target_outside_vocab": (
        lambda tc: tc.forward_backward([_datum("abcd", target_tokens=[5, 6, 999])]),
        "target_tokens",
        treadle.InvalidArgumentError,
    ),
    "lengths_disagree": (
        lambda tc: tc.forward_backward([_datum("abcd", weights=[1.0, 1.0])]),
        "weights",
        treadle.InvalidArgumentError,
    ),
    "second_datum_bad": (
        lambda tc: tc.forward_backward([GOOD2, _datum("abcd", weights=[1.0] * 5)]),
        "data[1]",
        treadle.InvalidArgumentError,
    ),
    "nan_weight": (
        lambda tc: tc.forward_backward([_datum("abcd", weights=[1.0, float("nan"), 1.0])]),
        "weights",
        treadle.InvalidArgumentError,
    ),
    "empty_batch": (
        lambda tc: tc.forward_backward([]),
        "data",
        treadle.InvalidArgumentError,
    ),
    "longer_than_context": (
        lambda tc: tc.forward_backward([_datum("ab" * (CONTEXT // 2 + 1))]),
        "model_input",
        treadle.InvalidArgumentError,
    ),
    # issue 21: the sampler refuses a prompt that does not fit its context
    # (sampler_max_len here, below the model's positions); training calls alike
    "longer_than_sampler_context_fb": (
        lambda tc: tc.forward_backward([GOOD1, _datum("ab" * (SAMPLER_MAX_LEN // 2 + 22) + "a")]),
        f"data[1].model_input: {SAMPLER_MAX_LEN + 44} tokens exceed the context of {SAMPLER_MAX_LEN}",
        treadle.InvalidArgumentError,
    ),
    "longer_than_sampler_context_logprobs": (
        lambda tc: tc.forward_logprobs([_datum("ab" * (SAMPLER_MAX_LEN // 2 + 22) + "a")]),
        f"data[0].model_input: {SAMPLER_MAX_LEN + 44} tokens exceed the context of {SAMPLER_MAX_LEN}",
        treadle.InvalidArgumentError,
    ),
    "missing_loss_input": (
        lambda tc: tc.forward_backward([GOOD2], "ppo"),
        "advantages",
        treadle.InvalidArgumentError,
    ),
    "unknown_loss_config_key": (
        lambda tc: tc.forward_backward([GOOD2], "cross_entropy", {"clip_eps": 0.2}),
        "loss_fn_config.clip_eps",
        treadle.InvalidArgumentError,
    ),
    "negative_temperature": (
        lambda tc: tc.forward_logprobs(PROBE, temperature=-1.0),
        "temperature",
        treadle.InvalidArgumentError,
    ),
    "unknown_loss_on_the_wire": (
        _raw_fb(99, [GOOD2]),
        "loss_fn",
        treadle.InvalidArgumentError,
    ),
    "unspecified_loss_on_the_wire": (
        _raw_fb(0, [GOOD2]),
        "loss_fn",
        treadle.InvalidArgumentError,
    ),
    "negative_learning_rate": (
        lambda tc: tc.optim_step(treadle.AdamParams(learning_rate=-1e-3)),
        "learning_rate",
        treadle.InvalidArgumentError,
    ),
    "beta1_of_one": (
        lambda tc: tc.optim_step(treadle.AdamParams(beta1=1.0)),
        "beta1",
        treadle.InvalidArgumentError,
    ),
    "bad_checkpoint_name": (
        lambda tc: tc.save_state("../escape"),
        "name",
        treadle.InvalidArgumentError,
    ),
    "malformed_state_path": (
        lambda tc: tc.load_state("/etc/passwd"),
        "path",
        treadle.InvalidArgumentError,
    ),
    "unknown_state_path": (
        lambda tc: tc.load_state(f"treadle://{tc.model_id}/state/never-saved"),
        "path",
        treadle.NotFoundError,
    ),
}


def _two_models(service: treadle.ServiceClient) -> tuple[treadle.TrainingClient, ...]:
    """Twins (same seed), each one step in and holding one accumulated gradient."""
    twins = (
        service.create_lora_training_client(BASE, rank=4, seed=7),
        service.create_lora_training_client(BASE, rank=4, seed=7),
    )
    for tc in twins:
        tc.forward_backward([GOOD1])
        tc.optim_step(ADAM)
        tc.forward_backward([GOOD2]).result(timeout=TIMEOUT)
    return twins


@pytest.mark.parametrize("case", sorted(BAD_TRAINING_CALLS))
def test_bad_training_call_changes_nothing(service: treadle.ServiceClient, case: str) -> None:
    make_call, field, error = BAD_TRAINING_CALLS[case]
    tc, twin = _two_models(service)
    before = _lp(tc)
    seq_before = tc.get_info().next_seq_id

    fut = make_call(tc)
    with pytest.raises(error) as err:
        fut.result(timeout=TIMEOUT)
    assert field in err.value.message, err.value.message

    info = tc.get_info()
    assert info.next_seq_id == seq_before + 1  # the rejected call took its seq_id
    assert info.version == 1
    for a, b in zip(before, _lp(tc), strict=True):
        np.testing.assert_array_equal(a, b)
    # the accumulated gradient and the optimizer state are untouched: the next step
    # equals the twin's, which never saw the bad call
    step, twin_step = tc.optim_step(ADAM), twin.optim_step(ADAM)
    assert step.result(TIMEOUT).metrics == twin_step.result(TIMEOUT).metrics
    for a, b in zip(_lp(tc), _lp(twin), strict=True):
        np.testing.assert_array_equal(a, b)
    # later seq_ids kept flowing: bad call, forward, step, forward
    assert tc.get_info().next_seq_id == seq_before + 4


def test_unknown_loss_name_is_refused_before_taking_a_seq_id(
    service: treadle.ServiceClient,
) -> None:
    tc = service.create_lora_training_client(BASE, rank=4)
    with pytest.raises(treadle.InvalidArgumentError, match="loss_fn"):
        tc.forward_backward([GOOD1], "no_such_loss")
    # no seq_id was spent locally, so this call is not left waiting for a gap
    out = tc.forward_backward([GOOD1]).result(timeout=TIMEOUT)
    assert out.metrics["loss:sum"] > 0
    assert tc.get_info().next_seq_id == 2


def test_repeat_of_a_rejected_call_answers_the_same_error(channel: grpc.Channel) -> None:
    stub = training_pb2_grpc.TrainingServiceStub(channel)
    mid = stub.CreateModel(training_pb2.CreateModelRequest(base_model=BASE, lora_rank=4)).model_id
    req = training_pb2.ForwardBackwardRequest(model_id=mid, seq_id=1, loss_fn=1)  # empty batch
    codes = []
    for _ in range(2):
        with pytest.raises(grpc.RpcError) as err:
            stub.ForwardBackward(req, timeout=TIMEOUT)
        codes.append((err.value.code(), err.value.details()))
    assert codes[0] == codes[1]
    assert codes[0][0] == grpc.StatusCode.INVALID_ARGUMENT and "data" in codes[0][1]
    info = stub.GetModelInfo(training_pb2.GetModelInfoRequest(model_id=mid))
    assert info.next_seq_id == 2


# ---- INVALID_ARGUMENT on sampling -----------------------------------------------------------

P = treadle.SamplingParams
BAD_SAMPLES: dict[str, tuple[list[int], int, treadle.SamplingParams, str]] = {
    "negative_max_tokens": (char_ids("ab"), 1, P(max_tokens=-1), "max_tokens"),
    "top_p_above_one": (char_ids("ab"), 1, P(top_p=1.5), "top_p"),
    "top_p_negative": (char_ids("ab"), 1, P(top_p=-0.1), "top_p"),
    "top_p_zero": (char_ids("ab"), 1, P(top_p=0.0), "top_p"),  # explicit 0 is not "off" (issue 21)
    "stop_neither_text_nor_token": (char_ids("ab"), 1, P(stop=[1.5]), "stop[0]"),  # type: ignore[list-item]
    "top_k_below_minus_one": (char_ids("ab"), 1, P(top_k=-2), "top_k"),
    "negative_temperature": (char_ids("ab"), 1, P(temperature=-0.5), "temperature"),
    "prompt_longer_than_context": (char_ids("a" * SAMPLER_MAX_LEN), 1, P(max_tokens=1), "prompt"),
    "prompt_plus_max_tokens_too_long": (
        char_ids("a" * 200),
        1,
        P(max_tokens=SAMPLER_MAX_LEN),
        "max_tokens",
    ),
    "prompt_token_outside_vocab": ([5, VOCAB + 3], 1, P(), "prompt"),
    "empty_prompt": ([], 1, P(), "prompt"),
    "too_many_samples": (char_ids("ab"), 9, P(), "num_samples"),
    "stop_token_outside_vocab": (char_ids("ab"), 1, P(stop=[VOCAB]), "stop"),
}


@pytest.mark.parametrize("case", sorted(BAD_SAMPLES))
def test_bad_sample_names_the_field(service: treadle.ServiceClient, case: str) -> None:
    prompt, n, params, field = BAD_SAMPLES[case]
    sampler = service.create_sampling_client(base_model=BASE)
    with pytest.raises(treadle.InvalidArgumentError) as err:
        sampler.sample(prompt, n, params).result(timeout=TIMEOUT)
    assert field in err.value.message, err.value.message
    # the sampler still serves good requests
    ok = sampler.sample(char_ids("ab"), 1, P(max_tokens=2, seed=0)).result(timeout=TIMEOUT)
    assert len(ok.sequences) == 1


# ---- a sampler's placement ------------------------------------------------------------------


def test_sampler_placement_on_a_server_without_a_pool(
    server: EmbeddedServer,
    service: treadle.ServiceClient,
    channel: grpc.Channel,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An embedded server has no sampler workers: ``pool`` is refused FAILED_PRECONDITION
    naming the base (nothing is made), at once: the SDK sends it once (UNAVAILABLE
    had it retried for about 6 s); ``colocated`` and ``auto`` sample here; a value
    outside the enum is INVALID_ARGUMENT naming ``placement``. The choice is kept."""
    from treadle.common.db import models as db

    tc = service.create_lora_training_client(BASE, rank=2, seed=0)
    with server.ctx.session() as s:
        before = s.query(db.Sampler).count()
    no_pool = f"no sampler worker serves base model '{BASE}' \\(the sampler's placement pool"
    caller = service._caller
    attempts: list[int] = []
    send = caller._attempt

    def counted(call: Any, *, attempt: int, waited: float) -> None:
        attempts.append(attempt)
        send(call, attempt=attempt, waited=waited)

    monkeypatch.setattr(caller, "_attempt", counted)
    stub = sampling_pb2_grpc.SamplingServiceStub(channel)
    for source in ({"base_model": BASE}, {"weights": f"treadle://{tc.model_id}/latest"}):
        attempts.clear()
        with pytest.raises(treadle.FailedPreconditionError, match=no_pool):
            service.create_sampling_client(**source, placement="pool")  # type: ignore[arg-type]
        assert attempts == [0]  # sent once: not retried
        request = sampling_pb2.CreateSamplerRequest(
            **source, placement=sampling_pb2.SAMPLER_PLACEMENT_POOL
        )
        with pytest.raises(grpc.RpcError) as err:
            stub.CreateSampler(request, timeout=TIMEOUT)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION, err.value.details()
    monkeypatch.undo()
    with server.ctx.session() as s:
        assert s.query(db.Sampler).count() == before
    for placement in ("colocated", "auto"):
        sampler = service.create_sampling_client(
            weights=f"treadle://{tc.model_id}/latest", placement=placement
        )
        res = sampler.sample(char_ids("ab"), 1, P(max_tokens=2, seed=0)).result(timeout=TIMEOUT)
        assert res.sequences[0].token_versions() == [0, 0]
        with server.ctx.session() as s:
            row = s.get(db.Sampler, sampler.sampler_id)
            assert row is not None and row.placement == placement
    with pytest.raises(grpc.RpcError) as err:
        stub.CreateSampler(
            sampling_pb2.CreateSamplerRequest(base_model=BASE, placement=7),  # type: ignore[arg-type]
            timeout=TIMEOUT,
        )
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("placement: "), err.value.details()
    with pytest.raises(treadle.InvalidArgumentError, match="placement: 'pooled'"):
        service.create_sampling_client(base_model=BASE, placement="pooled")


def test_a_syncs_sampler_placement_on_a_server_without_a_pool(
    server: EmbeddedServer,
    service: treadle.ServiceClient,
    channel: grpc.Channel,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``sync_weights(placement=...)`` takes the same values and the same checks as
    ``create_sampling_client``: ``pool`` on an embedded server (no sampler workers)
    refuses the whole sync with the same message naming the base model, as
    FAILED_PRECONDITION (no version published, no sampler made, its ``seq_id`` taken
    so the next call runs, and the SDK does not send it again); ``colocated`` and
    ``auto`` sample here and are kept with the sampler; a value outside the enum, or
    a placement on a sync that makes no sampler, is INVALID_ARGUMENT naming ``placement``."""
    from treadle.common.db import models as db

    tc = service.create_lora_training_client(BASE, rank=2, seed=0)

    def rows() -> tuple[int, int]:
        with server.ctx.session() as s:
            versions = s.query(db.WeightVersion).filter_by(model_id=tc.model_id).count()
            return versions, s.query(db.Sampler).filter_by(model_id=tc.model_id).count()

    caplog.set_level(logging.WARNING, logger="treadle")
    no_pool = f"no sampler worker serves base model '{BASE}' \\(the sampler's placement pool"
    for refused in (
        tc.sync_weights(placement="pool"),
        tc.save_weights_and_get_sampling_client(placement="pool"),
    ):
        with pytest.raises(treadle.FailedPreconditionError, match=no_pool):
            refused.sampler_id  # noqa: B018 - raises the sync's error
    assert rows() == (0, 0)
    assert tc.get_info().next_seq_id == 3  # both refusals took their seq_id
    made = {
        "colocated": tc.sync_weights(placement="colocated"),
        "auto": tc.save_weights_and_get_sampling_client(placement="auto"),
    }
    for placement, sampler in made.items():
        res = sampler.sample(char_ids("ab"), 1, P(max_tokens=2, seed=0)).result(timeout=TIMEOUT)
        assert res.sequences[0].token_versions() == [0, 0]
        with server.ctx.session() as s:
            row = s.get(db.Sampler, sampler.sampler_id)
            assert row is not None and row.placement == placement
    assert rows() == (1, 2)
    # answered, not lost: the SDK never sent the refused syncs again
    assert not [r for r in caplog.records if "again" in r.getMessage()], caplog.text
    with pytest.raises(treadle.InvalidArgumentError, match="placement: 'pooled'"):
        tc.sync_weights(placement="pooled")  # refused before it takes a seq_id
    stub = training_pb2_grpc.TrainingServiceStub(channel)
    mid = stub.CreateModel(training_pb2.CreateModelRequest(base_model=BASE, lora_rank=2)).model_id
    for seq_id, request in enumerate(
        (
            training_pb2.SyncWeightsRequest(create_sampler=True, placement=7),  # type: ignore[arg-type]
            training_pb2.SyncWeightsRequest(placement=sampling_pb2.SAMPLER_PLACEMENT_COLOCATED),
        ),
        start=1,
    ):
        request.model_id, request.seq_id = mid, seq_id
        with pytest.raises(grpc.RpcError) as err:
            stub.SyncWeights(request, timeout=TIMEOUT)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details().startswith("placement: "), err.value.details()
    info = stub.GetModelInfo(training_pb2.GetModelInfoRequest(model_id=mid))
    assert info.next_seq_id == 3
