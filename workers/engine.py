"""The worker engine: owns the base models, every training model, the
scheduler and one sampler backend (``workers.sampler_backend``; which one:
``EngineConfig.sampler``, ``workers.sampler_backends``), and runs training on
one thread. The backend samples where its host runs it; the engine hands it
requests, weight versions and in-flight updates, and never asks which it is.

Callers (the in-process dispatcher, or a Celery task) hand work over through
thread-safe methods that return ``concurrent.futures.Future`` at once; nothing
ever blocks waiting for ``seq_id`` order outside this thread. The loop is
vLLM's: ``schedule()`` -> execute -> ``complete()``, then the tasks a backend
asked to run between rounds (``run_between_calls``: the inline torch sampler's
step).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
import traceback
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

import torch

from treadle.common.futures import settle
from treadle.errors import (
    AbortedError,
    FailedPreconditionError,
    InternalError,
    InvalidArgumentError,
    NotFoundError,
    TreadleError,
    UnavailableError,
)
from treadle.workers import checkpoint, device, export, reference, trainer
from treadle.workers.base_models import BaseModel, BaseModelRegistry, parse_dtype
from treadle.workers.batching import BatchCall, batch_key, batchable, run_batch
from treadle.workers.call_stats import CallStats
from treadle.workers.domain import (
    AutoCheckpoint,
    ForwardBackwardOp,
    ForwardLogprobsOp,
    LoadStateOp,
    ModelSpec,
    ModelStatus,
    OpResult,
    OptimStepOp,
    OptimStepResult,
    OrderedOp,
    RejectedOp,
    SampleOp,
    SampleResult,
    SamplerTarget,
    SamplingConfig,
    SaveResult,
    SaveStateOp,
    SequenceResult,
    SyncResult,
    SyncWeightsOp,
)
from treadle.workers.pass_stats import PassCounter, PassStats
from treadle.workers.sampler_backend import (
    Requester,
    ResumeRequest,
    SamplerBackend,
    SampleRequest,
)
from treadle.workers.sampler_backends import BackendSettings, make_backend
from treadle.workers.sampler_state import SamplerLimits, SamplerStats
from treadle.workers.scheduler import Admission, OrderedCall, Scheduler, WorkUnit
from treadle.workers.thread_choice import ThreadChoice
from treadle.workers.trainer import TrainingModel
from treadle.workers.versions import VersionStore, WeightSnapshot

log = logging.getLogger("treadle.engine")
T = TypeVar("T")


@dataclass(frozen=True)
class EngineConfig:
    base_models: Mapping[str, str | Path]
    #: where every tensor of the engine lives: "cpu", "cuda", "cuda:N" or "auto"
    #: (``workers.device``)
    device: str = "cpu"
    default_dtype: str = "float32"
    threads: int = 0  # 0: leave torch's default
    #: the sampler backend (``workers.sampler_backends``): "torch" (on the engine
    #: thread, between ordered calls), "torch-thread" (a thread of its own, so
    #: sampling overlaps training), "torch-process" (a process of its own: no
    #: interpreter lock shared with training), "vllm"
    sampler: str = "torch"
    sampler_threads: int = 0  # torch threads of the sampler's thread or process; 0: ``threads``
    #: backend-specific settings (``BackendSettings.options``)
    sampler_options: Mapping[str, Any] = field(default_factory=dict)
    gap_timeout_s: float = 60.0
    keep_versions: int = 4
    sampler_slots: int = 64
    sampler_max_len: int = 1024
    sampler_prefill_slots: int = 8  # prompts prefilled at once, kept for prefix reuse
    sampler_max_prefill_tokens: int = 512  # prompt tokens computed per step, at most
    sampler_max_queued: int = 4096  # queued sample requests before RESOURCE_EXHAUSTED
    metrics_log_every_s: float = 30.0
    #: run the forward calls of LoRA models on one base as one batched pass
    batch_across_models: bool = True
    #: the most tokens a tenant spends in one scheduling round, what it borrows
    #: ahead of its share included (0: one call of each of its ready models, the
    #: most batching; 1: one call, no borrowing): ``Scheduler.max_quantum_tokens``
    max_quantum_tokens: int = 0
    max_tokens_per_call: int = 262_144
    #: training models recompute each layer in the backward instead of keeping its
    #: activations (``forward_hidden(checkpoint_layers=True)``)
    activation_checkpointing: bool = False
    #: a ForwardBackward whose activations and new gradients would exceed this is
    #: RESOURCE_EXHAUSTED before it starts (``workers.train_memory``); 0 = the
    #: device's available memory at the call
    train_memory_limit_bytes: int = 0
    #: torch threads of a forward_backward / forward_logprobs (or a batched pass):
    #: "measure" (one or all, whichever this machine runs faster for calls of that
    #: kind and size; ``workers.thread_choice``), "all" or "one"
    training_threads: str = "measure"
    #: save the state every N optimizer steps (0 = off) under auto_checkpoint_root/<tenant>/<model>/auto
    auto_checkpoint_steps: int = 0
    auto_checkpoint_root: str | Path | None = None


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        #: where every tensor lives (``workers.device``)
        self.device = device.resolve(config.device)
        device.check_dtype(self.device, config.default_dtype)
        self.bases = BaseModelRegistry(config.base_models, self.device)
        self.scheduler = Scheduler(
            gap_timeout_s=config.gap_timeout_s, max_quantum_tokens=config.max_quantum_tokens
        )
        self.versions = VersionStore(config.keep_versions)
        self.threads = ThreadChoice(config.training_threads)
        self.passes = PassCounter()
        self.call_stats = CallStats()
        self.models: dict[str, TrainingModel] = {}
        self._inbox: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="treadle-engine", daemon=True)
        self._status: dict[str, ModelStatus] = {}
        self._status_lock = threading.Lock()
        #: model -> the last seq_id applied before it started holding gradients
        #: (absent: it holds none), where a forced unload checkpoints it
        self._clean_seq: dict[str, int] = {}
        self._sample_calls: OrderedDict[tuple[str, int], tuple[str, Future[SampleResult]]] = (
            OrderedDict()
        )
        self._sample_lock = threading.Lock()
        #: (has_work, run_once) tasks of backends that share this thread
        self._between_calls: list[tuple[Callable[[], bool], Callable[[], None]]] = []
        settings = BackendSettings(
            self._sampler_limits(),
            torch_threads=config.sampler_threads or config.threads,
            options=config.sampler_options,
        )
        self.sampler: SamplerBackend = make_backend(config.sampler, settings)

    # ---- lifecycle ---------------------------------------------------------------------

    def start(self) -> Engine:
        self.sampler.start(self)
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping.set()
        self._inbox.put(lambda: None)
        if self._thread.is_alive():
            self._thread.join(timeout)
        self.sampler.close(UnavailableError("the engine is shutting down"), timeout)

    def run_between_calls(self, has_work: Callable[[], bool], run_once: Callable[[], None]) -> None:
        """``EngineThread``: run ``run_once`` on this engine's thread between two
        rounds of ordered calls, whenever ``has_work()`` (call before ``start``)."""
        self._between_calls.append((has_work, run_once))

    # ---- thread-safe API ---------------------------------------------------------------

    def create_model(
        self, spec: ModelSpec, *, from_state: str | Path | None = None, next_seq_id: int = 1
    ) -> Future[ModelStatus]:
        return self._on_engine(lambda: self._create_model(spec, from_state, next_seq_id))

    def delete_model(self, model_id: str) -> Future[None]:
        return self._on_engine(lambda: self._delete_model(model_id))

    def unload_model(
        self, model_id: str, directory: str | Path, *, force: bool = False
    ) -> Future[SaveResult]:
        """Checkpoint a model at its last applied seq_id into ``directory``, then free it.

        Only an idle model unloads: one with a call waiting or running, or with
        gradients accumulated for a step not yet taken (a checkpoint holds no
        gradients), answers FAILED_PRECONDITION and stays as it is.

        ``force`` (a server that stops and cannot wait any longer) checkpoints what
        is applied whatever the model holds: its waiting calls fail UNAVAILABLE, and
        a model holding gradients is saved at the seq_id before the first call that
        accumulated them (weights and optimizer state have not changed since), so
        those calls are redone after the restart, never half-counted.
        """
        return self._on_engine(lambda: self._unload_model(model_id, Path(directory), force))

    def export_weights(
        self, model_id: str, directory: str | Path, *, merged: bool
    ) -> Future[list[str]]:
        """Write the model's current weights to ``directory`` (see ``workers.export``);
        the names of the files written."""
        return self._on_engine(lambda: self._export_weights(model_id, Path(directory), merged))

    def submit(self, model_id: str, seq_id: int, op: OrderedOp, digest: str) -> Future[OpResult]:
        """Queue an ordered call; the future resolves once it is applied (in order)."""
        fut: Future[OpResult] = Future()
        call = OrderedCall(
            model_id, seq_id, op.kind, digest, time.monotonic(), fut, op, cost=token_cost(op)
        )
        self._inbox.put(lambda: self._admit(call))
        return fut

    def sample(
        self,
        target: SamplerTarget,
        op: SampleOp,
        *,
        dedupe_key: tuple[str, int, str] | None = None,
        on_sequence: Callable[[int, SequenceResult, float], None] | None = None,
    ) -> Future[SampleResult]:
        """Queue a sample request. Cancelling the future frees its rows at the next step.

        ``dedupe_key`` = (sampler_id, seq_id, payload digest): a repeat of a seen
        (sampler_id, seq_id) shares the first call's result; with another payload
        it fails with FAILED_PRECONDITION. ``on_sequence`` (streamed rollouts) is
        called on the engine thread with (sample index, sequence, engine seconds
        since its previous call) as each sample finishes; it must not block.
        ``dedupe_key`` is ignored with it (a stream is never shared).
        """
        fut: Future[SampleResult] = Future()
        if dedupe_key is not None and on_sequence is None:
            sampler_id, seq_id, digest = dedupe_key
            with self._sample_lock:
                prior = self._sample_calls.get((sampler_id, seq_id))
                if prior is not None and not prior[1].cancelled():
                    if prior[0] != digest:
                        fut.set_exception(
                            FailedPreconditionError(
                                f"seq_id {seq_id} was already used with a different payload"
                            )
                        )
                        return fut
                    return prior[1]
                self._sample_calls[(sampler_id, seq_id)] = (digest, fut)
                while len(self._sample_calls) > 4096:
                    self._sample_calls.popitem(last=False)
        self._inbox.put(lambda: self._admit_sample(target, op, fut, on_sequence))
        return fut

    def resume(
        self, target: SamplerTarget, handles: Sequence[str], params: SamplingConfig
    ) -> Future[SampleResult]:
        """Continue partial rollouts (their resume handles, consumed) under the
        weights ``target`` reads now: each is re-prefilled from its prompt and
        tokens so far, then sampled on with ``params`` (``max_tokens`` counts the
        whole sequence). The sequences come back whole: earlier parts first, with
        their own logprobs and versions. A handle unknown, consumed, or of
        another tenant or model: NOT_FOUND, the same for each."""
        fut: Future[SampleResult] = Future()
        self._inbox.put(lambda: self._admit_resume(target, tuple(handles), params, fut))
        return fut

    def sampler_metrics(self) -> list[SamplerStats]:
        """The latest stats of every sampler (thread-safe; as fresh as the backend
        can tell without waiting on a step)."""
        stats = self.sampler.stats()
        now = time.monotonic()
        # A sampler that has not decoded for a while generates nothing now.
        return [s if now - s.last_step_at < 5.0 else replace(s, tokens_per_s=0.0) for s in stats]

    def pass_metrics(self) -> list[PassStats]:
        """How the training passes were shared so far, per base model (thread-safe)."""
        return self.passes.snapshot()

    def model_count(self) -> int:
        """Training models on this engine now (thread-safe)."""
        with self._status_lock:
            return len(self._status)

    def check_sampler_target(self, target: SamplerTarget) -> Future[int]:
        """Resolve a sampler target now (NOT_FOUND if its weights are gone); the version."""
        return self._on_engine(lambda: self._snapshot(target).version)

    def model_status(self, model_id: str) -> ModelStatus:
        with self._status_lock:
            status = self._status.get(model_id)
        if status is None:
            raise NotFoundError(f"model {model_id} not found")
        return status

    def has_model(self, model_id: str) -> bool:
        with self._status_lock:
            return model_id in self._status

    # ---- engine thread -------------------------------------------------------------------

    def _on_engine(self, fn: Callable[[], T]) -> Future[T]:
        fut: Future[T] = Future()

        def run() -> None:
            if fut.cancelled():
                return
            try:
                fut.set_result(fn())
            except TreadleError as err:
                fut.set_exception(err)
            except torch.OutOfMemoryError as err:  # e.g. a full fine-tune's copy of the base
                fut.set_exception(device.out_of_memory("the call", err, self.device))
            except Exception as err:  # a bug, not a user error: keep the engine alive
                log.error("engine: %s\n%s", err, traceback.format_exc())
                fut.set_exception(InternalError(f"{type(err).__name__}: {err}"))

        self._inbox.put(run)
        return fut

    def _run(self) -> None:
        if self.config.threads > 0:
            torch.set_num_threads(self.config.threads)
        while not self._stopping.is_set():
            self._drain_inbox()
            now = time.monotonic()
            out = self.scheduler.schedule(now)
            for call in out.timed_out:
                self._resolve(
                    call,
                    AbortedError(
                        f"seq_id {call.seq_id} of model {call.model_id} waited {self.config.gap_timeout_s:.0f}s "
                        f"for seq_id {self.scheduler.next_seq_id(call.model_id)}, which never arrived; "
                        "if the calls before it were lost (a failed call, a server restart), call "
                        "TrainingClient.resync() to continue from the model's next expected seq_id"
                    ),
                    record=False,
                )
            self._execute_units(out.units)
            for has_work, run_once in self._between_calls:
                if has_work():
                    try:
                        run_once()
                    except Exception:  # a backend handles its own failures; this is a bug
                        log.exception("engine: a sampler task failed")
        self._shutdown()

    def _drain_inbox(self) -> None:
        # the scheduler may hold the next round back for a moment, waiting for a
        # tenant's next call (``Scheduler.held_until``): wait for calls meanwhile
        held = self.scheduler.held_until()
        idle = (held is not None or not self.scheduler.has_ready_work()) and not any(
            has_work() for has_work, _ in self._between_calls
        )
        timeout = None
        if idle:
            deadline = self.scheduler.next_deadline()
            if held is not None:
                deadline = held if deadline is None else min(deadline, held)
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            item = self._inbox.get(timeout=timeout) if idle else self._inbox.get_nowait()
        except queue.Empty:
            return
        item()
        while True:
            try:
                self._inbox.get_nowait()()
            except queue.Empty:
                return

    def _shutdown(self) -> None:
        err = UnavailableError("the engine is shutting down")
        for call in list(self.scheduler.waiting_calls()):
            self._resolve(call, err, record=False)
        self.sampler.fail_all(err)

    # ---- models ---------------------------------------------------------------------------

    def _create_model(
        self, spec: ModelSpec, from_state: str | Path | None, next_seq_id: int
    ) -> ModelStatus:
        if spec.model_id in self.models:
            raise FailedPreconditionError(f"model {spec.model_id} already exists on this worker")
        base = self.bases.get(spec.base_model, parse_dtype(spec.dtype))
        model = TrainingModel(
            spec,
            base,
            max_context=self.sampler.max_context(base.cfg),
            checkpoint_activations=self.config.activation_checkpointing,
            memory_limit_bytes=self.config.train_memory_limit_bytes,
        )
        if from_state is not None:
            checkpoint.load_state(model, from_state)
            model.last_checkpoint_seq_id = next_seq_id - 1
        self.models[spec.model_id] = model
        self.scheduler.add_model(spec.model_id, spec.tenant_id, next_seq_id)
        self._publish(model, inflight=False)
        return self._update_status(spec.model_id)

    def _delete_model(self, model_id: str) -> None:
        if self.models.pop(model_id, None) is None:
            raise NotFoundError(f"model {model_id} not found")
        self._clean_seq.pop(model_id, None)
        for call in self.scheduler.remove_model(model_id):
            self._resolve(call, NotFoundError(f"model {model_id} was deleted"), record=False)
        kept = self.versions.versions(model_id)
        self.versions.drop(model_id)
        if kept:
            self.sampler.release(model_id, kept)
        with self._status_lock:
            self._status.pop(model_id, None)

    def _unload_model(self, model_id: str, directory: Path, force: bool = False) -> SaveResult:
        model = self.models.get(model_id)
        if model is None:
            raise NotFoundError(f"model {model_id} not found")
        # Runs between engine steps, so no call is running: only waiting ones count.
        waiting = [c for c in self.scheduler.waiting_calls() if c.model_id == model_id]
        if waiting and not force:
            raise FailedPreconditionError(f"model {model_id} has calls in flight")
        if _holds_gradients(model) and not force:
            raise FailedPreconditionError(
                f"model {model_id} holds gradients for an optimizer step not yet taken"
            )
        stopping = UnavailableError("the server is stopping; the call was not applied")
        for call in waiting:
            self._resolve(call, stopping, record=False)
        seq_id = self._clean_seq.get(model_id, self.scheduler.next_seq_id(model_id) - 1)
        directory.parent.mkdir(parents=True, exist_ok=True)
        saved = checkpoint.save_state(model, directory, seq_id)
        self.call_stats.checkpoint(saved.size_bytes)
        self._delete_model(model_id)
        return saved

    def _export_weights(self, model_id: str, directory: Path, merged: bool) -> list[str]:
        model = self.models.get(model_id)
        if model is None:
            raise NotFoundError(f"model {model_id} not found")
        files = (
            export.export_merged(model, directory)
            if merged
            else export.export_peft(model, directory)
        )
        return [f.name for f in files]

    def _update_status(self, model_id: str) -> ModelStatus:
        model = self.models[model_id]
        status = ModelStatus(
            model_id=model_id,
            version=model.version,
            next_seq_id=self.scheduler.next_seq_id(model_id),
            last_checkpoint_seq_id=model.last_checkpoint_seq_id,
        )
        with self._status_lock:
            self._status[model_id] = status
        return status

    # ---- ordered calls -----------------------------------------------------------------------

    def _admit(self, call: OrderedCall) -> None:
        outcome = self.scheduler.submit(call)
        fut: Future[Any] = call.handle
        if outcome.admission is Admission.QUEUED:
            model = self.models.get(call.model_id)
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

    @contextlib.contextmanager
    def _threads_for(self, kind: str, tokens: int, model: TrainingModel) -> Iterator[None]:
        """Run a training pass on the thread count ``self.threads`` picks for its kind
        and size, and report its time (only when it ends without raising). On a GPU
        the torch threads do not run the pass: no choice to make."""
        if not device.is_cpu_only(self.device):
            yield
            return
        available = torch.get_num_threads()
        work = float(tokens * model.cfg.num_params())
        threads = self.threads.threads(kind, work, available)
        if threads != available:
            torch.set_num_threads(threads)
        t0 = time.perf_counter()
        try:
            yield
            self.threads.record(kind, work, available, threads, time.perf_counter() - t0)
        finally:
            if threads != available:
                torch.set_num_threads(available)

    def _execute(self, call: OrderedCall) -> None:
        model = self.models[call.model_id]
        self.call_stats.started(call.model_id, call.seq_id)
        t0 = time.perf_counter()
        outcome: Any
        try:
            with self._threads_for(call.kind, call.cost, model):
                outcome = self._apply(model, call.seq_id, call.payload)
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
        self._resolve(call, _with_compute(outcome, spent), record=True)

    def _execute_units(self, units: Sequence[WorkUnit]) -> None:
        """Run one round of work units, each model's calls in seq_id order.

        The leading ``ForwardBackward``/``ForwardLogprobs`` calls of every LoRA
        model on the same base (everything before its next barrier) run as one
        batched pass (``workers.batching``); the rest of each unit one by one.
        """
        groups: dict[tuple[int, torch.dtype], list[tuple[OrderedCall, TrainingModel]]] = {}
        rests: list[tuple[OrderedCall, ...]] = []
        for unit in units:
            model = self.models.get(unit.model_id)
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
                self._execute(members[0][0])
                continue
            for call, _ in members:
                self.call_stats.started(call.model_id, call.seq_id)
            t0 = time.perf_counter()
            batch = [BatchCall(model, call.payload) for call, model in members]
            tokens = sum(call.cost for call, _ in members)
            with self._threads_for("batch", tokens, members[0][1]):
                run_batch(batch, lambda op: _check_size(op.data, self.config.max_tokens_per_call))
            spent = time.perf_counter() - t0
            total = tokens or len(members)
            for (call, _), item in zip(members, batch, strict=True):
                share = spent * (call.cost or 1) / total  # the pass's time, by tokens
                self._resolve(call, _with_compute(item.outcome, share), record=True)
        for calls in rests:
            for call in calls:
                model = self.models.get(call.model_id)
                if model is not None and isinstance(call.payload, _FORWARD_OPS):
                    self._count_pass(model, 1, call.cost)
                self._execute(call)

    def _count_pass(self, model: TrainingModel, calls: int, tokens: int) -> None:
        self.passes.record(model.spec.base_model, model.spec.dtype, calls, tokens)

    def _resolve(self, call: OrderedCall, outcome: Any, *, record: bool) -> None:
        if not record:  # answered without running
            self.call_stats.dropped(call.model_id, call.seq_id)
        if record:
            self.scheduler.complete(call, outcome)
            model = self.models.get(call.model_id)
            if model is not None:
                self._update_status(call.model_id)
                if _holds_gradients(model):  # the state is still that of the last clean call
                    self._clean_seq.setdefault(call.model_id, call.seq_id - 1)
                else:
                    self._clean_seq.pop(call.model_id, None)
        for handle in (call.handle, *call.followers):
            settle(handle, outcome)

    def _apply(self, model: TrainingModel, seq_id: int, op: OrderedOp) -> OpResult:
        if isinstance(op, RejectedOp):
            raise op.error
        if isinstance(op, ForwardBackwardOp):
            _check_size(op.data, self.config.max_tokens_per_call)
            return trainer.forward_backward(model, op)
        if isinstance(op, ForwardLogprobsOp):
            _check_size(op.data, self.config.max_tokens_per_call)
            if op.reference_weights is None:
                return trainer.forward_logprobs(model, op)
            batch = trainer.prepare_forward_logprobs(model, op)  # bad data fails before any read
            weights = reference.resolve(model, op.reference_weights, self.versions)
            return trainer.logprobs_of_batch(model, op, batch, weights)
        if isinstance(op, OptimStepOp):
            return self._auto_checkpoint(model, seq_id, model.optim_step(op.adam))
        if isinstance(op, SyncWeightsOp):
            self._publish(model, inflight=op.inflight)
            return SyncResult(version=model.version)
        if isinstance(op, SaveStateOp):
            result = checkpoint.save_state(model, op.directory, seq_id)
            model.last_checkpoint_seq_id = seq_id
            self.call_stats.checkpoint(result.size_bytes)
            return result
        if isinstance(op, LoadStateOp):
            return checkpoint.load_state(model, op.directory)
        raise InternalError(f"unknown op {type(op).__name__}")

    def _publish(self, model: TrainingModel, *, inflight: bool) -> None:
        """Publish the model's weights as its current version (copied the way the
        backend reads them: e.g. into shared memory for a sampler process, one
        copy, not a clone and then a shared one), and tell the backend; with
        ``inflight`` (PipelineRL) its latest requests continue under them."""
        snapshot = model.snapshot(self.sampler.copy_weights())
        released = self.versions.publish(snapshot)
        self.sampler.publish(model.base, snapshot, inflight=inflight)
        if released:
            self.sampler.release(model.spec.model_id, released)

    def _auto_checkpoint(
        self, model: TrainingModel, seq_id: int, result: OptimStepResult
    ) -> OptimStepResult:
        """The auto-checkpoint policy: commit the state after every N-th step, so a
        restart brings the model back no further than N steps behind."""
        every, root = self.config.auto_checkpoint_steps, self.config.auto_checkpoint_root
        if not every or root is None or model.version % every:
            return result
        directory = Path(root) / model.spec.tenant_id / model.spec.model_id / "auto"
        directory.parent.mkdir(parents=True, exist_ok=True)
        saved = checkpoint.save_state(model, directory, seq_id)
        model.last_checkpoint_seq_id = seq_id
        self.call_stats.checkpoint(saved.size_bytes)
        auto = AutoCheckpoint(str(directory), seq_id, saved.step, saved.size_bytes)
        return replace(result, auto_checkpoint=auto)

    # ---- sampling ------------------------------------------------------------------------------

    def _snapshot(self, target: SamplerTarget) -> WeightSnapshot:
        if target.model_id is None:
            dtype = parse_dtype(self.config.default_dtype)
            base = self.bases.get(target.base_model, dtype)
            return WeightSnapshot(None, 0, base.params, None)
        if target.model_id not in self.models:
            raise NotFoundError(f"model {target.model_id} not found")
        return self.versions.get(target.model_id, target.version)

    def _weights_for(
        self, target: SamplerTarget, fut: Future[Any]
    ) -> tuple[BaseModel, WeightSnapshot] | None:
        """The base and weights a request admitted now samples with; None (its
        future failed or already cancelled) when there is nothing to admit."""
        if fut.cancelled():
            return None
        try:
            snapshot = self._snapshot(target)
            return self.bases.get(target.base_model, snapshot.params.dtype), snapshot
        except TreadleError as err:
            fut.set_exception(err)
            return None

    def _sampler_limits(self) -> SamplerLimits:
        c = self.config
        return SamplerLimits(
            num_slots=c.sampler_slots,
            max_len=c.sampler_max_len,
            prefill_slots=c.sampler_prefill_slots,
            max_prefill_tokens=c.sampler_max_prefill_tokens,
            max_queued=c.sampler_max_queued,
            log_every_s=c.metrics_log_every_s,
        )

    def _admit_sample(
        self,
        target: SamplerTarget,
        op: SampleOp,
        fut: Future[SampleResult],
        on_sequence: Callable[[int, SequenceResult, float], None] | None = None,
    ) -> None:
        resolved = self._weights_for(target, fut)
        if resolved is None:
            return
        base, snapshot = resolved
        request = SampleRequest(base, op, snapshot, Requester.of(target), on_sequence)
        self.sampler.submit(request, fut)

    def _admit_resume(
        self,
        target: SamplerTarget,
        handles: tuple[str, ...],
        params: SamplingConfig,
        fut: Future[SampleResult],
    ) -> None:
        resolved = self._weights_for(target, fut)
        if resolved is None:
            return
        base, snapshot = resolved
        self.sampler.resume(
            ResumeRequest(base, handles, params, snapshot, Requester.of(target)), fut
        )


_FORWARD_OPS = (ForwardBackwardOp, ForwardLogprobsOp)


def _holds_gradients(model: TrainingModel) -> bool:
    return any(p.grad is not None for p in model.trainable.values())


def _with_compute(outcome: Any, seconds: float) -> Any:
    """A result with the engine time it took (usage accounting); errors as they are."""
    if isinstance(outcome, BaseException) or not hasattr(outcome, "compute_s"):
        return outcome
    return replace(outcome, compute_s=seconds)


def token_cost(op: OrderedOp) -> int:
    """The fair-share cost of an ordered call: the tokens in its batch (barriers 0)."""
    data = getattr(op, "data", None)
    return sum(int(d.tokens.size) for d in data) if data else 0


def _check_size(data: Any, limit: int) -> None:
    total = sum(int(d.tokens.size) for d in data)
    if total > limit:
        raise InvalidArgumentError(f"data: {total} tokens exceed the per-call limit of {limit}")
