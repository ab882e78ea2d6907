"""Domain types of the engine: frozen dataclasses, no protobuf, no torch.

The server converts wire messages into these (``treadle.server.rpc.convert``) and the
engine works only with them, so the engine runs the same behind the in-process
dispatcher and behind a Celery worker.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

#: Ops that nothing after them may overtake (DESIGN.md, invariant 1).
BARRIER_KINDS = frozenset({"optim_step", "sync_weights", "save_state", "load_state"})


@dataclass(frozen=True)
class ModelSpec:
    model_id: str
    tenant_id: str
    base_model: str
    lora_rank: int  # 0 = full fine-tune
    lora_alpha: float
    seed: int
    dtype: str  # "float32" | "float64" | "bfloat16"
    #: which modules a LoRA model adapts (the tinker SDK's flags; docs/lora.md)
    train_attn: bool = True
    train_mlp: bool = True
    train_unembed: bool = True

    @property
    def is_lora(self) -> bool:
        return self.lora_rank > 0


@dataclass(frozen=True)
class DatumData:
    """One datum: input tokens [T] and per-token loss inputs [T] (next-token aligned)."""

    tokens: np.ndarray
    inputs: Mapping[str, np.ndarray] = field(default_factory=dict)


@dataclass(frozen=True)
class AdamConfig:
    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0


# ---- ordered ops -------------------------------------------------------------


@dataclass(frozen=True)
class ForwardBackwardOp:
    data: tuple[DatumData, ...]
    loss_fn: str
    loss_config: Mapping[str, float]
    temperature: float = 1.0
    kind: str = "forward_backward"
    #: storage paths the op reads / writes, staged by ``StagedEngine`` (``messages``)
    fetches: ClassVar[tuple[str, ...]] = ()
    uploads: ClassVar[tuple[str, ...]] = ()


@dataclass(frozen=True)
class ReferenceWeights:
    """Weights a ``ForwardLogprobs`` reads instead of the model's own: a state the
    tenant saved (``directory``, resolved by the server, which also checked
    ownership and base model) or a version still kept (``model_id``, ``version``).
    ``uri`` is the ``treadle://`` path as the user wrote it (for messages)."""

    uri: str
    directory: str = ""
    model_id: str = ""
    version: int = -1


@dataclass(frozen=True)
class ForwardLogprobsOp:
    data: tuple[DatumData, ...]
    reference: bool = False  # the base model (LoRA off / the frozen base weights)
    temperature: float = 1.0
    kind: str = "forward_logprobs"
    #: another reference the tenant owns (``reference`` is then False)
    reference_weights: ReferenceWeights | None = None
    #: a saved state as the reference is downloaded first (a kept version is not)
    fetches: ClassVar[tuple[str, ...]] = ("reference_weights.directory",)
    uploads: ClassVar[tuple[str, ...]] = ()


@dataclass(frozen=True)
class OptimStepOp:
    adam: AdamConfig
    kind: str = "optim_step"
    fetches: ClassVar[tuple[str, ...]] = ()
    uploads: ClassVar[tuple[str, ...]] = ()


@dataclass(frozen=True)
class SyncWeightsOp:
    #: PipelineRL: sequences still generating on a ``latest`` sampler of the model
    #: switch to the new weights from their next decode step (docs/engine.md)
    inflight: bool = False
    kind: str = "sync_weights"
    fetches: ClassVar[tuple[str, ...]] = ()
    uploads: ClassVar[tuple[str, ...]] = ()


@dataclass(frozen=True)
class SaveStateOp:
    name: str
    directory: str  # where the engine writes; resolved by the server's store
    kind: str = "save_state"
    fetches: ClassVar[tuple[str, ...]] = ()
    uploads: ClassVar[tuple[str, ...]] = ("directory",)


@dataclass(frozen=True)
class LoadStateOp:
    directory: str
    kind: str = "load_state"
    #: False: the weights only, with fresh Adam moments (tinker's ``load_state``)
    optimizer: bool = True
    fetches: ClassVar[tuple[str, ...]] = ("directory",)
    uploads: ClassVar[tuple[str, ...]] = ()


@dataclass(frozen=True)
class RejectedOp:
    """A call the server could not even decode (bad input, unknown path). It still
    takes its seq_id, so later calls are not left waiting for it, and a repeat
    answers the same error."""

    error: Exception
    kind: str = "rejected"
    fetches: ClassVar[tuple[str, ...]] = ()
    uploads: ClassVar[tuple[str, ...]] = ()


OrderedOp = (
    RejectedOp
    | ForwardBackwardOp
    | ForwardLogprobsOp
    | OptimStepOp
    | SyncWeightsOp
    | SaveStateOp
    | LoadStateOp
)


def token_cost(op: OrderedOp) -> int:
    """The fair-share cost of an ordered call: the tokens in its batch (barriers 0)."""
    data = getattr(op, "data", None)
    return sum(int(d.tokens.size) for d in data) if data else 0


#: the weight dtypes a model may be created with (``ModelSpec.dtype``)
DTYPES = ("float32", "float64", "bfloat16")


# ---- results -----------------------------------------------------------------


@dataclass(frozen=True)
class ForwardResult:
    logprobs: tuple[np.ndarray, ...]  # one [T] array per datum
    metrics: Mapping[str, float]
    compute_s: float = 0.0  # engine seconds spent on it (usage accounting)


@dataclass(frozen=True)
class AutoCheckpoint:
    directory: str
    seq_id: int
    step: int
    size_bytes: int


@dataclass(frozen=True)
class OptimStepResult:
    step: int
    metrics: Mapping[str, float]
    #: set when the auto-checkpoint policy saved the state right after this step
    auto_checkpoint: AutoCheckpoint | None = None
    compute_s: float = 0.0  # engine seconds spent on it (usage accounting)


@dataclass(frozen=True)
class SyncResult:
    version: int
    compute_s: float = 0.0  # engine seconds spent on it (usage accounting)


@dataclass(frozen=True)
class SaveResult:
    step: int
    seq_id: int
    size_bytes: int
    compute_s: float = 0.0  # engine seconds spent on it (usage accounting)


@dataclass(frozen=True)
class LoadResult:
    step: int
    compute_s: float = 0.0  # engine seconds spent on it (usage accounting)


OpResult = ForwardResult | OptimStepResult | SyncResult | SaveResult | LoadResult


# ---- sampling ----------------------------------------------------------------


@dataclass(frozen=True)
class SamplingConfig:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0 = off
    stop_strings: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    # Engine-level only (benchmarks): EOS does not stop a sequence, so every
    # sequence runs to max_tokens; explicit stop_token_ids still stop it.
    ignore_eos: bool = False
    #: partial rollouts: a sequence that samples this many tokens in this call
    #: (0 = no budget) stops with "partial" and a resume handle
    token_budget: int = 0
    #: keep this single-sample request's prompt + completion KV after it finishes,
    #: so a next request extending them (an agent episode's next turn) prefills only
    #: what is new (the torch sampler's store of turns, ``workers.sampler.prefix_cache``)
    cache_completion: bool = False


#: where a sampler samples on a distributed server: on its model's worker
#: (``colocated``), on the sampler workers of its base (``pool``), or the pool when
#: one serves the base, else colocated (``auto``); the server's
#: ``--sampler-placement``, overridable per sampler at creation
SAMPLER_PLACEMENTS = ("colocated", "pool", "auto")


@dataclass(frozen=True)
class SamplerTarget:
    """Which weights a sampler reads: the base, one version, or a model's latest."""

    base_model: str
    model_id: str | None = None
    version: int | None = None  # None with a model_id = follow latest
    tenant_id: str = ""  # whose request (the sampler queues tenants fairly)
    #: one of ``SAMPLER_PLACEMENTS`` chosen for this sampler; "" = the server's. The
    #: server routes by it; an engine never reads it
    placement: str = ""

    @property
    def follows_latest(self) -> bool:
        return self.model_id is not None and self.version is None

    @property
    def latest_of(self) -> str | None:
        """The model whose in-flight updates a request of this target takes, if any."""
        return self.model_id if self.follows_latest else None


@dataclass(frozen=True)
class SampleOp:
    prompt: np.ndarray  # int64 [T]
    num_samples: int
    params: SamplingConfig
    #: score every prompt token (``SampleResult.prompt``), from the prefill
    #: the request runs anyway, at the request's temperature
    prompt_logprobs: bool = False
    #: the k most likely tokens at every prompt position, with their logprobs (0 = none)
    topk_prompt_logprobs: int = 0

    @property
    def scores_prompt(self) -> bool:
        return self.prompt_logprobs or self.topk_prompt_logprobs > 0


@dataclass(frozen=True)
class SequenceResult:
    tokens: np.ndarray  # int64 [n]
    logprobs: np.ndarray  # float32 [n]
    #: the wire's StopReason names: "stop" (EOS) | "stop_string" | "stop_token" |
    #: "length" | "cancelled" | "partial"
    stop_reason: str
    #: one (start, length, version) span per run of tokens sampled under one version
    versions: tuple[tuple[int, int, int], ...]  # (start, length, version) spans
    resume_handle: str = ""  # set with "partial": continues it (Engine.resume)


@dataclass(frozen=True)
class StreamedSequence:
    """One sample of a streamed request, sent the moment it finished."""

    index: int  # within the request, 0..num_samples-1
    sequence: SequenceResult
    compute_s: float = 0.0  # engine seconds charged to the request since the previous one


@dataclass(frozen=True)
class PromptLogprobs:
    """The prompt's scores: ``log_softmax(logits / T)`` at each prompt position,
    from the logits of the position before it (T: the request's temperature; 1
    when it samples greedily). Position 0 has nothing before it: NaN there, and
    a top-k row of ids -1 and logprobs NaN."""

    logprobs: np.ndarray | None  # float32 [P], NaN at 0; None when only the top k was asked
    topk_ids: np.ndarray  # int64 [P, k]; k = 0 when no top-k was asked
    topk_logprobs: np.ndarray  # float32 [P, k], each row in descending order


@dataclass(frozen=True)
class SampleResult:
    sequences: tuple[SequenceResult, ...]
    compute_s: float = 0.0  # engine seconds spent on it (usage accounting)
    #: a resume: the tokens of earlier calls included in ``sequences`` (prefilled
    #: again in this call, not sampled by it)
    resumed_tokens: int = 0
    #: set when the request asked for prompt logprobs or top-k prompt logprobs
    prompt: PromptLogprobs | None = None


@dataclass(frozen=True)
class ModelStatus:
    model_id: str
    version: int
    next_seq_id: int
    last_checkpoint_seq_id: int


def version_spans(token_versions: list[int]) -> tuple[tuple[int, int, int], ...]:
    """Run-length encode per-token versions into (start, length, version) spans."""
    if token_versions and token_versions.count(token_versions[0]) == len(token_versions):
        return ((0, len(token_versions), token_versions[0]),)  # one version (a C-speed count)
    spans: list[tuple[int, int, int]] = []
    for i, v in enumerate(token_versions):
        if spans and spans[-1][2] == v:
            start, length, _ = spans[-1]
            spans[-1] = (start, length + 1, v)
        else:
            spans.append((i, 1, v))
    return tuple(spans)


@dataclass(frozen=True)
class TenantQueue:
    """A tenant's calls in an engine's scheduler, as the operator sees them."""

    tenant_id: str
    waiting: int  # ordered calls queued and not started (waiting their turn or a gap)
    running: int  # handed to the trainer, not finished
    deficit: int  # fair-share (DRR) tokens earned and not yet spent; < 0: borrowed
