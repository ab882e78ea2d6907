"""The torch sampler's bookkeeping: its limits and stats, the requests and rows
it holds, the partial rollouts it keeps and its staging slots, and the small
pure helpers over them (``workers.sampler.torch_sampler`` steps them)."""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from treadle.common.engine.domain import SampleOp, SampleResult, SequenceResult, version_spans
from treadle.common.engine.model_config import ModelConfig
from treadle.workers.engine.versions import WeightSnapshot
from treadle.workers.model.kv_cache import KVCache
from treadle.workers.model.llama import LlamaParams
from treadle.workers.model.lora import LoraAdapter, LoraRows

if TYPE_CHECKING:  # the backend interface imports this module (SamplerStats)
    from treadle.workers.sampler.backend import OnSequence, SampleJob


@dataclass(frozen=True)
class SamplerLimits:
    """Sizes of one sampler (one per base model and dtype).

    ``num_slots`` rows decode together at most (the batch; 0: as many as
    ``kv_memory_fraction`` of the device's free memory holds, ``workers.device.memory_budget``);
    ``max_len`` is the context; ``prefill_slots`` prompts prefill at once and stay cached for
    prefix reuse; ``max_prefill_tokens`` caps prompt tokens computed per step
    (so a decode step is never delayed by more than that much prefill);
    ``max_queued`` requests wait at most, beyond that RESOURCE_EXHAUSTED;
    ``turn_cache_slots`` bounds the store of finished turns' KV kept for requests
    that ask (``SamplingConfig.cache_completion``), in slots of ``max_len`` tokens
    (0: none kept), counted against the memory an auto-sized cache plans for.
    """

    num_slots: int = 64
    max_len: int = 1024
    prefill_slots: int = 8
    max_prefill_tokens: int = 512
    max_queued: int = 4096
    #: the store of finished turns (``prefix_cache``), in slots of ``max_len`` tokens
    turn_cache_slots: int = 16
    log_every_s: float = 30.0
    #: share of free device memory an auto-sized (``num_slots`` 0) KV cache takes
    #: (0: the device's default, ``memory_budget.DEFAULT_FRACTION``)
    kv_memory_fraction: float = 0.0
    #: decode with weights prepacked for ``num_slots`` rows (fp32, or bf16 where the
    #: CPU multiplies it natively; a second copy of the weights of each of the last
    #: ``prepack_policy.MAX_PACKED`` versions decoded)
    prepack: bool = True
    #: each step's torch threads on the CPU: "measure" (one or all of the host's,
    #: whichever runs this kind and size of step faster here and now), "all", "one"
    #: (``workers.device.thread_choice``; ``--sampler-thread-policy``)
    thread_policy: str = "measure"

    def context_of(self, cfg: ModelConfig) -> int:
        """The context a request may fill on base ``cfg``: the KV cache's length, at
        most the model's positions. Training calls are held to the same limit
        (``TrainingModel.max_context``), so a datum the sampler could never have
        produced is refused alike."""
        return min(self.max_len, cfg.max_position_embeddings)


@dataclass
class TorchRequest:
    """The torch sampler's progress on one ``SampleJob``: where it is (queued,
    prefilling into ``stage_slot``, its ``rows`` decoding) and what it was
    charged. The request itself is ``job``, read through, never copied.

    ``snapshot`` starts as ``job.weights``; an in-flight update moves a queued
    request of a model's latest weights onto the new version (``swap_weights``)."""

    job: SampleJob
    future: Future[SampleResult]
    stop_ids: frozenset[int]
    seed: int
    prompt: np.ndarray  # int64 [P]
    snapshot: WeightSnapshot = field(init=False)
    rows: list[Row] = field(default_factory=list)
    stage_slot: int = -1
    prefilled: int = 0  # prompt tokens whose K/V are in the staging slot
    reused: int = 0  # of which copied from the prefix cache
    compute_s: float = 0.0  # its share of the forward passes it was in (usage accounting)
    tag: float = 0.0  # fair-queueing start tag: the queue is kept in tag order
    #: weights published in flight while the prompt was prefilling: the rows take
    #: them after their first token (drawn from the prompt's logits, old weights)
    swap_to: WeightSnapshot | None = None
    reported_s: float = 0.0  # compute_s already handed to on_sequence
    #: a resumed partial rollout (one row): what its earlier calls sampled
    prefix: Partial | None = None
    #: collects the prompt's scores when the request asked for them
    #: (``workers.prompt_logprobs.PromptScorer``; such a request reuses no prefix)
    scorer: Any = None

    def __post_init__(self) -> None:
        self.snapshot = self.job.weights

    @property
    def op(self) -> SampleOp:
        return self.job.op

    @property
    def tenant(self) -> str:
        return self.job.tenant

    @property
    def latest_of(self) -> str | None:
        """The model whose latest weights this request follows (in-flight updates reach it)."""
        return self.job.latest_of

    @property
    def owner(self) -> tuple[str, str]:
        """Who may resume its partial rows: (tenant, model id or "base:<name>")."""
        return self.job.owner

    @property
    def on_sequence(self) -> OnSequence | None:
        """Called (on the engine thread) as each row finishes with (index, sequence,
        engine seconds charged to the request since the previous call)."""
        return self.job.on_sequence

    @property
    def cancelled(self) -> bool:
        return self.future.cancelled()


@dataclass
class Row:
    request: TorchRequest
    index: int
    slot: int
    key: int  # the row's random stream: hash of (seed, index)
    snapshot: WeightSnapshot  # the weights decoding this row now
    position: int = 0  # tokens whose K/V are in the cache
    next_input: int = 0  # the last sampled token, fed at the next decode step
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)  # the weight version of each token
    stop_reason: str | None = None
    handle: str = ""  # its resume handle once it stopped "partial"


@dataclass
class Partial:
    """A partial rollout kept for resumption: the prompt and everything sampled so far."""

    owner: tuple[str, str]
    prompt: np.ndarray
    tokens: list[int]
    logprobs: list[float]
    versions: list[int]


@dataclass
class Staged:
    """What one staging slot holds: a prompt prefix and the weights that computed it."""

    tokens: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    params: weakref.ref[LlamaParams] | None = None
    adapter: weakref.ref[LoraAdapter] | None = None
    owner: TorchRequest | None = None  # the request prefilling into it now
    last_used: int = 0

    def computed_by(self, snap: WeightSnapshot) -> bool:
        if self.params is None or self.params() is not snap.params:
            return False
        if snap.adapter is None:
            return self.adapter is None
        return self.adapter is not None and self.adapter() is snap.adapter


def continued(
    prefix: Partial | None,
    owner: tuple[str, str],
    prompt: np.ndarray,
    tokens: list[int],
    logprobs: list[float],
    versions: list[int],
) -> Partial:
    """A row's rollout so far (new lists), the partial rollout it continues in front."""
    return Partial(
        owner=owner,
        prompt=prompt if prefix is None else prefix.prompt,
        tokens=(prefix.tokens if prefix else []) + tokens,
        logprobs=(prefix.logprobs if prefix else []) + logprobs,
        versions=(prefix.versions if prefix else []) + versions,
    )


def sequence_result(whole: Partial, stop_reason: str, handle: str) -> SequenceResult:
    """A rollout as the sequence a sample answers with."""
    return SequenceResult(
        tokens=np.asarray(whole.tokens, dtype=np.int64),
        logprobs=np.asarray(whole.logprobs, dtype=np.float32),
        stop_reason=stop_reason,
        versions=version_spans(whole.versions),
        resume_handle=handle,
    )


def partial_of(row: Row) -> Partial:
    """The row's rollout so far, earlier parts of a resumed one included."""
    req = row.request
    return continued(req.prefix, req.owner, req.prompt, row.tokens, row.logprobs, row.versions)


def sequence_of(row: Row) -> SequenceResult:
    """The row's sequence; a resumed partial rollout's includes its earlier parts."""
    return sequence_result(partial_of(row), row.stop_reason or "length", row.handle)


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the common prefix of two equally long token arrays."""
    diff = np.flatnonzero(a != b)
    return int(diff[0]) if diff.size else a.size


def start_tag(request: TorchRequest) -> float:
    return request.tag


def charge(items: Sequence[tuple[TorchRequest, int]], seconds: float) -> None:
    """Split a forward pass's time among its requests by the tokens each had in it."""
    total = sum(n for _, n in items) or 1
    for request, n in items:
        request.compute_s += seconds * n / total


def prefill_batches(chunks: list[tuple[TorchRequest, int]]) -> list[list[tuple[TorchRequest, int]]]:
    """Group prefill chunks into forwards: same base weights, and lengths close
    enough that padding to the longest wastes under a third of the batch."""
    by_params: dict[int, list[tuple[TorchRequest, int]]] = {}
    for req, n in chunks:
        by_params.setdefault(id(req.snapshot.params), []).append((req, n))
    batches: list[list[tuple[TorchRequest, int]]] = []
    for group in by_params.values():
        group.sort(key=lambda c: -c[1])
        current: list[tuple[TorchRequest, int]] = []
        real = 0
        for req, n in group:
            if current and (len(current) + 1) * current[0][1] > 1.5 * (real + n):
                batches.append(current)
                current, real = [], 0
            current.append((req, n))
            real += n
        if current:
            batches.append(current)
    return batches


def lora_for(adapters: Sequence[LoraAdapter | None]) -> LoraAdapter | LoraRows | None:
    unique: list[LoraAdapter] = []
    index: dict[int, int] = {}
    row_ids = []
    for a in adapters:
        if a is None:
            row_ids.append(-1)
            continue
        if id(a) not in index:
            index[id(a)] = len(unique)
            unique.append(a)
        row_ids.append(index[id(a)])
    if not unique:
        return None
    if len(unique) == 1 and -1 not in row_ids:
        return unique[0]
    return LoraRows(unique, row_ids)  # host ids: no device read to build it


def swap_weights(
    running: Sequence[Row],
    prefilling: Sequence[TorchRequest],
    queue: Iterable[TorchRequest],
    snapshot: WeightSnapshot,
) -> int:
    """An in-flight weight update (PipelineRL): every request following the
    latest weights of ``snapshot.model_id`` continues under ``snapshot``.

    Running rows decode their next token with it (their KV cache, computed
    under the old weights, is kept); requests still prefilling take it after
    their first token; queued ones prefill with it. Returns the running rows
    switched.
    """
    model_id = snapshot.model_id
    switched = 0
    for row in running:
        if row.request.latest_of == model_id and row.stop_reason is None:
            row.snapshot = snapshot
            switched += 1
    for req in prefilling:
        if req.latest_of == model_id:
            req.swap_to = snapshot
    for req in queue:
        if req.latest_of == model_id:
            req.snapshot = snapshot
    return switched


def compact(running: Sequence[Row], cache: KVCache) -> tuple[list[Row], list[Row]]:
    """The running rows without the finished ones, and the finished ones; rows from
    the end move into the holes the finished leave.

    Keeps ``running[i].slot == i``: the next decode reads slots ``0..n-1`` in
    place. One batched copy moves every displaced row's KV.

    Keeps the cache's invariant (``kv_cache``: cells beyond a slot's occupant's
    extent hold zeros; a row's extent is its ``position``): a move copies as far
    as the hole's former occupant wrote (the mover's cells past its own position
    are zeros, and overwrite what was there), and the slots left free,
    ``n..len(running)-1``, are zeroed as far as their former occupants wrote.
    """
    done = [r for r in running if r.stop_reason is not None]
    live = [r for r in running if r.stop_reason is None]
    n = len(live)
    holes = sorted(r.slot for r in done if r.slot < n)
    movers = [r for r in live if r.slot >= n]
    if movers:
        filled = [r for r in done if r.slot < n]
        length = max(r.position for r in movers + filled)
        cache.move([r.slot for r in movers], holes, length)
    vacated = [r for r in running if r.slot >= n]
    if vacated:
        cache.clear(range(n, len(running)), max(r.position for r in vacated))
    for r, hole in zip(movers, holes, strict=True):
        r.slot = hole
    live.sort(key=lambda r: r.slot)
    return live, done
