"""The one interface between the engine and a sampler backend.

The engine resolves *which* weights a request reads (a ``WeightSnapshot``: a
pinned version, a model's latest, or the base) and hands the request to its
``SamplerBackend``; the backend owns everything after that: its queue, its
KV cache, its own stepping loop (a thread, a process, an inference engine's
own loop, or, for the inline torch backend, slices of the engine thread that
it asks for at ``start``). The engine never steps a backend and never asks
which one it has.

Every backend keeps the same contracts: the logprob of a sampled token is
``log_softmax(logits / T)`` at the request's temperature, before top-k/top-p;
every token carries the weight version that produced it (``version_spans``);
a ``token_budget`` stops a sequence with ``"partial"`` and a resume handle that
``resume`` continues; a ``publish`` with ``inflight=True`` moves the running
and queued requests of that model's ``latest`` samplers onto the new weights
from their next token. A request's errors go to its future (INVALID_ARGUMENT
naming the field, RESOURCE_EXHAUSTED when full, UNAVAILABLE when the backend's
host died): ``submit`` and ``resume`` never raise.

Cancelling a request's future cancels the request: its rows are freed at the
backend's next step and nothing more is reported for it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Protocol

import torch

from treadle.common.engine.domain import (
    SampleOp,
    SampleResult,
    SamplerTarget,
    SamplingConfig,
    SequenceResult,
)
from treadle.common.engine.model_config import ModelConfig
from treadle.common.engine.stats import SamplerStats
from treadle.errors import TreadleError
from treadle.workers.engine.base_models import BaseModel
from treadle.workers.engine.versions import WeightSnapshot
from treadle.workers.model.params import LlamaParams
from treadle.workers.model.published import WeightsFile, WholeWeights

#: called with (sample index, sequence, engine seconds charged since the previous
#: call) as each sample of a streamed request finishes; must not block
OnSequence = Callable[[int, SequenceResult, float], None]


@dataclass(frozen=True)
class SampleJob:
    """``op.num_samples`` samples of ``op.prompt`` (token ids) under ``weights``: the
    one engine-internal shape of a sample request, what every backend is handed.

    It carries the domain types as they came (``op``: the sampling parameters,
    the per-request seed, the ``token_budget`` of partial rollouts; ``target``:
    whose request it is and which weights it follows) and adds only what the
    engine resolved: the ``base`` and the ``weights`` it reads. ``on_sequence``
    set: a streamed request (each sample reported as it finishes, then the
    whole result). A backend keeps its progress on a job in its own record (the
    torch sampler's ``TorchRequest``, which reads the job's fields through it;
    the vLLM backend's ``VllmRequest``), not in another request type.

    ``target`` is the domain's own record of whose request it is, so the engine
    makes no copy of it: its tenant is the fair-queueing key, its ``latest_of``
    the model whose in-flight updates the job takes, and ``owner_of(target)``
    who may resume its partial rollouts."""

    base: BaseModel
    op: SampleOp
    weights: WeightSnapshot
    target: SamplerTarget = SamplerTarget("")
    on_sequence: OnSequence | None = None

    @property
    def tenant(self) -> str:
        """The fair-queueing key: tenants take turns, never first come first served."""
        return self.target.tenant_id

    @property
    def latest_of(self) -> str | None:
        """The model whose in-flight updates it takes (None: pinned)."""
        return self.target.latest_of

    @property
    def owner(self) -> tuple[str, str]:
        return owner_of(self.target)


@dataclass(frozen=True)
class ResumeJob:
    """Continue the partial rollouts of ``handles`` (consumed, all or none) under
    ``weights``: each re-prefilled from its prompt and tokens so far, then sampled
    on with ``params`` (``max_tokens`` counts the whole sequence). The result
    holds the sequences whole, earlier parts first. ``target`` as in
    ``SampleJob``: only its owner may resume them."""

    base: BaseModel
    handles: tuple[str, ...]
    params: SamplingConfig
    weights: WeightSnapshot
    target: SamplerTarget = SamplerTarget("")

    @property
    def owner(self) -> tuple[str, str]:
        return owner_of(self.target)


def owner_of(target: SamplerTarget) -> tuple[str, str]:
    """Who may resume a request's partial rollouts: the tenant, on the same model
    (or base). Another owner's handle is NOT_FOUND."""
    return (target.tenant_id, target.model_id or f"base:{target.base_model}")


class EngineThread(Protocol):
    """What the engine offers a backend at ``start``: slices of its own thread.

    A backend without a loop of its own (the inline torch backend) shares the
    engine thread: ``run_between_calls(has_work, run_once)`` makes the engine
    call ``run_once`` between two rounds of training calls whenever ``has_work``
    is true (and not sleep while it is). Backends with their own loop ignore it.
    """

    def run_between_calls(self, has_work: Callable[[], bool], run_once: Callable[[], None]) -> None:
        """Register a task the engine thread runs between its rounds of calls."""
        ...


class SamplerBackend(Protocol):
    """A sampler backend: what the engine calls, and all it calls.

    ``submit``, ``resume``, ``publish`` and ``release`` are called on the engine
    thread, in the order the engine decides them (so an in-flight update
    reaches every request submitted before it, and none submitted after it
    samples with older weights), and never block on sampling. ``stats`` is
    called from any thread.
    """

    #: a name for logs and ``GetServerInfo``: "torch", "torch-thread", ...
    name: str
    #: whether the backend samples from the base weights this process holds
    #: (``BaseModel.params``, a LoRA version's base): the torch backends. vLLM loads
    #: the base from its checkpoint and a LoRA version as an adapter directory, so a
    #: worker group's rank 0 need not keep a LoRA base whole for it (only its shards).
    reads_base_weights: bool

    def start(self, engine: EngineThread) -> None:
        """Start the backend's host (thread, process, inference engine)."""
        ...

    def close(self, error: TreadleError, timeout: float = 10.0) -> None:
        """Fail every request still queued or running with ``error``, then stop."""
        ...

    def max_context(self, cfg: ModelConfig) -> int:
        """The longest sequence (prompt + sampled tokens) a request may have on a
        base of ``cfg``; training calls are held to the same limit."""
        ...

    def keep_weights(self, weights: WholeWeights) -> LlamaParams | WeightsFile:
        """A full fine-tune's published version, kept as this backend reads it: handed
        one whole tensor at a time (on a worker group each gathered in turn), copied
        as it comes (``workers.model.published``): a plain clone (``clone_weights``),
        one shared-memory buffer a sampler process maps, or a file vLLM reloads
        from (nothing of it kept in this process)."""
        ...

    def version_memory(self, device: torch.device) -> torch.device | None:
        """The memory a version ``keep_weights`` keeps takes its bytes from, for a
        full fine-tune whose weights are on ``device``: ``device`` itself (a clone),
        the host's RAM (``cpu``: a shared-memory buffer; a file in ``/dev/shm``, a
        tmpfs), or None (a file on disk: no memory). ``memory_budget`` counts a
        model's ``--keep-versions`` copies against that memory's free bytes."""
        ...

    def submit(self, job: SampleJob, future: Future[SampleResult]) -> None:
        """Queue a request; its result (or error) goes to ``future``."""
        ...

    def resume(self, job: ResumeJob, future: Future[SampleResult]) -> None:
        """Queue the continuation of partial rollouts; the result goes to ``future``."""
        ...

    def publish(self, base: BaseModel, weights: WeightSnapshot, *, inflight: bool) -> None:
        """A new weight version of ``weights.model_id`` (a LoRA adapter on ``base``'s
        weights, or full weights) exists. ``inflight``: the requests following
        that model's latest weights continue under it from their next token."""
        ...

    def release(self, model_id: str, versions: Sequence[int]) -> None:
        """These versions of ``model_id`` are no longer kept: no new request reads
        them (running ones may finish with them). A backend holding a copy (a
        loaded adapter) may let it go."""
        ...

    def fail_all(self, error: TreadleError) -> None:
        """Fail every request queued or running with ``error`` (the backend stays up)."""
        ...

    def training(self) -> None:
        """A round of training passes is about to run on the engine thread (called
        before each such round). A backend that shares a device with the trainer
        may free memory here (``--vllm-sleep-during-training``); the others do nothing."""
        ...

    def stats(self) -> list[SamplerStats]:
        """The latest stats of each of its samplers (one per base model and dtype)."""
        ...
