"""Public SDK types <-> wire messages: the one place the SDK touches protobuf types."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from treadle._tensor import from_wire, to_wire
from treadle.errors import InvalidArgumentError
from treadle.types import (
    AdamParams,
    BaseModelInfo,
    CheckpointInfo,
    Datum,
    ForwardBackwardOutput,
    LossFnOutput,
    ModelInfo,
    ModelInput,
    SampledSequence,
    SampleResponse,
    SamplerMetrics,
    SamplingParams,
    ServerInfo,
    StreamedSample,
    TrainingPassMetrics,
    VersionSpan,
)
from treadle.v1 import common_pb2, sampling_pb2, server_pb2, training_pb2

_STOP_REASONS = {
    common_pb2.STOP: "stop",
    common_pb2.LENGTH: "length",
    common_pb2.CANCELLED: "cancelled",
    common_pb2.PARTIAL: "partial",
}


def loss_fn_to_wire(name: str) -> int:
    try:
        return common_pb2.LossFn.Value(name.upper())
    except ValueError:
        known = [n.lower() for n in common_pb2.LossFn.keys() if n != "LOSS_FN_UNSPECIFIED"]  # noqa: SIM118
        raise InvalidArgumentError(f"loss_fn: unknown loss {name!r}; known: {known}") from None


def datums_to_wire(
    data: Sequence[Datum], out: list[common_pb2.Datum] | None = None
) -> list[common_pb2.Datum]:
    msgs = []
    for datum in data:
        if not isinstance(datum, Datum):
            raise InvalidArgumentError(f"data: expected treadle.Datum, got {type(datum).__name__}")
        msg = common_pb2.Datum()
        to_wire(np.asarray(datum.model_input.tokens, dtype=np.int64), msg.model_input)
        for key, value in datum.loss_fn_inputs.items():
            to_wire(value, msg.loss_fn_inputs[key])
        msgs.append(msg)
    return msgs


def forward_output_from_wire(msg: training_pb2.ForwardOutput) -> ForwardBackwardOutput:
    outputs = []
    for i, out in enumerate(msg.outputs):
        arrays = {k: from_wire(v, f"outputs[{i}].{k}") for k, v in out.outputs.items()}
        logprobs = arrays.pop("logprobs")
        outputs.append(LossFnOutput(logprobs=logprobs, extra=arrays))
    return ForwardBackwardOutput(loss_fn_outputs=outputs, metrics=dict(msg.metrics))


def adam_to_wire(params: AdamParams) -> training_pb2.AdamParams:
    return training_pb2.AdamParams(
        learning_rate=params.learning_rate,
        beta1=params.beta1,
        beta2=params.beta2,
        eps=params.eps,
        weight_decay=params.weight_decay,
        grad_clip_norm=params.grad_clip_norm,
    )


def sampling_params_to_wire(params: SamplingParams) -> sampling_pb2.SamplingParams:
    msg = sampling_pb2.SamplingParams(
        max_tokens=params.max_tokens,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
    )
    for stop in params.stop or ():
        if isinstance(stop, str):
            msg.stop.append(stop)
        else:
            msg.stop_token_ids.append(int(stop))
    if params.seed is not None:
        msg.seed = params.seed
    msg.token_budget = params.token_budget
    msg.ignore_eos = params.ignore_eos
    return msg


def prompt_to_wire(prompt: ModelInput, out: common_pb2.Tensor) -> None:
    to_wire(np.asarray(prompt.tokens, dtype=np.int64), out)


def sample_response_from_wire(msg: sampling_pb2.SampleResponse) -> SampleResponse:
    return SampleResponse(
        sequences=[
            sequence_from_wire(seq, f"sequences[{i}]") for i, seq in enumerate(msg.sequences)
        ]
    )


def sequence_from_wire(seq: sampling_pb2.SampledSequence, name: str) -> SampledSequence:
    return SampledSequence(
        tokens=[int(t) for t in from_wire(seq.tokens, f"{name}.tokens")],
        logprobs=[float(x) for x in from_wire(seq.logprobs, f"{name}.logprobs")],
        stop_reason=_STOP_REASONS.get(seq.stop_reason, "stop"),  # type: ignore[arg-type]
        versions=[VersionSpan(s.start, s.length, s.version) for s in seq.versions],
        resume_handle=seq.resume_handle or None,
    )


def streamed_sample_from_wire(msg: sampling_pb2.SampleStreamResponse) -> StreamedSample:
    return StreamedSample(index=msg.index, sequence=sequence_from_wire(msg.sequence, "sequence"))


def model_info_from_wire(msg: training_pb2.ModelInfo) -> ModelInfo:
    return ModelInfo(
        model_id=msg.model_id,
        base_model=msg.base_model,
        is_lora=msg.is_lora,
        lora_rank=msg.lora_rank,
        dtype=msg.dtype,
        version=msg.version,
        next_seq_id=msg.next_seq_id,
        last_checkpoint_seq_id=msg.last_checkpoint_seq_id,
        status=msg.status,
        created_at=msg.created_at,
        session_id=msg.session_id,
    )


def checkpoint_from_wire(msg: training_pb2.Checkpoint) -> CheckpointInfo:
    return CheckpointInfo(
        path=msg.path,
        name=msg.name,
        seq_id=msg.seq_id,
        step=msg.step,
        created_at=msg.created_at,
        size_bytes=msg.size_bytes,
    )


def server_info_from_wire(msg: server_pb2.ServerInfo) -> ServerInfo:
    return ServerInfo(
        server_version=msg.server_version,
        api_version=msg.api_version,
        base_models=[
            BaseModelInfo(b.name, b.arch, b.vocab_size, b.max_context, b.num_params, b.dtype)
            for b in msg.base_models
        ],
        max_message_bytes=msg.max_message_bytes,
        max_tokens_per_request=msg.max_tokens_per_request,
        features=list(msg.features),
        sampler_metrics=[
            SamplerMetrics(
                m.base_model,
                m.dtype,
                m.tokens_per_s,
                m.occupancy,
                m.running_rows,
                m.num_slots,
                m.queued_requests,
                m.prefilling_requests,
                m.tokens_generated,
                m.prompt_tokens,
                m.prefix_reused_tokens,
            )
            for m in msg.sampler_metrics
        ],
        training_pass_metrics=[
            TrainingPassMetrics(
                p.base_model,
                p.dtype,
                p.passes,
                p.batched_passes,
                p.calls_batched,
                p.calls_alone,
                p.tokens_batched,
                p.tokens_alone,
                p.calls_per_batched_pass,
                p.max_calls_per_pass,
            )
            for p in msg.training_pass_metrics
        ],
    )
