"""Public SDK types <-> wire messages: the one place the SDK builds protobuf messages
(every request the clients send, and every response they read)."""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from treadle.errors import InvalidArgumentError, NoGradientWarning
from treadle.types import (
    AdamParams,
    BaseModelInfo,
    CheckpointInfo,
    Datum,
    ForwardBackwardOutput,
    LossFnOutput,
    ModelInfo,
    ModelInput,
    OptimStepResponse,
    RunUsage,
    SampledSequence,
    SampleResponse,
    SamplerMetrics,
    SamplingParams,
    SaveStateResponse,
    ServerInfo,
    StoppedBy,
    StopReason,
    StreamedSample,
    TrainingPassMetrics,
    VersionSpan,
    WorkerInfo,
)
from treadle.v1 import common_pb2, sampling_pb2, server_pb2, session_pb2, training_pb2
from treadle.wire.tensors import from_wire, ints_to_wire, to_wire

#: wire StopReason -> (``stop_reason``, ``stopped_by``): the SDK keeps tinker's coarse
#: "stop" for the three ways a sequence stops and says which in ``stopped_by``.
_STOP_REASONS: dict[int, tuple[StopReason, StoppedBy | None]] = {
    common_pb2.STOP: ("stop", "eos"),
    common_pb2.STOP_STRING: ("stop", "stop_string"),
    common_pb2.STOP_TOKEN: ("stop", "stop_token"),
    common_pb2.LENGTH: ("length", None),
    common_pb2.CANCELLED: ("cancelled", None),
    common_pb2.PARTIAL: ("partial", None),
}


def loss_fn_to_wire(name: str) -> int:
    try:
        return common_pb2.LossFn.Value(name.upper())
    except ValueError:
        known = [n.lower() for n in common_pb2.LossFn.keys() if n != "LOSS_FN_UNSPECIFIED"]  # noqa: SIM118
        raise InvalidArgumentError(f"loss_fn: unknown loss {name!r}; known: {known}") from None


def datums_to_wire(data: Sequence[Datum]) -> list[common_pb2.Datum]:
    msgs = []
    for datum in data:
        msg = common_pb2.Datum()
        _datum_to_wire(_checked(datum), msg)
        msgs.append(msg)
    return msgs


def _add_datums(out: Any, data: Sequence[Datum]) -> None:
    """``out.extend(datums_to_wire(data))`` for a request's repeated ``data`` field,
    each datum written in place (extend would copy every message)."""
    for datum in data:
        _datum_to_wire(_checked(datum), out.add())


def _checked(datum: Datum) -> Datum:
    if not isinstance(datum, Datum):
        raise InvalidArgumentError(f"data: expected treadle.Datum, got {type(datum).__name__}")
    return datum


def _datum_to_wire(datum: Datum, msg: common_pb2.Datum) -> None:
    ints_to_wire(datum.model_input.tokens, msg.model_input)
    inputs = msg.loss_fn_inputs
    for key, value in datum.loss_fn_inputs.items():
        to_wire(value, inputs[key])


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


def optim_step_from_wire(msg: training_pb2.OptimStepResponse, model_id: str) -> OptimStepResponse:
    """The step's result; warns when the step had no gradient to learn from (the
    server's ``no_grad:value`` metric), since it still moved the weights."""
    metrics = dict(msg.metrics)
    if metrics.get("no_grad:value", 0.0) > 0:
        warnings.warn(
            f"optim_step on model {model_id}: no gradient since the previous optim_step "
            "(grad_norm 0: no forward_backward in between, or every token had weight or "
            "advantage 0), yet Adam's momentum moved the weights (see update_norm:value). "
            "Skip optim_step when a batch has nothing to learn.",
            NoGradientWarning,
            stacklevel=2,
        )
    return OptimStepResponse(step=msg.step, metrics=metrics)


def sampling_params_to_wire(params: SamplingParams) -> sampling_pb2.SamplingParams:
    msg = sampling_pb2.SamplingParams(max_tokens=params.max_tokens)
    # None stays unset on the wire (the server's default); 0 is sent as an explicit 0
    if params.temperature is not None:
        msg.temperature = params.temperature
    if params.top_p is not None:
        msg.top_p = params.top_p
    if params.top_k is not None:
        msg.top_k = params.top_k
    strings, token_ids = stops(params.stop)
    msg.stop.extend(strings)
    msg.stop_token_ids.extend(token_ids)
    if params.seed is not None:
        msg.seed = params.seed
    msg.token_budget = params.token_budget
    msg.ignore_eos = params.ignore_eos
    msg.cache_completion = params.cache_completion
    return msg


def stops(stop: str | Sequence[str | int] | None) -> tuple[list[str], list[int]]:
    """``SamplingParams.stop`` as (stop strings, stop token ids). A string is one stop
    string, never its characters (tinker's and vLLM's reading)."""
    if stop is None:
        return [], []
    if isinstance(stop, str):
        return [stop], []
    if isinstance(stop, bytes | bytearray) or not isinstance(stop, Sequence):
        raise InvalidArgumentError(
            f"stop: expected a string, or a list of strings and/or token ids, got "
            f"{type(stop).__name__}"
        )
    strings: list[str] = []
    token_ids: list[int] = []
    for i, item in enumerate(stop):
        if isinstance(item, str):
            strings.append(item)
        elif isinstance(item, int | np.integer) and not isinstance(item, bool):
            token_ids.append(int(item))
        else:
            raise InvalidArgumentError(
                f"stop[{i}]: expected a stop string or a token id, got {type(item).__name__}"
            )
    return strings, token_ids


def prompt_to_wire(prompt: ModelInput, out: common_pb2.Tensor) -> None:
    ints_to_wire(prompt.tokens, out)


def sample_response_from_wire(msg: sampling_pb2.SampleResponse) -> SampleResponse:
    prompt: list[float | None] | None = None
    if msg.HasField("prompt_logprobs"):
        lps = from_wire(msg.prompt_logprobs, "prompt_logprobs").reshape(-1)
        prompt = [None if math.isnan(x) else float(x) for x in lps.tolist()]
    topk: list[list[tuple[int, float]] | None] | None = None
    if msg.HasField("topk_prompt_logprobs"):
        ids_P_K = from_wire(msg.topk_prompt_token_ids, "topk_prompt_token_ids")
        lps_P_K = from_wire(msg.topk_prompt_logprobs, "topk_prompt_logprobs")
        topk = [
            None
            if row_ids.size == 0 or row_ids[0] < 0
            else [(int(t), float(x)) for t, x in zip(row_ids, row_lps, strict=True) if t >= 0]
            for row_ids, row_lps in zip(ids_P_K, lps_P_K, strict=True)
        ]
    return SampleResponse(
        sequences=[
            sequence_from_wire(seq, f"sequences[{i}]") for i, seq in enumerate(msg.sequences)
        ],
        prompt_logprobs=prompt,
        topk_prompt_logprobs=topk,
    )


def sequence_from_wire(seq: sampling_pb2.SampledSequence, name: str) -> SampledSequence:
    # a reason newer than this SDK still reads as a stop
    reason, stopped_by = _STOP_REASONS.get(seq.stop_reason, ("stop", None))
    return SampledSequence(
        # tolist: Python ints and floats (the same values), one call instead of one a token
        tokens=_python_list(from_wire(seq.tokens, f"{name}.tokens"), int),
        logprobs=_python_list(from_wire(seq.logprobs, f"{name}.logprobs"), float),
        stop_reason=reason,
        stopped_by=stopped_by,
        versions=[VersionSpan(s.start, s.length, s.version) for s in seq.versions],
        resume_handle=seq.resume_handle or None,
    )


def _python_list(arr: np.ndarray, kind: type) -> list:
    """``[kind(x) for x in arr]`` for a 1-D array: ``tolist`` when it gives the same
    Python values (an int array's ints, a float array's floats)."""
    if arr.ndim == 1 and (arr.dtype.kind == "i" if kind is int else arr.dtype.kind == "f"):
        return arr.tolist()
    return [kind(x) for x in arr]


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
        user_metadata=dict(msg.user_metadata),
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
                m.kv_cache_usage,
                m.kv_cache_peak_usage,
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
        max_models=msg.max_models,
        live_models=msg.live_models,
        workers=[
            WorkerInfo(w.worker_id, w.role, w.status, list(w.base_models)) for w in msg.workers
        ],
    )


# ---- samplers -----------------------------------------------------------------------


@dataclass(frozen=True)
class SamplerRef:
    """Which sampler a ``SamplingClient`` sends to, and what it reads."""

    sampler_id: str
    base_model: str
    model_id: str = ""
    version: int = 0
    follows_latest: bool = False


def sampler_from_wire(msg: sampling_pb2.SamplerInfo) -> SamplerRef:
    return SamplerRef(
        sampler_id=msg.sampler_id,
        base_model=msg.base_model,
        model_id=msg.model_id,
        version=msg.version,
        follows_latest=msg.follows_latest,
    )


def synced_sampler_from_wire(
    msg: training_pb2.SyncWeightsResponse, base_model: str, model_id: str
) -> SamplerRef:
    """The sampler a ``sync_weights`` created, pinned to the version it published."""
    return SamplerRef(
        sampler_id=msg.sampler_id, base_model=base_model, model_id=model_id, version=msg.version
    )


#: a sampler's ``placement=`` (``create_sampling_client``, ``sync_weights``) ->
#: ``SamplerPlacement``
SAMPLER_PLACEMENTS = {
    "colocated": sampling_pb2.SAMPLER_PLACEMENT_COLOCATED,
    "pool": sampling_pb2.SAMPLER_PLACEMENT_POOL,
    "auto": sampling_pb2.SAMPLER_PLACEMENT_AUTO,
}


def sampler_placement_to_wire(placement: str | None) -> sampling_pb2.SamplerPlacement.ValueType:
    """A sampler's ``placement`` on the wire (None: unset, the server's choice); the
    one conversion for every request that makes a sampler."""
    if placement is None:
        return sampling_pb2.SAMPLER_PLACEMENT_UNSPECIFIED
    if placement not in SAMPLER_PLACEMENTS:
        raise InvalidArgumentError(
            f"placement: {placement!r} is not one of {', '.join(SAMPLER_PLACEMENTS)}"
        )
    return SAMPLER_PLACEMENTS[placement]


def create_sampler_request(
    base_model: str | None, weights: str | None, placement: str | None = None
) -> sampling_pb2.CreateSamplerRequest:
    where = sampler_placement_to_wire(placement)
    if base_model is not None:
        return sampling_pb2.CreateSamplerRequest(base_model=base_model, placement=where)
    return sampling_pb2.CreateSamplerRequest(weights=weights, placement=where)


def sample_request(
    prompt: ModelInput, num_samples: int, params: SamplingParams
) -> sampling_pb2.SampleRequest:
    request = sampling_pb2.SampleRequest(
        num_samples=num_samples, params=sampling_params_to_wire(params)
    )
    prompt_to_wire(prompt, request.prompt)
    return request


def resume_request(handles: Sequence[str], params: SamplingParams) -> sampling_pb2.ResumeRequest:
    return sampling_pb2.ResumeRequest(
        resume_handles=list(handles), params=sampling_params_to_wire(params)
    )


# ---- training requests (the caller numbers the ordered ones: ``seq_id``) -------------


def forward_backward_request(
    model_id: str,
    data: Sequence[Datum],
    loss_fn: str,
    loss_fn_config: Mapping[str, float] | None,
    temperature: float,
) -> training_pb2.ForwardBackwardRequest:
    request = training_pb2.ForwardBackwardRequest(
        model_id=model_id,
        loss_fn=loss_fn_to_wire(loss_fn),
        loss_fn_config={k: float(v) for k, v in (loss_fn_config or {}).items()},
        temperature=temperature,
    )
    _add_datums(request.data, data)
    return request


def forward_logprobs_request(
    model_id: str, data: Sequence[Datum], reference: bool | str, temperature: float
) -> training_pb2.ForwardLogprobsRequest:
    """``reference``: True (the base model), False (the model), or a ``treadle://`` path."""
    flag, path = (False, reference) if isinstance(reference, str) else (reference, "")
    request = training_pb2.ForwardLogprobsRequest(
        model_id=model_id, reference=flag, temperature=temperature, reference_path=path
    )
    _add_datums(request.data, data)
    return request


def optim_step_request(model_id: str, params: AdamParams) -> training_pb2.OptimStepRequest:
    return training_pb2.OptimStepRequest(model_id=model_id, adam_params=adam_to_wire(params))


def sync_weights_request(
    model_id: str, inflight: bool, placement: str | None = None
) -> training_pb2.SyncWeightsRequest:
    return training_pb2.SyncWeightsRequest(
        model_id=model_id,
        create_sampler=True,
        inflight=inflight,
        placement=sampler_placement_to_wire(placement),
    )


def save_state_request(model_id: str, name: str) -> training_pb2.SaveStateRequest:
    return training_pb2.SaveStateRequest(model_id=model_id, name=name)


def saved_state_from_wire(msg: training_pb2.SaveStateResponse) -> SaveStateResponse:
    return SaveStateResponse(path=msg.path, seq_id=msg.seq_id, step=msg.step)


def load_state_request(
    model_id: str, path: str, weights_only: bool
) -> training_pb2.LoadStateRequest:
    return training_pb2.LoadStateRequest(model_id=model_id, path=path, weights_only=weights_only)


def create_model_request(**fields: object) -> training_pb2.CreateModelRequest:
    return training_pb2.CreateModelRequest(**fields)  # type: ignore[arg-type]


def model_info_request(model_id: str) -> training_pb2.GetModelInfoRequest:
    return training_pb2.GetModelInfoRequest(model_id=model_id)


def list_models_request() -> training_pb2.ListModelsRequest:
    return training_pb2.ListModelsRequest()


def restore_model_request(model_id: str) -> training_pb2.RestoreModelRequest:
    return training_pb2.RestoreModelRequest(model_id=model_id)


def delete_model_request(model_id: str) -> training_pb2.DeleteModelRequest:
    return training_pb2.DeleteModelRequest(model_id=model_id)


def list_checkpoints_request(model_id: str) -> training_pb2.ListCheckpointsRequest:
    return training_pb2.ListCheckpointsRequest(model_id=model_id)


def delete_checkpoint_request(path: str) -> training_pb2.DeleteCheckpointRequest:
    return training_pb2.DeleteCheckpointRequest(path=path)


def log_metrics_request(
    model_id: str, step: int, metrics: Mapping[str, float]
) -> training_pb2.LogMetricsRequest:
    return training_pb2.LogMetricsRequest(
        model_id=model_id, step=int(step), metrics={str(k): float(v) for k, v in metrics.items()}
    )


def usage_request(model_id: str) -> training_pb2.GetUsageRequest:
    return training_pb2.GetUsageRequest(model_id=model_id)


def usage_from_wire(u: training_pb2.Usage) -> RunUsage:
    return RunUsage(
        model_id=u.model_id,
        tokens_trained=int(u.tokens_trained),
        tokens_sampled=int(u.tokens_sampled),
        tokens_scored=int(u.tokens_scored),
        calls=int(u.calls),
        device_s=float(u.device_s),
        cost=float(u.cost) if u.priced else None,
        currency=u.currency,
    )


def export_weights_request(model_id: str, merged: bool) -> training_pb2.ExportWeightsRequest:
    return training_pb2.ExportWeightsRequest(model_id=model_id, merged=merged)


# ---- server and sessions ------------------------------------------------------------


def server_info_request() -> server_pb2.GetServerInfoRequest:
    return server_pb2.GetServerInfoRequest()


def tokenizer_request(base_model: str) -> server_pb2.GetTokenizerRequest:
    return server_pb2.GetTokenizerRequest(base_model=base_model)


def create_session_request(client: str) -> session_pb2.CreateSessionRequest:
    return session_pb2.CreateSessionRequest(client=client)


def heartbeat_request(session_id: str) -> session_pb2.HeartbeatRequest:
    return session_pb2.HeartbeatRequest(session_id=session_id)


def end_session_request(session_id: str) -> session_pb2.EndSessionRequest:
    return session_pb2.EndSessionRequest(session_id=session_id)
