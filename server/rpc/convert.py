"""Wire messages -> engine domain types, and engine results -> wire messages.

The one place the server turns protobuf into domain objects; field names in
errors are the wire's, so a client sees which field was wrong.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from treadle.common.db import models as db
from treadle.common.engine.domain import (
    SAMPLER_PLACEMENTS,
    AdamConfig,
    DatumData,
    ForwardBackwardOp,
    ForwardLogprobsOp,
    ForwardResult,
    LoadResult,
    ModelSpec,
    OptimStepResult,
    SampleOp,
    SampleResult,
    SamplingConfig,
    SequenceResult,
    StreamedSequence,
)
from treadle.common.engine.sampling_limits import check_stop
from treadle.common.engine.stats import PassStats, SamplerStats
from treadle.errors import InvalidArgumentError
from treadle.server import restarts
from treadle.server.service import run_metadata
from treadle.server.service.types import (
    BaseModelRecord,
    CheckpointRecord,
    ModelRecord,
    NewModel,
    OrderedCall,
    RunUsageRecord,
    SamplerInfo,
    SamplerSource,
    SavedState,
    SessionInfo,
    SyncOutcome,
    WorkerRecord,
)
from treadle.v1 import common_pb2, sampling_pb2, server_pb2, session_pb2, training_pb2
from treadle.wire.tensors import from_wire, to_wire

_STOP_REASONS = {
    "stop": common_pb2.STOP,
    "length": common_pb2.LENGTH,
    "cancelled": common_pb2.CANCELLED,
    "partial": common_pb2.PARTIAL,
    "stop_string": common_pb2.STOP_STRING,
    "stop_token": common_pb2.STOP_TOKEN,
}


def digest(request: object) -> str:
    """A stable digest of a request's payload, for seq_id de-duplication."""
    data = request.SerializeToString(deterministic=True)  # type: ignore[attr-defined]
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def ordered_call(request: Any, metadata: Sequence[tuple[str, Any]] | None) -> OrderedCall:
    """An ordered call's identity: ``model_id`` and ``seq_id`` of the request, the
    digest of its payload, and the client's numbering from the call's metadata."""
    return OrderedCall(
        model_id=request.model_id,
        seq_id=request.seq_id,
        digest=digest(request),
        numbering=restarts.client_numbering(metadata),
    )


def create_model(req: training_pb2.CreateModelRequest) -> NewModel:
    return NewModel(
        base_model=req.base_model,
        lora_rank=req.lora_rank,
        lora_alpha=req.lora_alpha,
        seed=req.seed,
        dtype=req.dtype,
        modules=lora_modules(req),
        from_state=req.from_state,
        weights_only=req.weights_only,
        session_id=req.session_id,
        user_metadata=run_metadata.check(dict(req.user_metadata)),
    )


def model_info(info: ModelRecord) -> training_pb2.ModelInfo:
    return training_pb2.ModelInfo(
        model_id=info.model_id,
        base_model=info.base_model,
        is_lora=info.is_lora,
        lora_rank=info.lora_rank,
        dtype=info.dtype,
        version=info.version,
        next_seq_id=info.next_seq_id,
        last_checkpoint_seq_id=info.last_checkpoint_seq_id,
        status=info.status,
        created_at=info.created_at,
        session_id=info.session_id,
        user_metadata=info.user_metadata,
    )


def checkpoint(c: CheckpointRecord) -> training_pb2.Checkpoint:
    return training_pb2.Checkpoint(
        path=c.path,
        name=c.name,
        seq_id=c.seq_id,
        step=c.step,
        created_at=c.created_at,
        size_bytes=c.size_bytes,
    )


def sampler_source(req: sampling_pb2.CreateSamplerRequest) -> SamplerSource:
    placement = sampler_placement(req.placement)
    which = req.WhichOneof("target")
    if which == "base_model":
        return SamplerSource(base_model=req.base_model, placement=placement)
    if which == "weights":
        return SamplerSource(weights=req.weights, placement=placement)
    return SamplerSource(placement=placement)


def sampler_placement(value: int) -> str:
    """``SamplerPlacement`` -> one of ``SAMPLER_PLACEMENTS``; "" = the server's."""
    if value == sampling_pb2.SAMPLER_PLACEMENT_UNSPECIFIED:
        return ""
    if value not in sampling_pb2.SamplerPlacement.values():
        raise InvalidArgumentError(
            f"placement: unknown sampler placement ({value}); one of "
            f"{', '.join(SAMPLER_PLACEMENTS)}, or unset for the server's"
        )
    return sampling_pb2.SamplerPlacement.Name(value).removeprefix("SAMPLER_PLACEMENT_").lower()


def sampler_info(info: SamplerInfo) -> sampling_pb2.SamplerInfo:
    return sampling_pb2.SamplerInfo(
        sampler_id=info.sampler_id,
        base_model=info.base_model,
        model_id=info.model_id,
        version=info.version,
        follows_latest=info.follows_latest,
    )


def model_spec(row: db.Model) -> ModelSpec:
    """A model's stored row -> the engine's spec of it (restore, unload, re-placement)."""
    return ModelSpec(
        row.id,
        row.tenant_id,
        row.base_model,
        row.lora_rank,
        row.lora_alpha,
        row.seed,
        row.dtype,
        row.train_attn,
        row.train_mlp,
        row.train_unembed,
    )


def manifest_modules(manifest: dict) -> tuple[bool, bool, bool]:
    """(train_attn, train_mlp, train_unembed) of a checkpoint. States written before
    the flags existed adapted every projection and not the head."""
    return (
        bool(manifest.get("train_attn", True)),
        bool(manifest.get("train_mlp", True)),
        bool(manifest.get("train_unembed", False)),
    )


def lora_modules(req: training_pb2.CreateModelRequest) -> tuple[bool, bool, bool]:
    """(train_attn, train_mlp, train_unembed): unset means true, as in the tinker SDK."""
    return tuple(  # type: ignore[return-value]
        getattr(req, f) if req.HasField(f) else True
        for f in ("train_attn", "train_mlp", "train_unembed")
    )


def loss_name(value: int) -> str:
    if value == common_pb2.LOSS_FN_UNSPECIFIED or value not in common_pb2.LossFn.values():
        raise InvalidArgumentError(f"loss_fn: unknown or unspecified loss ({value})")
    return common_pb2.LossFn.Name(value).lower()


def datums(msgs: Sequence[common_pb2.Datum]) -> tuple[DatumData, ...]:
    if not msgs:
        raise InvalidArgumentError("data: empty batch")
    out = []
    for i, msg in enumerate(msgs):
        tokens = from_wire(msg.model_input, f"data[{i}].model_input")
        if tokens.dtype.kind not in "iu":
            raise InvalidArgumentError(f"data[{i}].model_input: token ids must be integers")
        inputs = {
            k: from_wire(v, f"data[{i}].loss_fn_inputs.{k}").reshape(-1)
            for k, v in msg.loss_fn_inputs.items()
        }
        out.append(DatumData(tokens=tokens.reshape(-1).astype(np.int64), inputs=inputs))
    return tuple(out)


def _temperature(value: float) -> float:
    return 1.0 if value == 0 else value


def forward_backward_op(req: training_pb2.ForwardBackwardRequest) -> ForwardBackwardOp:
    return ForwardBackwardOp(
        data=datums(req.data),
        loss_fn=loss_name(req.loss_fn),
        loss_config=dict(req.loss_fn_config),
        temperature=_temperature(req.temperature),
    )


def forward_logprobs_op(req: training_pb2.ForwardLogprobsRequest) -> ForwardLogprobsOp:
    return ForwardLogprobsOp(
        data=datums(req.data), reference=req.reference, temperature=_temperature(req.temperature)
    )


def adam(msg: training_pb2.AdamParams) -> AdamConfig:
    return AdamConfig(
        learning_rate=msg.learning_rate,
        beta1=msg.beta1,
        beta2=msg.beta2,
        eps=msg.eps,
        weight_decay=msg.weight_decay,
        grad_clip_norm=msg.grad_clip_norm,
    )


def forward_output(result: ForwardResult) -> training_pb2.ForwardOutput:
    msg = training_pb2.ForwardOutput(metrics=dict(result.metrics))
    for lp in result.logprobs:
        out = msg.outputs.add()
        to_wire(lp, out.outputs["logprobs"])
    return msg


def sample_op(req: sampling_pb2.SampleRequest) -> SampleOp:
    prompt = from_wire(req.prompt, "prompt").reshape(-1)
    if prompt.dtype.kind not in "iu":
        raise InvalidArgumentError("prompt: token ids must be integers")
    params = sampling_config(req.params)
    return SampleOp(
        prompt=prompt.astype(np.int64),
        num_samples=req.num_samples,
        params=params,
        prompt_logprobs=req.prompt_logprobs,
        topk_prompt_logprobs=req.topk_prompt_logprobs,
    )


def sampling_config(p: sampling_pb2.SamplingParams) -> SamplingConfig:
    """Unset fields take their defaults (T = 1, no top-p, no top-k); an explicit
    value is passed on as it is, so ``top_p = 0`` is refused by the sampler's
    checks rather than read as "off"."""
    check_stop(p.stop, p.stop_token_ids, "params.stop")
    return SamplingConfig(
        max_tokens=p.max_tokens,
        temperature=p.temperature if p.HasField("temperature") else 1.0,
        top_p=p.top_p if p.HasField("top_p") else 1.0,
        top_k=p.top_k if p.HasField("top_k") else -1,
        stop_strings=tuple(p.stop),
        stop_token_ids=tuple(int(t) for t in p.stop_token_ids),
        seed=p.seed if p.HasField("seed") else None,
        token_budget=p.token_budget,
        ignore_eos=p.ignore_eos,
        cache_completion=p.cache_completion,
    )


def sample_response(result: SampleResult) -> sampling_pb2.SampleResponse:
    msg = sampling_pb2.SampleResponse()
    for seq in result.sequences:
        sequence_to_wire(seq, msg.sequences.add())
    scores = result.prompt
    if scores is not None:
        if scores.logprobs is not None:
            to_wire(scores.logprobs.astype(np.float32), msg.prompt_logprobs)
        if scores.topk_ids.shape[1]:
            to_wire(scores.topk_ids.astype(np.int64), msg.topk_prompt_token_ids)
            to_wire(scores.topk_logprobs.astype(np.float32), msg.topk_prompt_logprobs)
    return msg


def sequence_to_wire(seq: SequenceResult, out: sampling_pb2.SampledSequence) -> None:
    to_wire(seq.tokens.astype(np.int32), out.tokens)
    to_wire(seq.logprobs.astype(np.float32), out.logprobs)
    out.stop_reason = _STOP_REASONS[seq.stop_reason]
    for start, length, version in seq.versions:
        out.versions.add(start=start, length=length, version=version)
    out.resume_handle = seq.resume_handle


def stream_response(item: StreamedSequence) -> sampling_pb2.SampleStreamResponse:
    msg = sampling_pb2.SampleStreamResponse(index=item.index)
    sequence_to_wire(item.sequence, msg.sequence)
    return msg


# ---- responses of the lifecycle, checkpoint, session and info calls -------------------


def list_models(infos: Sequence[ModelRecord]) -> training_pb2.ListModelsResponse:
    return training_pb2.ListModelsResponse(models=[model_info(m) for m in infos])


def list_checkpoints(rows: Sequence[CheckpointRecord]) -> training_pb2.ListCheckpointsResponse:
    return training_pb2.ListCheckpointsResponse(checkpoints=[checkpoint(c) for c in rows])


def deleted_model() -> training_pb2.DeleteModelResponse:
    return training_pb2.DeleteModelResponse()


def deleted_checkpoint() -> training_pb2.DeleteCheckpointResponse:
    return training_pb2.DeleteCheckpointResponse()


def metrics_logged(kept: int) -> training_pb2.LogMetricsResponse:
    return training_pb2.LogMetricsResponse(kept=kept)


def usage(u: RunUsageRecord) -> training_pb2.Usage:
    return training_pb2.Usage(
        model_id=u.model_id,
        tokens_trained=u.tokens_trained,
        tokens_sampled=u.tokens_sampled,
        tokens_scored=u.tokens_scored,
        calls=u.calls,
        device_s=u.device_s,
        priced=u.cost is not None,
        cost=u.cost or 0.0,
        currency=u.currency,
    )


def file_chunk(name: str, offset: int, data: bytes, last: bool) -> training_pb2.FileChunk:
    return training_pb2.FileChunk(file_name=name, offset=offset, data=data, last=last)


def tokenizer_chunk(name: str, offset: int, data: bytes, last: bool) -> server_pb2.TokenizerChunk:
    return server_pb2.TokenizerChunk(file_name=name, offset=offset, data=data, last=last)


def optim_step(result: OptimStepResult) -> training_pb2.OptimStepResponse:
    return training_pb2.OptimStepResponse(step=result.step, metrics=dict(result.metrics))


def sync_weights(out: SyncOutcome) -> training_pb2.SyncWeightsResponse:
    response = training_pb2.SyncWeightsResponse(version=out.version, weights_uri=out.weights_uri)
    if out.sampler_id:
        response.sampler_id = out.sampler_id
    return response


def saved_state(saved: SavedState) -> training_pb2.SaveStateResponse:
    return training_pb2.SaveStateResponse(path=saved.path, seq_id=saved.seq_id, step=saved.step)


def loaded_state(result: LoadResult) -> training_pb2.LoadStateResponse:
    return training_pb2.LoadStateResponse(step=result.step)


def session_info(info: SessionInfo) -> session_pb2.SessionInfo:
    return session_pb2.SessionInfo(
        session_id=info.session_id,
        heartbeat_interval_s=info.heartbeat_interval_s,
        created_at=info.created_at,
    )


def heartbeat() -> session_pb2.HeartbeatResponse:
    return session_pb2.HeartbeatResponse()


def ended_session() -> session_pb2.EndSessionResponse:
    return session_pb2.EndSessionResponse()


def server_info(
    *,
    server_version: str,
    max_message_bytes: int,
    max_tokens_per_request: int,
    features: Sequence[str],
    quota: tuple[int, int],
    base_models: Sequence[BaseModelRecord],
    sampler_metrics: Sequence[SamplerStats],
    pass_metrics: Sequence[PassStats],
    workers: Sequence[WorkerRecord] = (),
) -> server_pb2.ServerInfo:
    """What the server serves; ``quota`` is the tenant's (max_models, live_models)."""
    info = server_pb2.ServerInfo(
        server_version=server_version,
        api_version="treadle.v1",
        max_message_bytes=max_message_bytes,
        max_tokens_per_request=max_tokens_per_request,
        features=list(features),
        max_models=quota[0],
        live_models=quota[1],
    )
    _add_each(info.base_models, base_models)
    _add_each(info.sampler_metrics, sampler_metrics)
    _add_each(info.training_pass_metrics, pass_metrics)
    for w in workers:
        info.workers.add(
            worker_id=w.worker_id, role=w.role, status=w.status, base_models=list(w.base_models)
        )
    return info


def _add_each(repeated: Any, items: Sequence[object]) -> None:
    """Append one message per item to a repeated field, every field of the message
    read from the item's attribute of the same name (a wire field the domain type
    lacks fails here, in the tests, not silently as a zero)."""
    for item in items:
        msg = repeated.add()
        for field in msg.DESCRIPTOR.fields:
            setattr(msg, field.name, getattr(item, field.name))
