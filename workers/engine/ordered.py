"""The ordered-call executor: admits a training model's calls to the scheduler,
runs the units it hands out (batched across LoRA models of one base where it
can: ``workers.trainer.batching``), applies each op and settles its future.

Everything here runs on the engine thread (``workers.engine.loop``).
"""

from __future__ import annotations

import logging
import time
import traceback
from collections.abc import Sequence
from concurrent.futures import Future
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from treadle.common.engine.domain import (
    AutoCheckpoint,
    ForwardBackwardOp,
    ForwardLogprobsOp,
    OpResult,
    OptimStepResult,
    OrderedOp,
)
from treadle.common.engine.stats import PassCounter
from treadle.common.futures import settle
from treadle.errors import (
    FailedPreconditionError,
    InternalError,
    InvalidArgumentError,
    NotFoundError,
    TreadleError,
)
from treadle.workers.device import device
from treadle.workers.device.pass_threads import pass_threads
from treadle.workers.device.thread_choice import ThreadChoice
from treadle.workers.engine import op_handlers
from treadle.workers.engine.call_stats import CallStats
from treadle.workers.engine.config import EngineConfig
from treadle.workers.engine.models import ModelRegistry
from treadle.workers.engine.peers import Peers
from treadle.workers.engine.scheduler import Admission, QueuedCall, Scheduler, WorkUnit
from treadle.workers.engine.versions import VersionStore, WeightSnapshot
from treadle.workers.sampler.backend import SamplerBackend
from treadle.workers.trainer.batching import BatchCall, batch_key, batchable
from treadle.workers.trainer.trainer import TrainingModel

log = logging.getLogger("treadle.engine")


@dataclass(frozen=True)
class Applied:
    """One ordered call the executor ran (or answered without running)."""

    model_id: str
    seq_id: int
    kind: str
    #: False: answered without running (timed out, model deleted, shutdown)
    ran: bool
    error: str = ""


@dataclass(frozen=True)
class StepReport:
    """What one ``Engine.step`` did."""

    #: the ordered calls resolved, in the order they were (ran or answered without running)
    calls: tuple[Applied, ...]
    #: how many tasks of the inbox (submissions, lifecycle calls) ran
    inbox: int
    #: whether a backend's between-calls task (the inline sampler's step) ran
    sampled: bool


class OrderedExecutor:
    def __init__(
        self,
        config: EngineConfig,
        where: torch.device,
        registry: ModelRegistry,
        scheduler: Scheduler,
        versions: VersionStore,
        sampler: SamplerBackend,
        peers: Peers,
    ) -> None:
        self.config = config
        #: the other ranks, which execute each state-changing op too (``engine.peers``)
        self.peers = peers
        self.device = where
        self.registry = registry
        self.scheduler = scheduler
        self.versions = versions
        self.sampler = sampler
        self.threads = ThreadChoice(config.training_threads)
        self.passes = PassCounter()
        self.call_stats = CallStats()
        #: what was resolved since ``take_applied`` (``Engine.step``'s report)
        self._applied: list[Applied] = []

    def take_applied(self) -> list[Applied]:
        out, self._applied = self._applied, []
        return out

    # ---- admission -----------------------------------------------------------------------

    def admit(self, call: QueuedCall) -> None:
        outcome = self.scheduler.submit(call)
        fut: Future[Any] = call.handle
        if outcome.admission is Admission.QUEUED:
            model = self.registry.models.get(call.model_id)
            tenant = model.spec.tenant_id if model is not None else ""
            self.call_stats.queued(call.model_id, call.seq_id, tenant, call.arrived_at)
            return
        if outcome.admission is Admission.DUPLICATE_PENDING:
            return
        if outcome.admission is Admission.DUPLICATE_DONE:
            settle(fut, outcome.recorded)
        elif outcome.admission is Admission.UNKNOWN_MODEL:
            fut.set_exception(NotFoundError(outcome.message))
        else:  # CONFLICT, EXPIRED
            fut.set_exception(FailedPreconditionError(outcome.message))

    # ---- execution -----------------------------------------------------------------------

    def _threads_for(
        self, kind: str, tokens: int, model: TrainingModel
    ) -> AbstractContextManager[None]:
        """The pass's thread count, measured on the CPU (``workers.device.pass_threads``)."""
        return pass_threads(self.threads, self.device, kind, float(tokens * model.cfg.num_params()))

    def execute(self, call: QueuedCall) -> None:
        model = self.registry.models[call.model_id]
        self.call_stats.started(call.model_id, call.seq_id)
        t0 = time.perf_counter()
        outcome: Any
        try:
            with self._threads_for(call.kind, call.cost, model):
                outcome = self.apply(model, call.seq_id, call.payload)
        except TreadleError as err:
            outcome = err
        except torch.OutOfMemoryError as err:
            # what the call allocated is garbage by now; gradients are added all at once
            # at the end (``trainer.accumulate_gradients``), a version published only whole
            outcome = device.out_of_memory(call.kind, err, self.device)
        except Exception as err:
            log.error("engine: %s failed: %s\n%s", call.kind, err, traceback.format_exc())
            outcome = InternalError(f"{call.kind} failed: {type(err).__name__}: {err}")
        spent = time.perf_counter() - t0
        self.resolve(call, _with_compute(outcome, spent), record=True)

    def execute_units(self, units: Sequence[WorkUnit]) -> None:
        """Run one round of work units, each model's calls in seq_id order.

        The leading ``ForwardBackward``/``ForwardLogprobs`` calls of every LoRA
        model on the same base (everything before its next barrier) run as one
        batched pass (``workers.trainer.batching``; on a group of ranks each rank runs its
        share of every call's datums, ``Peers.run_batch``); the rest of each unit one by one.
        """
        groups: dict[tuple[int, torch.dtype], list[tuple[QueuedCall, TrainingModel]]] = {}
        rests: list[tuple[QueuedCall, ...]] = []
        for unit in units:
            model = self.registry.models.get(unit.model_id)
            n = 0
            if model is not None and self.config.batch_across_models:
                while n < len(unit.calls) and batchable(model, unit.calls[n].payload):
                    n += 1
            if model is not None and n:
                members = groups.setdefault(batch_key(model), [])
                members.extend((call, model) for call in unit.calls[:n])
            rests.append(unit.calls[n:])
        for members in groups.values():
            self._count_pass(members[0][1], len(members), sum(c.cost for c, _ in members))
            if len(members) == 1:
                self.execute(members[0][0])
                continue
            for call, _ in members:
                self.call_stats.started(call.model_id, call.seq_id)
            t0 = time.perf_counter()
            batch = [BatchCall(model, call.payload) for call, model in members]
            tokens = sum(call.cost for call, _ in members)
            with self._threads_for("batch", tokens, members[0][1]):
                # on a group: every rank its share of every call (``Peers.run_batch``)
                self.peers.run_batch(
                    batch, lambda op: _check_size(op.data, self.config.max_tokens_per_call)
                )
            spent = time.perf_counter() - t0
            total = tokens or len(members)
            for (call, _), item in zip(members, batch, strict=True):
                share = spent * (call.cost or 1) / total  # the pass's time, by tokens
                self.resolve(call, _with_compute(item.outcome, share), record=True)
        for calls in rests:
            for call in calls:
                model = self.registry.models.get(call.model_id)
                if model is not None and isinstance(call.payload, _FORWARD_OPS):
                    self._count_pass(model, 1, call.cost)
                self.execute(call)

    def _count_pass(self, model: TrainingModel, calls: int, tokens: int) -> None:
        self.passes.record(model.spec.base_model, model.spec.dtype, calls, tokens)

    def resolve(self, call: QueuedCall, outcome: Any, *, record: bool) -> None:
        """Settle a call's future (and its repeats'); ``record``: it ran, so the
        scheduler records its outcome for later repeats and the status moves on."""
        if not record:  # answered without running
            self.call_stats.dropped(call.model_id, call.seq_id)
        if record:
            self.scheduler.complete(call, outcome)
            if call.model_id in self.registry.models:
                self.registry.publish_status(
                    call.model_id, self.scheduler.next_seq_id(call.model_id)
                )
                self.registry.note_applied(call.model_id, call.seq_id)
        error = str(outcome) if isinstance(outcome, BaseException) else ""
        self._applied.append(Applied(call.model_id, call.seq_id, call.kind, record, error))
        for handle in (call.handle, *call.followers):
            settle(handle, outcome)

    def apply(self, model: TrainingModel, seq_id: int, op: OrderedOp) -> OpResult:
        handler = op_handlers.OP_HANDLERS.get(type(op))
        if handler is None:
            raise InternalError(f"unknown op {type(op).__name__}")
        return handler(self, model, seq_id, op)

    def check_size(self, data: Any) -> None:
        _check_size(data, self.config.max_tokens_per_call)

    def publish(self, model: TrainingModel, *, inflight: bool) -> None:
        """Publish the model's weights as its current version (copied the way the
        backend reads them, one tensor at a time: e.g. into shared memory for a
        sampler process, or a file for vLLM; on a group, as rank 0 gathers them
        from the shards), and tell the backend; with ``inflight`` (PipelineRL) its
        latest requests continue under them."""
        published = self.peers.published(model, self.sampler.keep_weights)
        released = self.versions.publish(published)
        if inflight or isinstance(published, WeightSnapshot):  # else: read when asked
            snapshot = self.versions.get(model.spec.model_id, model.version)
            self.sampler.publish(model.base, snapshot, inflight=inflight)
        if released:
            self.sampler.release(model.spec.model_id, released)

    def auto_checkpoint(
        self, model: TrainingModel, seq_id: int, result: OptimStepResult
    ) -> OptimStepResult:
        """The auto-checkpoint policy: commit the state after every N-th step, so a
        restart brings the model back no further than N steps behind."""
        every, root = self.config.auto_checkpoint_steps, self.config.auto_checkpoint_root
        if not every or root is None or model.version % every:
            return result
        directory = Path(root) / model.spec.tenant_id / model.spec.model_id / "auto"
        directory.parent.mkdir(parents=True, exist_ok=True)
        saved = self.peers.save_state(model, directory, seq_id)
        model.last_checkpoint_seq_id = seq_id
        self.call_stats.checkpoint(saved.size_bytes)
        auto = AutoCheckpoint(str(directory), seq_id, saved.step, saved.size_bytes)
        return replace(result, auto_checkpoint=auto)


_FORWARD_OPS = (ForwardBackwardOp, ForwardLogprobsOp)


def _with_compute(outcome: Any, seconds: float) -> Any:
    """A result with the engine time it took (usage accounting); errors as they are."""
    if isinstance(outcome, BaseException) or not hasattr(outcome, "compute_s"):
        return outcome
    return replace(outcome, compute_s=seconds)


def _check_size(data: Any, limit: int) -> None:
    total = sum(int(d.tokens.size) for d in data)
    if total > limit:
        raise InvalidArgumentError(f"data: {total} tokens exceed the per-call limit of {limit}")
