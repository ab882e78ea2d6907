"""The tinker wire <-> treadle domain, in one place.

The SDK sends ``forward_backward`` as a ``tinker_public.ForwardBackwardRequest``
(protobuf, maybe zstd) and reads ``ForwardBackwardOutput`` and ``SampleResponse``
only as protobuf; everything else is JSON. Errors name the field that was wrong,
in the SDK's own spelling (``data[2].loss_fn_inputs.weights``).
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import math
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
from google.protobuf.message import DecodeError

from treadle.common.engine.domain import (
    AdamConfig,
    DatumData,
    ForwardBackwardOp,
    ForwardLogprobsOp,
    ForwardResult,
    SampleOp,
    SampleResult,
    SamplingConfig,
)
from treadle.common.engine.sampling_limits import check_stop
from treadle.errors import InvalidArgumentError
from treadle.server.http import tinker_pb

PROTOBUF = "application/x-protobuf"

_NUMPY: dict[int, np.dtype[Any]] = {
    tinker_pb.DTYPE_FLOAT32: np.dtype("<f4"),
    tinker_pb.DTYPE_INT64: np.dtype("<i8"),
    tinker_pb.DTYPE_INT32: np.dtype("<i4"),
}
#: treadle stop reasons -> the SDK's two (it knows only "stop" and "length")
_STOP = {"length": tinker_pb.STOP_REASON_LENGTH, "partial": tinker_pb.STOP_REASON_LENGTH}


def decompress(body: bytes, encoding: str | None) -> bytes:
    if not encoding or encoding == "identity":
        return body
    if encoding != "zstd":
        raise InvalidArgumentError(f"Content-Encoding: {encoding!r} is not supported (zstd is)")
    import zstandard

    try:
        return zstandard.ZstdDecompressor().decompress(body, max_output_size=1 << 31)
    except zstandard.ZstdError as err:
        raise InvalidArgumentError(f"body: not valid zstd ({err})") from err


def json_body(body: bytes) -> dict[str, Any]:
    if not body:
        return {}
    try:
        value = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise InvalidArgumentError(f"body: malformed JSON ({err})") from err
    if not isinstance(value, dict):
        raise InvalidArgumentError("body: expected a JSON object")
    return value


def field(
    body: Mapping[str, Any], name: str, kind: type | tuple[type, ...], default: Any = ...
) -> Any:
    """``body[name]`` checked against ``kind``; missing -> ``default`` or a 400 naming it."""
    value = body.get(name)
    if value is None:
        if default is ...:
            raise InvalidArgumentError(f"{name}: required")
        return default
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if (
        isinstance(value, bool)
        and kind is not bool
        and bool not in (kind if isinstance(kind, tuple) else (kind,))
    ):
        raise InvalidArgumentError(
            f"{name}: expected {getattr(kind, '__name__', kind)}, got a boolean"
        )
    if not isinstance(value, kind):
        raise InvalidArgumentError(
            f"{name}: expected {getattr(kind, '__name__', kind)}, got {type(value).__name__}"
        )
    return value


def page(query: Mapping[str, str], default_limit: int) -> tuple[int, int]:
    """A listing's ``limit`` and ``offset`` query parameters (INVALID_ARGUMENT unless integers)."""
    try:
        limit = int(query.get("limit", default_limit))
        offset = int(query.get("offset", 0))
    except ValueError as err:
        raise InvalidArgumentError(f"limit, offset: integers ({err})") from err
    return limit, offset


def iso_time(seconds: float) -> str:
    """A Unix time as the SDK reads times (ISO 8601, UTC)."""
    return dt.datetime.fromtimestamp(seconds, dt.timezone.utc).isoformat()


def digest(payload: bytes | Mapping[str, Any]) -> str:
    """A stable digest of a call's payload (a retry of the same call matches)."""
    if not isinstance(payload, bytes):
        payload = json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(payload).hexdigest()


# ---- forward_backward -----------------------------------------------------------


def parse_forward_backward(body: bytes) -> Any:
    msg = tinker_pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except DecodeError as err:
        raise InvalidArgumentError(
            f"body: not a tinker_public.ForwardBackwardRequest ({err})"
        ) from err
    if not msg.model_id:
        raise InvalidArgumentError("model_id: required")
    return msg


def _tensor(msg: Any, where: str) -> np.ndarray:
    dtype = _NUMPY.get(msg.dtype)
    if dtype is None:
        raise InvalidArgumentError(f"{where}.dtype: unsupported ({msg.dtype})")
    if msg.WhichOneof("encoding") == "sparse_csr":
        raise InvalidArgumentError(f"{where}: sparse tensors are not supported; send dense")
    if len(msg.dense) % dtype.itemsize:
        raise InvalidArgumentError(
            f"{where}: {len(msg.dense)} bytes is not a whole number of {dtype}"
        )
    arr = np.frombuffer(msg.dense, dtype=dtype)
    if msg.shape and math.prod(msg.shape) != arr.size:
        raise InvalidArgumentError(
            f"{where}.shape: {list(msg.shape)} does not hold {arr.size} values"
        )
    return arr.reshape(-1)


def _datums(msg: Any) -> tuple[DatumData, ...]:
    if not msg.data:
        raise InvalidArgumentError("data: empty batch")
    out = []
    for i, datum in enumerate(msg.data):
        parts = []
        for j, chunk in enumerate(datum.model_input):
            kind = chunk.WhichOneof("chunk")
            if kind != "encoded_text":
                raise InvalidArgumentError(
                    f"data[{i}].model_input.chunks[{j}]: {kind or 'empty'} chunks are not "
                    "supported (treadle serves text models: encoded_text only)"
                )
            if len(chunk.encoded_text.tokens) % 4:
                raise InvalidArgumentError(
                    f"data[{i}].model_input.chunks[{j}].tokens: not int32 bytes"
                )
            parts.append(np.frombuffer(chunk.encoded_text.tokens, dtype="<i4"))
        tokens = np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)
        inputs = {
            name: _tensor(t, f"data[{i}].loss_fn_inputs.{name}")
            for name, t in datum.loss_fn_inputs.items()
        }
        out.append(DatumData(tokens=tokens, inputs=inputs))
    return tuple(out)


def _loss_config(msg: Any) -> dict[str, float]:
    config = {k: float(v) for k, v in msg.loss_fn_config.items()}
    for key, value in msg.loss_fn_config_v2.items():
        if value.WhichOneof("value") == "text":
            raise InvalidArgumentError(
                f"loss_fn_config.{key}: string values are not supported ({value.text!r})"
            )
        config[key] = value.number
    return config


def forward_backward_op(msg: Any) -> ForwardBackwardOp | ForwardLogprobsOp:
    """``forward`` (forward_only) is treadle's ``forward_logprobs``; its loss is
    still checked and its ``loss:sum`` computed on the client's side of the SDK."""
    data = _datums(msg)
    if msg.forward_only:
        kept = ("target_tokens",)  # what a forward pass reads; loss inputs are the client's
        return ForwardLogprobsOp(
            data=tuple(
                DatumData(d.tokens, {k: v for k, v in d.inputs.items() if k in kept}) for d in data
            )
        )
    if not msg.loss_fn:
        raise InvalidArgumentError("loss_fn: required")
    return ForwardBackwardOp(data=data, loss_fn=msg.loss_fn, loss_config=_loss_config(msg))


def _batched(arrays: list[np.ndarray], dtype: int, np_dtype: str) -> Any:
    out = tinker_pb.BatchedTensor()
    parts = [np.ascontiguousarray(a, dtype=np_dtype).reshape(-1) for a in arrays]
    offsets = np.zeros(len(parts) + 1, dtype="<i8")
    offsets[1:] = np.cumsum([p.nbytes for p in parts])
    out.data = b"".join(p.tobytes() for p in parts)
    out.offsets = offsets.tobytes()
    out.dtype = dtype
    return out


def metrics(values: Mapping[str, float]) -> dict[str, float]:
    """Metric keys as the SDK reads them, ``name:reduction`` (a bare name is a sum)."""
    return {(k if ":" in k else f"{k}:sum"): float(v) for k, v in values.items()}


def forward_output(
    result: ForwardResult, ce_weights: list[np.ndarray | None] | None = None
) -> bytes:
    """Per-datum ``logprobs`` (float32 [T]) and the metrics, as one ArrayRecord.
    ``ce_weights``: a forward pass asked for cross_entropy, whose ``loss:sum``
    (Σ −weight·logprob) is reported as the SDK's forward() reports it."""
    msg = tinker_pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    values = metrics(result.metrics)
    if ce_weights is not None and "loss:sum" not in values:
        values["loss:sum"] = float(
            sum(
                -float(np.dot(lp.astype(np.float64), w.astype(np.float64)))
                for lp, w in zip(result.logprobs, ce_weights, strict=True)
                if w is not None and w.shape == lp.shape
            )
        )
    msg.metrics.update(values)
    record = msg.loss_fn_outputs.add(type_tag="ArrayRecord", num_datums=len(result.logprobs))
    record.fields["logprobs"].CopyFrom(
        _batched(list(result.logprobs), tinker_pb.DTYPE_FLOAT32, "<f4")
    )
    return bytes(msg.SerializeToString())


# ---- JSON requests --------------------------------------------------------------


def adam(body: Mapping[str, Any]) -> AdamConfig:
    params = body.get("adam_params")
    if params is None:
        if body.get("optimizer_params") is not None:
            raise InvalidArgumentError(
                "optimizer_params: only Adam is supported (send adam_params / AdamParams)"
            )
        raise InvalidArgumentError("adam_params: required")
    if not isinstance(params, dict):
        raise InvalidArgumentError("adam_params: expected an object")
    defaults = AdamConfig()
    return AdamConfig(
        **{
            name: field(params, name, float, getattr(defaults, name))
            for name in ("learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm")
        }
    )


def prompt_tokens(prompt: Any, where: str = "prompt") -> np.ndarray:
    if not isinstance(prompt, dict) or not isinstance(prompt.get("chunks"), list):
        raise InvalidArgumentError(f"{where}.chunks: required (a list of chunks)")
    parts: list[int] = []
    for j, chunk in enumerate(prompt["chunks"]):
        if not isinstance(chunk, dict) or chunk.get("type", "encoded_text") != "encoded_text":
            raise InvalidArgumentError(
                f"{where}.chunks[{j}]: only encoded_text chunks are supported"
            )
        tokens = chunk.get("tokens")
        if not isinstance(tokens, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in tokens
        ):
            raise InvalidArgumentError(f"{where}.chunks[{j}].tokens: expected a list of integers")
        parts.extend(tokens)
    if not parts:
        raise InvalidArgumentError(f"{where}: empty")
    return np.asarray(parts, dtype=np.int64)


def sampling_config(params: Any) -> SamplingConfig:
    if not isinstance(params, dict):
        raise InvalidArgumentError("sampling_params: required (an object)")
    stop = params.get("stop")
    strings: tuple[str, ...] = ()
    token_ids: tuple[int, ...] = ()
    if isinstance(stop, str):
        strings = (stop,)
    elif isinstance(stop, list):
        if all(isinstance(s, str) for s in stop):
            strings = tuple(stop)
        elif all(isinstance(s, int) and not isinstance(s, bool) for s in stop):
            token_ids = tuple(stop)
        else:
            raise InvalidArgumentError("sampling_params.stop: strings or token ids, not both")
    elif stop is not None:
        raise InvalidArgumentError("sampling_params.stop: a string or a list")
    check_stop(strings, token_ids, "sampling_params.stop")
    max_tokens = params.get("max_tokens")
    if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
        raise InvalidArgumentError(f"sampling_params.max_tokens: must be >= 1 (got {max_tokens!r})")
    seed = params.get("seed")
    if seed is not None and not isinstance(seed, int):
        raise InvalidArgumentError("sampling_params.seed: expected an integer")
    return SamplingConfig(
        max_tokens=max_tokens if max_tokens is not None else 16,
        temperature=field(params, "temperature", float, 1.0),
        top_p=field(params, "top_p", float, 1.0),
        top_k=field(params, "top_k", int, -1),
        stop_strings=strings,
        stop_token_ids=token_ids,
        seed=seed,
    )


def sample_op(body: Mapping[str, Any]) -> SampleOp:
    for name in ("topk_sample_logprobs", "prompt_alt_tokens_k"):
        if body.get(name):
            raise InvalidArgumentError(
                f"{name}: not supported by this server yet (see the compatibility table)"
            )
    if body.get("target_prompt_logprobs") is not None:
        raise InvalidArgumentError("target_prompt_logprobs: not supported by this server")
    num_samples = field(body, "num_samples", int, 1)
    if num_samples < 1:
        raise InvalidArgumentError(f"num_samples: must be >= 1 (got {num_samples})")
    prompt = prompt_tokens(body.get("prompt"))
    scores = bool(field(body, "prompt_logprobs", bool, False))
    topk = field(body, "topk_prompt_logprobs", int, 0)
    last_n = body.get("prompt_logprobs_last_n")
    if last_n is not None:
        if not isinstance(last_n, int) or isinstance(last_n, bool):
            raise InvalidArgumentError("prompt_logprobs_last_n: expected an integer")
        if not scores:
            raise InvalidArgumentError("prompt_logprobs_last_n: needs prompt_logprobs")
        if not 1 <= last_n <= prompt.size - 1:
            raise InvalidArgumentError(
                f"prompt_logprobs_last_n: must be in 1..{prompt.size - 1} "
                f"(the prompt's length - 1), got {last_n}"
            )
    return SampleOp(
        prompt=prompt,
        num_samples=num_samples,
        params=sampling_config(body.get("sampling_params")),
        prompt_logprobs=scores,
        topk_prompt_logprobs=topk,
    )


def sample_encoder(body: Mapping[str, Any]) -> Callable[[SampleResult], bytes]:
    """The ``SampleResponse`` encoder of one ``asample`` request: with
    ``prompt_logprobs_last_n`` = N only the last N prompt positions keep scores."""
    last_n = body.get("prompt_logprobs_last_n")
    return lambda result: sample_response(result, last_n if isinstance(last_n, int) else None)


#: tinker's filler of a top-k row without a score (the first prompt position)
_TOPK_MASK_ID, _TOPK_MASK_LOGPROB = 0, -99999.0


def sample_response(result: SampleResult, last_n: int | None = None) -> bytes:
    msg = tinker_pb.SampleResponse()
    for seq in result.sequences:
        out = msg.sequences.add()
        out.stop_reason = _STOP.get(seq.stop_reason, tinker_pb.STOP_REASON_STOP)
        out.tokens = np.asarray(seq.tokens, dtype="<i4").tobytes()
        out.logprobs = np.asarray(seq.logprobs, dtype="<f4").tobytes()
    scores = result.prompt
    if scores is not None:
        skip = 0 if last_n is None else max(0, scores.topk_ids.shape[0] - last_n)
        if scores.logprobs is not None:
            lps = np.asarray(scores.logprobs, dtype="<f4").copy()
            lps[:skip] = np.nan
            msg.prompt_logprobs = lps.tobytes()
        P, k = scores.topk_ids.shape
        if k:
            ids_P_K = np.asarray(scores.topk_ids, dtype="<i4").copy()
            lps_P_K = np.asarray(scores.topk_logprobs, dtype="<f4").copy()
            unscored = (ids_P_K < 0) | np.isnan(lps_P_K)
            unscored[:skip] = True
            ids_P_K[unscored] = _TOPK_MASK_ID
            lps_P_K[unscored] = _TOPK_MASK_LOGPROB
            top = msg.topk_prompt_logprobs
            top.k, top.length = k, P
            top.token_ids = ids_P_K.tobytes()
            top.logprobs = lps_P_K.tobytes()
    return bytes(msg.SerializeToString())
