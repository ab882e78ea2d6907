"""The worker engine: owns the base models, every training model, the
scheduler and one sampler backend (``workers.sampler.backend``; which one:
``EngineConfig.sampler``, ``workers.sampler.backends``), and runs training on
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

import logging
import queue
import threading
import time
import traceback
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

import torch

from treadle.common.engine.api import OnSequence
from treadle.common.engine.domain import (
    ModelSpec,
    ModelStatus,
    OpResult,
    OrderedOp,
    SampleOp,
    SampleResult,
    SamplerTarget,
    SamplingConfig,
    SaveResult,
    SequenceResult,
    TenantQueue,
    token_cost,
)
from treadle.common.engine.messages import EngineCall, SampleStreamCall, StreamEnd
from treadle.common.engine.report import EngineReport
from treadle.common.engine.stats import PassStats, SamplerStats
from treadle.errors import (
    AbortedError,
    FailedPreconditionError,
    InternalError,
    NotFoundError,
    TreadleError,
    UnavailableError,
)
from treadle.workers.device import device, host_allocator, memory_budget, memory_reading
from treadle.workers.engine import calls, shipping
from treadle.workers.engine.base_models import BaseModel, BaseModelRegistry, parse_dtype
from treadle.workers.engine.config import EngineConfig
from treadle.workers.engine.models import ModelRegistry, holds_gradients
from treadle.workers.engine.ordered import OrderedExecutor, StepReport
from treadle.workers.engine.peers import Alone, Peers
from treadle.workers.engine.scheduler import QueuedCall, Scheduler
from treadle.workers.engine.versions import VersionStore, WeightSnapshot
from treadle.workers.sampler.backend import (
    ResumeJob,
    SampleJob,
    SamplerBackend,
)
from treadle.workers.sampler.backends import BackendSettings, make_backend
from treadle.workers.trainer import checkpoint, export
from treadle.workers.trainer.trainer import TrainingModel

__all__ = ["Engine", "EngineConfig", "StepReport"]

log = logging.getLogger("treadle.engine")
T = TypeVar("T")
R = TypeVar("R")


class Engine:
    def __init__(self, config: EngineConfig, peers: Peers | None = None) -> None:
        self.config = config
        #: the other ranks of this worker's group (``workers.group``); none: ``Alone``
        self.peers: Peers = peers if peers is not None else Alone()
        #: where every tensor lives (``workers.device.device``)
        self.device = device.resolve(config.device)
        device.check_dtype(self.device, config.default_dtype)
        if self.device.type == "cpu":  # tensors in malloc'd memory: before any thread starts
            host_allocator.configure(config.host_allocator)
        self.bases = BaseModelRegistry(config.base_models, self.device)
        self.scheduler = Scheduler(
            gap_timeout_s=config.gap_timeout_s,
            max_quantum_tokens=config.max_quantum_tokens,
            anticipate_batched=config.batch_across_models,
        )
        self.versions = VersionStore(config.keep_versions)
        #: versions of models trained elsewhere, shipped here for sampling (a sampler
        #: worker of the pool: ``workers.engine.shipping``)
        self.shipped = VersionStore(config.keep_versions)
        self._shipped_from: dict[tuple[str, int], str] = {}  # (model, version) -> its files
        #: model -> the version its ``latest`` samplers read here (the last published,
        #: which a rewound model makes lower than versions shipped before it)
        self._shipped_latest: dict[str, int] = {}
        self.registry = ModelRegistry()
        #: model id -> the model (engine thread only)
        self.models: dict[str, TrainingModel] = self.registry.models
        self._inbox: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="treadle-engine", daemon=True)
        self._sample_calls: OrderedDict[tuple[str, int], tuple[str, Future[SampleResult]]] = (
            OrderedDict()
        )
        self._sample_lock = threading.Lock()
        #: (has_work, run_once) tasks of backends that share this thread
        self._between_calls: list[tuple[Callable[[], bool], Callable[[], None]]] = []
        settings = BackendSettings(
            config.sampler_limits(),
            torch_threads=config.sampler_threads or config.threads,
            options=config.sampler_options,
        )
        self.sampler: SamplerBackend = make_backend(config.sampler, settings)
        self.peers.use_sampler(self.sampler)
        self.executor = OrderedExecutor(
            config,
            self.device,
            self.registry,
            self.scheduler,
            self.versions,
            self.sampler,
            self.peers,
        )
        self.threads = self.executor.threads
        self.passes = self.executor.passes
        #: the scheduler's queue per tenant, replaced by the engine thread each round
        self._queue: tuple[TenantQueue, ...] = ()
        #: (training models, of them LoRA, models served from shipped versions), as
        #: of the engine's latest round (replaced whole by the engine thread)
        self._holds = (0, 0, 0)
        self.call_stats = self.executor.call_stats

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
        self.peers.close()

    def run_between_calls(self, has_work: Callable[[], bool], run_once: Callable[[], None]) -> None:
        """``EngineThread``: run ``run_once`` on this engine's thread between two
        rounds of ordered calls, whenever ``has_work()`` (call before ``start``)."""
        self._between_calls.append((has_work, run_once))

    # ---- thread-safe API ---------------------------------------------------------------

    def call(self, call: EngineCall[R]) -> Future[R]:
        """``EngineAPI``: run a call message through its handler (``engine.calls``)."""
        handler = calls.HANDLERS.get(type(call))
        if handler is None:
            fut: Future[R] = Future()
            fut.set_exception(InternalError(f"no engine handler for {type(call).__name__}"))
            return fut
        return handler(self, call)

    def stream(self, call: SampleStreamCall, on_sequence: OnSequence) -> Future[StreamEnd]:
        """``EngineAPI``: a streamed sample (``on_sequence`` as in ``sample``)."""
        return calls.stream(self, call, on_sequence)

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
        """Write the model's current weights to ``directory`` (see ``workers.trainer.export``);
        the names of the files written."""
        return self._on_engine(lambda: self._export_weights(model_id, Path(directory), merged))

    def submit(self, model_id: str, seq_id: int, op: OrderedOp, digest: str) -> Future[OpResult]:
        """Queue an ordered call; the future resolves once it is applied (in order)."""
        fut: Future[OpResult] = Future()
        call = QueuedCall(
            model_id, seq_id, op.kind, digest, time.monotonic(), fut, op, cost=token_cost(op)
        )
        self._inbox.put(lambda: self.executor.admit(call))
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

    def report(self) -> EngineReport:
        """The device, its memory now, the models held and the scheduler's queue per
        tenant as of the engine's latest round (thread-safe: the operator's view,
        written with each heartbeat of a Celery worker)."""
        models, adapters, served = self._holds
        return EngineReport(
            device=str(self.device),
            memory=memory_reading.read(self.device),
            models=models,
            adapters=adapters,
            served=served,
            queue=self._queue,
        )

    def model_count(self) -> int:
        """Training models on this engine now (thread-safe)."""
        return self.registry.count()

    def ship_version(self, model_id: str, version: int, directory: str | Path) -> Future[int]:
        """Write a published version of a model trained here for the sampler pool;
        the bytes written."""

        def ship() -> int:
            if model_id not in self.models:
                raise NotFoundError(f"model {model_id} not found")
            snapshot = self.versions.get(model_id, version)
            return shipping.write_version(snapshot, Path(directory))

        return self._on_engine(ship)

    def load_version(
        self,
        target: SamplerTarget,
        directory: str | Path,
        *,
        inflight: bool = False,
        latest: bool = False,
    ) -> Future[int]:
        """Serve a version shipped from the model's trainer (``ship_version``) from now
        on: read it, publish it to the sampler (``inflight``: the requests following
        the model's latest weights here continue under it; ``latest``: those requests
        read it from now on); the version (the ack)."""
        model_id, version = target.model_id, target.version
        assert model_id is not None and version is not None

        def base_at(dtype: str) -> BaseModel:
            return self.bases.get(target.base_model, parse_dtype(dtype))

        def load() -> int:
            if self._shipped_from.get((model_id, version)) != str(directory):
                # else served already (a repeat, or a second server's publish)
                snapshot = shipping.read_version(Path(directory), base_at, model_id, version)
                released = self.shipped.publish(snapshot)
                self._shipped_from[(model_id, version)] = str(directory)
                for old in released:
                    self._shipped_from.pop((model_id, old), None)
                self.sampler.publish(
                    self.bases.get(target.base_model, snapshot.dtype),
                    snapshot,
                    inflight=inflight,
                )
                if released:
                    self.sampler.release(model_id, released)
            if latest:
                self._shipped_latest[model_id] = version
            return version

        return self._on_engine(load)

    def check_sampler_target(self, target: SamplerTarget) -> Future[int]:
        """Resolve a sampler target now (NOT_FOUND if its weights are gone); the version."""
        return self._on_engine(lambda: self._snapshot(target).version)

    def model_status(self, model_id: str) -> ModelStatus:
        return self.registry.status(model_id)

    def has_model(self, model_id: str) -> bool:
        return self.registry.has(model_id)

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
            self.step(wait=True)
        self._shutdown()

    def step(
        self, now: float | None = None, *, wait: bool = False, between_calls: bool = True
    ) -> StepReport:
        """One round of the engine loop, on the calling thread (the engine's own
        thread when started; a test's when not): run what the inbox holds, fail the
        calls that waited too long for a predecessor, run the units the scheduler
        hands out at ``now`` (default: the clock), then (``between_calls``) the
        backends' tasks that asked to run between rounds.

        ``wait``: with nothing to do, block on the inbox until work arrives or the
        scheduler's next deadline."""
        inbox = self._drain_inbox(wait)
        out = self.scheduler.schedule(time.monotonic() if now is None else now)
        self._queue = tuple(self.scheduler.queue_by_tenant())  # the operator's view
        for call in out.timed_out:
            self.executor.resolve(call, self._gap_error(call), record=False)
        if out.units:
            self.sampler.training()  # a colocated sampler may free memory first
        self.executor.execute_units(out.units)
        sampled = False
        if between_calls:
            for has_work, run_once in self._between_calls:
                if has_work():
                    sampled = True
                    try:
                        run_once()
                    except Exception:  # a backend handles its own failures; this is a bug
                        log.exception("engine: a sampler task failed")
        self._queue = tuple(self.scheduler.queue_by_tenant())
        self._holds = (
            len(self.models),
            sum(1 for m in self.models.values() if m.spec.is_lora),
            len(self.shipped),
        )
        return StepReport(tuple(self.executor.take_applied()), inbox, sampled)

    def _gap_error(self, call: QueuedCall) -> AbortedError:
        return AbortedError(
            f"seq_id {call.seq_id} of model {call.model_id} waited {self.config.gap_timeout_s:.0f}s "
            f"for seq_id {self.scheduler.next_seq_id(call.model_id)}, which never arrived; "
            "if the calls before it were lost (a failed call, a server restart), call "
            "TrainingClient.resync() to continue from the model's next expected seq_id"
        )

    def _drain_inbox(self, wait: bool) -> int:
        # the scheduler may hold the next round back for a moment, waiting for a
        # tenant's next call (``Scheduler.held_until``): wait for calls meanwhile
        held = self.scheduler.held_until()
        idle = (
            wait
            and (held is not None or not self.scheduler.has_ready_work())
            and not any(has_work() for has_work, _ in self._between_calls)
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
            return 0
        item()
        ran = 1
        while True:
            try:
                self._inbox.get_nowait()()
            except queue.Empty:
                return ran
            ran += 1

    def _shutdown(self) -> None:
        err = UnavailableError("the engine is shutting down")
        for call in list(self.scheduler.waiting_calls()):
            self.executor.resolve(call, err, record=False)
        self.executor.take_applied()
        self.sampler.fail_all(err)

    # ---- models ---------------------------------------------------------------------------

    def _create_model(
        self, spec: ModelSpec, from_state: str | Path | None, next_seq_id: int
    ) -> ModelStatus:
        if spec.model_id in self.models:
            raise FailedPreconditionError(f"model {spec.model_id} already exists on this worker")
        base = self.bases.get(spec.base_model, parse_dtype(spec.dtype))
        base_params = self.peers.base_params(base)  # a group's shards, when not whole here
        memory_budget.check_model(
            spec,
            self.bases,
            self.config.keep_versions,
            self.sampler,
            base_held=base_params is not None,
        )
        model = TrainingModel(
            spec,
            base,
            max_context=self.sampler.max_context(base.cfg),
            checkpoint_activations=self.config.activation_checkpointing,
            memory_limit_bytes=self.config.train_memory_limit_bytes,
            base_params=base_params,
        )
        if from_state is not None:
            checkpoint.load_state(model, from_state)
            model.last_checkpoint_seq_id = next_seq_id - 1
        self.peers.created(model)
        self.models[spec.model_id] = model
        self.scheduler.add_model(spec.model_id, spec.tenant_id, next_seq_id)
        self.executor.publish(model, inflight=False)
        return self.registry.publish_status(
            spec.model_id, self.scheduler.next_seq_id(spec.model_id)
        )

    def _delete_model(self, model_id: str) -> None:
        if model_id not in self.models and self.shipped.versions(model_id):
            self._drop_shipped(model_id)  # a sampler worker: the versions shipped here go
            return
        self.registry.remove(model_id)
        self.peers.deleted(model_id)
        for call in self.scheduler.remove_model(model_id):
            self.executor.resolve(
                call, NotFoundError(f"model {model_id} was deleted"), record=False
            )
        kept = self.versions.versions(model_id)
        self.versions.drop(model_id)
        if kept:
            self.sampler.release(model_id, kept)
        self.registry.forget_status(model_id)

    def _drop_shipped(self, model_id: str) -> None:
        kept = self.shipped.versions(model_id)
        self.shipped.drop(model_id)
        self._shipped_latest.pop(model_id, None)
        for version in kept:
            self._shipped_from.pop((model_id, version), None)
        self.sampler.release(model_id, kept)

    def _unload_model(self, model_id: str, directory: Path, force: bool = False) -> SaveResult:
        model = self.registry.require(model_id)
        # Runs between engine steps, so no call is running: only waiting ones count.
        waiting = [c for c in self.scheduler.waiting_calls() if c.model_id == model_id]
        if waiting and not force:
            raise FailedPreconditionError(f"model {model_id} has calls in flight")
        if holds_gradients(model) and not force:
            raise FailedPreconditionError(
                f"model {model_id} holds gradients for an optimizer step not yet taken"
            )
        stopping = UnavailableError("the server is stopping; the call was not applied")
        for call in waiting:
            self.executor.resolve(call, stopping, record=False)
        seq_id = self.registry.clean_seq(model_id, self.scheduler.next_seq_id(model_id) - 1)
        directory.parent.mkdir(parents=True, exist_ok=True)
        saved = self.peers.save_state(model, directory, seq_id)
        self.call_stats.checkpoint(saved.size_bytes)
        self._delete_model(model_id)
        return saved

    def _export_weights(self, model_id: str, directory: Path, merged: bool) -> list[str]:
        model = self.registry.require(model_id)
        if not merged:
            files = export.export_peft(model, directory)  # the adapter: whole here
        else:
            with self.peers.whole_tensors(model) as tensors:  # one whole tensor at a time
                files = export.export_merged(model, directory, tensors)
        return [f.name for f in files]

    # ---- sampling ------------------------------------------------------------------------------

    def _snapshot(self, target: SamplerTarget) -> WeightSnapshot:
        if target.model_id is None:
            dtype = parse_dtype(self.config.default_dtype)
            # the base's weights, read only if the sampler reads them (vLLM loads its own)
            return WeightSnapshot(None, 0, self.bases.get(target.base_model, dtype), None)
        if target.model_id not in self.models:
            shipped = self.shipped.versions(target.model_id)
            if shipped:  # trained elsewhere, shipped here
                version = target.version
                if version is None:  # the last published; the highest if that one went
                    version = self._shipped_latest.get(target.model_id, -1)
                    version = version if version in shipped else max(shipped)
                return self.shipped.get(target.model_id, version)
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
            return self.bases.get(target.base_model, snapshot.dtype), snapshot
        except TreadleError as err:
            fut.set_exception(err)
            return None

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
        self.sampler.submit(SampleJob(base, op, snapshot, target, on_sequence), fut)

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
        self.sampler.resume(ResumeJob(base, handles, params, snapshot, target), fut)
