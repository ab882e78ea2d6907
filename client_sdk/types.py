"""Public types of the SDK: plain dataclasses, never protobuf.

Names and shapes follow the tinker SDK where it has one (``ModelInput.from_ints``,
``Datum(model_input, loss_fn_inputs)``, ``SamplingParams``, ``AdamParams``,
``sequences[i].tokens/.logprobs/.stop_reason``) so cookbook loops port with
little change.

Alignment convention (the tinker one): a datum's ``model_input`` holds the input
tokens ``x[0..T-1]``; every per-token array in ``loss_fn_inputs`` has length T and
refers to the *next-token target* at that position (``target_tokens[t]`` is the
token predicted from ``x[..t]``).
"""

from __future__ import annotations

import array as _array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from treadle.errors import InvalidArgumentError

#: Why a sequence ended, tinker's coarse value: "stop" for an EOS, a stop string
#: or a stop token alike (``SampledSequence.stopped_by`` tells which).
StopReason = Literal["stop", "length", "cancelled", "partial"]
#: What stopped a sequence whose ``stop_reason`` is "stop".
StoppedBy = Literal["eos", "stop_string", "stop_token"]

#: loss_fn_inputs keys holding integer tokens; every other key is float.
INT_INPUT_KEYS = frozenset({"target_tokens"})
_INT_DTYPES = (np.dtype(np.int64),)
_FLOAT_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


def to_numpy(value: Any, *, dtype: Any, field_name: str) -> np.ndarray:
    """Accept lists, numpy arrays and torch tensors (without importing torch)."""
    if hasattr(value, "detach") and hasattr(value, "cpu"):  # a torch tensor
        value = value.detach().cpu().numpy()
    try:
        arr = np.asarray(value, dtype=dtype)
    except (TypeError, ValueError) as exc:
        raise InvalidArgumentError(
            f"{field_name}: cannot convert to {np.dtype(dtype).name}: {exc}"
        ) from exc
    if arr.ndim != 1:
        raise InvalidArgumentError(f"{field_name}: expected a 1-D sequence, got shape {arr.shape}")
    return arr


@dataclass(frozen=True)
class ModelInput:
    """A token sequence fed to the model."""

    tokens: tuple[int, ...]

    @classmethod
    def from_ints(cls, tokens: Sequence[int] | np.ndarray | Any) -> ModelInput:
        if type(tokens) is list or type(tokens) is tuple:
            # a token list: int64's range and integer check without numpy (a float
            # or an int past int64 is refused here and takes numpy's path, as before)
            try:
                return cls(tuple(_array.array("q", tokens)))
            except (TypeError, OverflowError):
                pass
        arr = to_numpy(tokens, dtype=np.int64, field_name="model_input.tokens")
        return cls(tuple(int(t) for t in arr))

    @classmethod
    def empty(cls) -> ModelInput:
        return cls(())

    def to_ints(self) -> list[int]:
        return list(self.tokens)

    @property
    def length(self) -> int:
        return len(self.tokens)

    def append(self, tokens: Sequence[int]) -> ModelInput:
        return ModelInput(self.tokens + tuple(int(t) for t in tokens))

    def __len__(self) -> int:
        return len(self.tokens)


@dataclass(frozen=True)
class Datum:
    """One training example: input tokens plus per-token loss inputs."""

    model_input: ModelInput
    loss_fn_inputs: Mapping[str, np.ndarray] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.model_input, ModelInput):
            object.__setattr__(self, "model_input", ModelInput.from_ints(self.model_input))
        converted: dict[str, np.ndarray] = {}
        for key, value in self.loss_fn_inputs.items():
            if (
                type(value) is np.ndarray
                and value.ndim == 1
                and value.dtype in (_INT_DTYPES if key in INT_INPUT_KEYS else _FLOAT_DTYPES)
            ):
                # what to_numpy returns for it (build_datums' arrays; float64 is kept for
                # float64 models), without its cost; ``in`` tries identity before ==
                converted[key] = value
                continue
            dtype: type = np.int64 if key in INT_INPUT_KEYS else np.float32
            if (
                isinstance(value, np.ndarray)
                and value.dtype == np.float64
                and key not in INT_INPUT_KEYS
            ):
                dtype = np.float64  # keep float64 inputs for float64 models
            converted[key] = to_numpy(value, dtype=dtype, field_name=f"loss_fn_inputs.{key}")
        object.__setattr__(self, "loss_fn_inputs", converted)


@dataclass(frozen=True)
class SamplingParams:
    """How to sample. ``None`` leaves a knob unset (the server's default), which
    is never the same as an explicit value:

    * ``temperature``: unset = 1. ``0`` is greedy: every sample of a request is
      the argmax path (identical), and each returned logprob is that token's
      ``log_softmax`` at temperature 1. Greedy samples cannot train a policy
      (a group of identical samples has zero advantage): ``treadle.rl`` refuses them.
    * ``top_p``: unset = 1 (off); an explicit value must lie in (0, 1].
    * ``top_k``: unset, ``0`` or ``-1`` = off (vLLM's and TRL's 0, tinker's -1);
      below -1 is refused.
    * ``stop``: a string is ONE stop string (``stop="</answer>"``); a list holds
      stop strings and/or stop token ids. Nothing is cut from the output: the
      token that completes a stop string, or the stop token, is the last one
      returned (``SampledSequence.stopped_by`` says which stopped it).
    """

    max_tokens: int = 16
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stop: str | Sequence[str | int] | None = None
    seed: int | None = None
    #: partial rollouts (Kimi k1.5): at most this many tokens per sequence in this
    #: call (0 = no budget); a sequence reaching it first comes back with
    #: stop_reason "partial" and a ``resume_handle`` for ``SamplingClient.resume``
    token_budget: int = 0
    #: EOS does not stop a sequence: it runs to ``max_tokens`` (or a ``stop``);
    #: for benchmarks and length-controlled rollouts (vLLM's ``ignore_eos``)
    ignore_eos: bool = False
    #: keep this request's prompt + completion KV on the sampler after it finishes
    #: (one sample per request only), so a next request whose prompt extends them
    #: (an agent episode's next turn) prefills only its new tokens. It costs the
    #: sampler memory: ask only when such a follow-up is likely (the episode loops
    #: of ``treadle.rl`` set it on every turn that may be followed by another).
    #: gRPC only; the tinker-compatible HTTP API has no such field.
    cache_completion: bool = False


@dataclass(frozen=True)
class StreamedSample:
    """One sample of ``SamplingClient.sample_stream``, yielded the moment it finished."""

    index: int  # within the request, 0..num_samples-1
    sequence: SampledSequence


@dataclass(frozen=True)
class AdamParams:
    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0  # 0 disables clipping


@dataclass(frozen=True)
class VersionSpan:
    """Tokens ``[start, start + length)`` of a sequence were written by weight ``version``."""

    start: int
    length: int
    version: int


@dataclass(frozen=True)
class SampledSequence:
    tokens: list[int]
    logprobs: list[float]
    stop_reason: StopReason
    versions: list[VersionSpan] = field(default_factory=list)
    #: set when stop_reason is "partial": pass it to ``SamplingClient.resume``
    resume_handle: str | None = None
    #: set when stop_reason is "stop": the model's EOS, one of the request's stop
    #: strings (its tokens end ``tokens``) or one of its stop token ids (the last token)
    stopped_by: StoppedBy | None = None

    def token_versions(self) -> list[int]:
        out: list[int] = []
        for span in self.versions:
            out.extend([span.version] * span.length)
        return out


@dataclass(frozen=True)
class SampleResponse:
    sequences: list[SampledSequence]
    #: with ``include_prompt_logprobs``: one per prompt token, None for the first
    prompt_logprobs: list[float | None] | None = None
    #: with ``topk_prompt_logprobs=k``: per prompt position the k most likely
    #: ``(token, logprob)`` pairs, most likely first; None for the first position
    topk_prompt_logprobs: list[list[tuple[int, float]] | None] | None = None


@dataclass(frozen=True)
class LossFnOutput:
    """Per-datum outputs: at least ``logprobs`` (length T, one per target)."""

    logprobs: np.ndarray
    extra: Mapping[str, np.ndarray] = field(default_factory=dict)

    def __getitem__(self, key: str) -> np.ndarray:
        if key == "logprobs":
            return self.logprobs
        return self.extra[key]


@dataclass(frozen=True)
class ForwardBackwardOutput:
    loss_fn_outputs: list[LossFnOutput]
    metrics: dict[str, float]


@dataclass(frozen=True)
class OptimStepResponse:
    step: int
    metrics: dict[str, float]


@dataclass(frozen=True)
class SaveStateResponse:
    path: str
    seq_id: int
    step: int


@dataclass(frozen=True)
class RunUsage:
    """What a model (a run) used, its samplers' samples included
    (``TrainingClient.get_usage``); ``cost`` is None when the server has no prices."""

    model_id: str
    tokens_trained: int
    tokens_sampled: int
    tokens_scored: int
    calls: int
    device_s: float
    cost: float | None
    currency: str


@dataclass(frozen=True)
class CheckpointInfo:
    path: str
    name: str
    seq_id: int
    step: int
    created_at: float
    size_bytes: int


@dataclass(frozen=True)
class ModelInfo:
    model_id: str
    base_model: str
    is_lora: bool
    lora_rank: int
    dtype: str
    version: int
    next_seq_id: int
    last_checkpoint_seq_id: int
    status: str  # "active", "unloaded" (idle past the server's TTL; comes back on use), ...
    created_at: float
    session_id: str = ""  # the client session it was created in
    #: the caller's notes on the run, as given at creation (tinker's user_metadata)
    user_metadata: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class BaseModelInfo:
    """A base model the server serves.

    ``vocab_size`` is the model's: the rows of its embedding and output layers
    (``config.json``'s ``vocab_size``), the range of token ids it accepts and
    samples. Models often pad it past their tokenizer's (the ``demo`` preset:
    104 rows for the tokenizer's 99 ids); ``Tokenizer.vocab_size`` is the
    tokenizer's. Ids in between are valid but have no text.
    """

    name: str
    arch: str
    vocab_size: int  # the model's embedding rows; >= Tokenizer.vocab_size
    max_context: int
    num_params: int
    dtype: str


@dataclass(frozen=True)
class SamplerMetrics:
    """A sampler's live progress (one per base model and dtype on the server)."""

    base_model: str
    dtype: str
    tokens_per_s: float  # generated tokens per second, recent decode steps
    occupancy: float  # mean fraction of KV slots decoding per step, recent steps
    running_rows: int  # sequences decoding now
    num_slots: int  # the most sequences that decode together
    queued_requests: int  # requests waiting for slots (queue depth)
    prefilling_requests: int
    tokens_generated: int
    prompt_tokens: int
    prefix_reused_tokens: int
    # the fraction of the KV cache in use at the last step, and the largest over
    # recent steps (the vllm backend; 0 on torch, whose cache is preallocated slots)
    kv_cache_usage: float = 0.0
    kv_cache_peak_usage: float = 0.0


@dataclass(frozen=True)
class TrainingPassMetrics:
    """Whether training calls of different models shared the base model's passes
    (one per base model and dtype on the server): a sweep's runs batch together
    when ``calls_batched`` grows and ``calls_alone`` does not."""

    base_model: str
    dtype: str
    passes: int  # forward passes run (a batched pass counts once)
    batched_passes: int  # passes that held two or more calls
    calls_batched: int
    calls_alone: int
    tokens_batched: int
    tokens_alone: int
    calls_per_batched_pass: float
    max_calls_per_pass: int


@dataclass(frozen=True)
class WorkerInfo:
    """A ``treadle worker`` of a distributed server (``ServerInfo.workers``)."""

    worker_id: str
    #: "both" (trains and samples), "trainer", or "sampler" (a sampler pool worker)
    role: str
    status: str  # "live" or "draining"
    base_models: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class ServerInfo:
    server_version: str
    api_version: str
    base_models: list[BaseModelInfo]
    max_message_bytes: int
    max_tokens_per_request: int
    features: list[str] = field(default_factory=list)
    sampler_metrics: list[SamplerMetrics] = field(default_factory=list)
    training_pass_metrics: list[TrainingPassMetrics] = field(default_factory=list)
    #: the tenant's ``max_models`` quota (0: no limit, or a server too old to say)
    max_models: int = 0
    #: the tenant's models that count against ``max_models`` now
    live_models: int = 0
    #: the serving workers of a distributed server, with their roles (empty: embedded)
    workers: list[WorkerInfo] = field(default_factory=list)
