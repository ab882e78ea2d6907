"""The tinker wire <-> treadle domain conversion, against the tinker SDK's own
encoders and decoders (our tinker_public.proto is written independently; these
check that the bytes agree both ways)."""

from __future__ import annotations

import numpy as np
import pytest

tinker = pytest.importorskip("tinker")
zstandard = pytest.importorskip("zstandard")

from tinker import types as T  # noqa: E402
from tinker.proto import tinker_public_pb2 as sdk_pb  # noqa: E402
from tinker.proto.request_conv import forward_backward_request_to_proto  # noqa: E402
from tinker.proto.response_conv import (  # noqa: E402
    deserialize_forward_backward_output,
    deserialize_sample_response,
)

from treadle.common.engine.domain import (  # noqa: E402
    ForwardBackwardOp,
    ForwardLogprobsOp,
    ForwardResult,
    PromptLogprobs,
    SampleResult,
    SequenceResult,
)
from treadle.errors import InvalidArgumentError  # noqa: E402
from treadle.server.http import wire  # noqa: E402


def _request(**config: float) -> bytes:
    datum = T.Datum(
        model_input=T.ModelInput.from_ints([1, 2, 3]),
        loss_fn_inputs={
            "target_tokens": T.TensorData.from_numpy(np.array([2, 3, 4], np.int64)),
            "logprobs": T.TensorData.from_numpy(np.array([-1, -2, -3], np.float32)),
            "advantages": T.TensorData.from_numpy(np.array([0.5, 0, -0.5], np.float32)),
        },
    )
    request = T.ForwardBackwardRequest(
        model_id="m-1",
        seq_id=4,
        forward_backward_input=T.ForwardBackwardInput(
            data=[datum], loss_fn="ppo", loss_fn_config=config or None
        ),
    )
    return forward_backward_request_to_proto(request).SerializeToString()


def test_sdk_request_parses_into_the_engine_op() -> None:
    msg = wire.parse_forward_backward(_request(clip_low_threshold=0.8))
    op = wire.forward_backward_op(msg)
    assert isinstance(op, ForwardBackwardOp)
    assert (msg.model_id, msg.seq_id, op.loss_fn) == ("m-1", 4, "ppo")
    assert op.loss_config == {"clip_low_threshold": pytest.approx(0.8)}
    d = op.data[0]
    assert d.tokens.tolist() == [1, 2, 3]
    assert d.inputs["target_tokens"].tolist() == [2, 3, 4]
    assert d.inputs["advantages"].tolist() == [0.5, 0, -0.5]


def test_zstd_bodies_and_forward_only() -> None:
    body = zstandard.ZstdCompressor().compress(_request())
    msg = wire.parse_forward_backward(wire.decompress(body, "zstd"))
    msg.forward_only = True
    op = wire.forward_backward_op(msg)
    assert isinstance(op, ForwardLogprobsOp)
    assert set(op.data[0].inputs) == {"target_tokens"}  # loss inputs stay on the client
    with pytest.raises(InvalidArgumentError, match="Content-Encoding"):
        wire.decompress(body, "br")


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda m: m.data[0].loss_fn_inputs["logprobs"].ClearField("dense"), "logprobs.shape"),
        (lambda m: setattr(m.data[0].loss_fn_inputs["logprobs"], "dtype", 9), "logprobs.dtype"),
        (lambda m: m.data[0].loss_fn_inputs["logprobs"].shape.append(7), "logprobs.shape"),
        (lambda m: m.data[0].model_input.add().image.SetInParent(), "model_input.chunks[1]"),
        (lambda m: m.ClearField("data"), "data: empty"),
        (
            lambda m: (
                m.loss_fn_config_v2["mode"].SetInParent()
                or setattr(m.loss_fn_config_v2["mode"], "text", "x")
            ),
            "loss_fn_config.mode",
        ),
    ],
)
def test_bad_requests_name_the_field(mutate, field) -> None:  # type: ignore[no-untyped-def]
    msg = sdk_pb.ForwardBackwardRequest.FromString(_request())
    mutate(msg)
    ours = wire.parse_forward_backward(msg.SerializeToString())
    with pytest.raises(InvalidArgumentError, match=field.replace("[", r"\[").replace("]", r"\]")):
        wire.forward_backward_op(ours)


def test_outputs_decode_in_the_sdk() -> None:
    result = ForwardResult(
        (np.array([-1.0, -2.0], np.float32), np.array([-0.5], np.float32)),
        {"loss:sum": 3.5, "tokens": 3.0},
    )
    out = deserialize_forward_backward_output(wire.forward_output(result))
    assert [o["logprobs"].tolist() for o in out.loss_fn_outputs] == [[-1.0, -2.0], [-0.5]]
    assert out.metrics == {"loss:sum": 3.5, "tokens:sum": 3.0}
    seq = SequenceResult(
        np.array([5, 6, 7]), np.array([-0.1, -0.2, -0.3], np.float32), "length", ((0, 3, 2),)
    )
    sample = deserialize_sample_response(wire.sample_response(SampleResult((seq,))))
    assert sample.sequences[0].tokens == [5, 6, 7]
    assert sample.sequences[0].stop_reason == "length"
    assert sample.sequences[0].logprobs == pytest.approx([-0.1, -0.2, -0.3])


def _sample_body(**extra: object) -> dict[str, object]:
    body: dict[str, object] = {
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3, 4]}]},
        "sampling_params": {"max_tokens": 1},
        "num_samples": 1,
    }
    body.update(extra)
    return body


def test_prompt_logprobs_reach_the_sdk_in_its_format() -> None:
    """NaN / None at the first position; the top k as (token, logprob) pairs, most
    likely first, tinker's filler in the unscored row; last_n blanks the rest."""
    seq = SequenceResult(np.array([5]), np.array([-0.1], np.float32), "length", ((0, 1, 0),))
    scores = PromptLogprobs(
        logprobs=np.array([np.nan, -1.5, -2.5, -0.5], np.float32),
        topk_ids=np.array([[-1, -1], [7, 2], [9, 3], [4, 1]], np.int64),
        topk_logprobs=np.array(
            [[np.nan, np.nan], [-0.2, -1.5], [-0.1, -2.5], [-0.5, -3.0]], np.float32
        ),
    )
    result = SampleResult((seq,), prompt=scores)
    got = deserialize_sample_response(wire.sample_response(result))
    assert got.prompt_logprobs == pytest.approx([None, -1.5, -2.5, -0.5], nan_ok=False)
    assert got.prompt_logprobs[0] is None
    top = got.topk_prompt_logprobs
    assert top is not None and top[0] is None
    assert top[1] == [(7, pytest.approx(-0.2)), (2, pytest.approx(-1.5))]
    encode = wire.sample_encoder(_sample_body(prompt_logprobs=True, prompt_logprobs_last_n=2))
    tail = deserialize_sample_response(encode(result))
    assert tail.prompt_logprobs is not None
    assert tail.prompt_logprobs[:2] == [None, None]
    assert tail.prompt_logprobs[2:] == pytest.approx([-2.5, -0.5])
    assert tail.topk_prompt_logprobs is not None and tail.topk_prompt_logprobs[1] is None
    plain = deserialize_sample_response(wire.sample_response(SampleResult((seq,))))
    assert plain.prompt_logprobs is None and plain.topk_prompt_logprobs is None


def test_asample_reads_the_prompt_logprob_options() -> None:
    op = wire.sample_op(_sample_body(prompt_logprobs=True, topk_prompt_logprobs=4))
    assert op.prompt_logprobs and op.topk_prompt_logprobs == 4
    assert not wire.sample_op(_sample_body()).scores_prompt


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"prompt_logprobs": True, "prompt_logprobs_last_n": 4}, "prompt_logprobs_last_n"),
        ({"prompt_logprobs": True, "prompt_logprobs_last_n": 0}, "prompt_logprobs_last_n"),
        ({"prompt_logprobs_last_n": 2}, "prompt_logprobs_last_n"),
        ({"prompt_logprobs": "yes"}, "prompt_logprobs"),
        ({"topk_prompt_logprobs": "3"}, "topk_prompt_logprobs"),
        ({"topk_sample_logprobs": 2}, "topk_sample_logprobs"),
    ],
)
def test_bad_prompt_logprob_options_name_the_field(extra: dict[str, object], field: str) -> None:
    with pytest.raises(InvalidArgumentError, match=f"{field}:"):
        wire.sample_op(_sample_body(**extra))


def test_listing_pages_read_limit_and_offset_with_a_default_limit() -> None:
    assert wire.page({}, 20) == (20, 0)
    assert wire.page({"limit": "5", "offset": "10"}, 100) == (5, 10)
    with pytest.raises(InvalidArgumentError, match="limit, offset: integers"):
        wire.page({"limit": "many"}, 20)


def test_times_reach_the_sdk_as_iso_8601_utc() -> None:
    assert wire.iso_time(86400.5) == "1970-01-02T00:00:00.500000+00:00"
