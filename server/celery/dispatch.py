"""``CeleryDispatcher``: the ``Dispatcher`` of a server whose engines run in
``treadle worker`` processes, reached through Celery (Redis or RabbitMQ).

Its parts: where each model lives (``server.celery.placement``), the RPC
transport and its replies (``server.celery.transport``), the liveness watchdog
that declares silent workers dead and fails their calls (``server.celery.liveness``).
Each worker's engine applies a model's calls in ``seq_id`` order whatever order
Celery delivers them in, so ordering, barriers and de-duplication stay where
they are in the embedded server.

A model lost with its worker stays at its last applied step (the database has
its version and checkpoints); later calls on it answer ABORTED naming how to
restore it: ``load_state`` of a checkpoint places it again, on a live worker, at
that checkpoint (or ``create_training_client_from_state`` makes a new model from it).

Recovery. Every call a worker applies is also kept in the replay log
(``treadle.server.replay_log``: payloads on the ops rows, since the model's last
checkpoint, bounded per model). The next ordered call of a lost model restores
its last checkpoint on a live worker and replays those calls onto it, in order,
with their own seq_ids: the model continues at its last applied step, with the
same weights and optimizer state. When the log does not hold every call since
the checkpoint (over its bound, or off), the model stays lost as above.

Draining. A worker stopping gracefully turns ``draining``: it gets no new
model and still serves its own, and ``draining_models()`` names them; the
server's lifecycle unloads each at its first idle moment (a checkpoint in the
store), and its next call restores it on a live worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import shutil
import socket
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar, cast

from sqlalchemy.orm import Session, sessionmaker

from treadle.common.db import models as db
from treadle.common.engine.domain import (
    LoadResult,
    LoadStateOp,
    ModelStatus,
    OpResult,
    OrderedOp,
    SampleOp,
    SamplerTarget,
    SaveResult,
    StreamedSequence,
    SyncResult,
    SyncWeightsOp,
)
from treadle.common.engine.messages import (
    CheckTargetCall,
    CreateModelCall,
    DeleteModelCall,
    EngineCall,
    ExportCall,
    Exported,
    ResumeCall,
    SampleCall,
    SampleStreamCall,
    SubmitCall,
    UnloadModelCall,
)
from treadle.common.engine.model_config import ModelConfig
from treadle.common.engine.report import EngineReport
from treadle.common.engine.stats import PassStats, SamplerStats
from treadle.common.store import Store
from treadle.errors import (
    AbortedError,
    FailedPreconditionError,
    NotFoundError,
    TreadleError,
    UnavailableError,
)
from treadle.server.celery.liveness import Liveness
from treadle.server.celery.placement import Placement
from treadle.server.celery.pool import SamplerPool
from treadle.server.celery.transport import CeleryTransport
from treadle.server.dispatch import BaseCatalog, stream_items
from treadle.server.replay_log import APPLIED_ERRORS, Logged, ReplayLog
from treadle.server.rpc import convert

log = logging.getLogger("treadle.server")
R = TypeVar("R")


class CeleryDispatcher:
    engine_in_process = False  # the workers keep the models across a server restart

    def __init__(
        self,
        broker: str,
        sessions: sessionmaker[Session],
        bases: BaseCatalog,
        *,
        worker_timeout_s: float = 10.0,
        check_s: float | None = None,
        store: Store | None = None,
        replay_log_bytes: int = 64 * 1024 * 1024,
        sampler_placement: str = "auto",
        keep_versions: int = 4,
    ) -> None:
        self.broker = broker
        self.replay = ReplayLog(sessions, replay_log_bytes)
        self._records = ThreadPoolExecutor(1, thread_name_prefix="treadle-replay-log")
        self._recovering: dict[str, asyncio.Lock] = {}
        self.store = store
        self.server_id = f"srv-{socket.gethostname()}-{secrets.token_hex(4)}"
        self.sessions = sessions
        self.bases = bases
        self.worker_timeout_s = worker_timeout_s
        self._restored: dict[tuple[str, int], LoadResult] = {}
        self.transport: CeleryTransport
        self.placement = Placement(sessions, worker_timeout_s, lambda w: self.transport.is_gone(w))
        self.transport = CeleryTransport(broker, self.server_id, self.placement.note_status)
        self.app = self.transport.app
        self._call = self.transport.call
        self.pool = SamplerPool(
            self.placement,
            self.transport.call,
            self.transport.pending_counts,
            sessions,
            store,
            sampler_placement,
            keep_versions,
        )
        self.liveness = Liveness(
            sessions,
            self.placement,
            self.transport,
            worker_timeout_s=worker_timeout_s,
            check_s=check_s or max(0.2, min(2.0, worker_timeout_s / 4)),
        )
        self.liveness.start()

    # ---- Dispatcher ----------------------------------------------------------------------

    async def call(self, call: EngineCall[R]) -> R:
        """Calls that change where models live, or that are logged for replay, are
        routed here; every other call goes to the worker of its ``route``."""
        if isinstance(call, CreateModelCall):
            return cast(R, await self._create_model(call))
        if isinstance(call, SubmitCall):
            return cast(R, await self._submit(call))
        if isinstance(call, DeleteModelCall):
            return cast(R, await self._delete_model(call))
        if isinstance(call, UnloadModelCall):
            return cast(R, await self._unload_model(call))
        if isinstance(call, ExportCall):
            return cast(R, await self._export(call))
        if isinstance(call, CheckTargetCall):
            self.check_placement(call.target)
        if isinstance(call, SampleCall):
            routed = await self.pool.route(call.target)
            if routed is not None:  # straight to a sampler worker, never the trainer's queue
                worker_id, pinned = routed
                sampled = await self._call(worker_id, replace(call, target=pinned))
                self.pool.partials.note(worker_id, sampled.sequences)
                return cast(R, sampled)
        if isinstance(call, ResumeCall):
            routed = await self.pool.route_resume(call.target, call.handles)
            if routed is not None:  # to the pool worker that keeps the partial rollouts
                worker_id, target = routed
                resumed = await self._call(worker_id, replace(call, target=target))
                self.pool.partials.consumed(call.handles)
                self.pool.partials.note(worker_id, resumed.sequences)
                return cast(R, resumed)
        route = call.route
        if route.target is not None:
            worker_id = await self._route(route.target, route.sampler_key)
        else:
            assert route.model_id is not None
            worker_id = self.placement.worker_of(route.model_id)
        return cast(R, await self._call(worker_id, call))

    async def _create_model(self, call: CreateModelCall) -> ModelStatus:
        spec = call.spec
        adopt = self.placement.adoptable(spec.model_id)
        candidates = [adopt] if adopt else self.placement.candidates(spec.base_model)

        async def create(worker_id: str) -> ModelStatus:
            return await self._call(worker_id, call)

        worker_id, status = await self.placement.place(spec.base_model, candidates, create)
        self.placement.settle(spec.model_id, worker_id, status)
        return status

    async def _delete_model(self, call: DeleteModelCall) -> Any:
        model_id = call.model_id
        worker_id = self.placement.forget(model_id)
        self.replay.forget(model_id)
        self.pool.forget(model_id)
        if worker_id is None or self.transport.is_gone(worker_id):
            raise NotFoundError(f"model {model_id} not found")
        return await self._call(worker_id, call)

    async def _unload_model(self, call: UnloadModelCall) -> SaveResult:
        """Checkpoint the idle model to the storage path ``directory`` and free it
        (``force`` is not offered: a worker that stops drains its own models)."""
        worker_id = self.placement.worker_of(call.model_id)
        result = await self._call(worker_id, replace(call, force=False))
        self.placement.forget(call.model_id)
        return result

    async def _export(self, call: ExportCall) -> Exported:
        """The worker exports into the store; the files come down into the local
        ``directory`` the call names."""
        model_id, directory = call.model_id, call.directory
        store = self.store
        if store is None:
            raise FailedPreconditionError("export: this server has no checkpoint store")
        worker_id = self.placement.worker_of(model_id)
        with self.sessions() as s:
            row = s.get(db.Model, model_id)
            if row is None:
                raise NotFoundError(f"model {model_id} not found")
            tenant_id = row.tenant_id
        path = store.state_path(tenant_id, model_id, f"export-{uuid.uuid4().hex[:12]}")
        exported = await self._call(worker_id, replace(call, directory=path))
        names = list(exported.names)

        def download() -> None:
            local = store.fetch(path)
            try:
                Path(directory).mkdir(parents=True, exist_ok=True)
                for name in names:
                    shutil.copyfile(local / name, Path(directory) / name)
            finally:
                store.release(local, path)
                store.delete(path)

        await asyncio.get_running_loop().run_in_executor(None, download)
        return exported

    async def _submit(self, call: SubmitCall) -> OpResult:
        model_id, seq_id, op, digest = call.model_id, call.seq_id, call.op, call.digest
        restored = self._restored.get((model_id, seq_id))
        if restored is not None:  # a repeat of the load_state that restored it
            return restored
        try:
            worker_id = self.placement.worker_of(model_id)
        except AbortedError:
            if isinstance(op, LoadStateOp):
                restored_at = await self._restore(model_id, seq_id, op, digest)
                if isinstance(restored_at, LoadResult):
                    self.pool.rewound(model_id, restored_at.step)
                return restored_at
            worker_id = await self._recover(model_id)
        try:
            result = await self._call(worker_id, call)
        except TreadleError as err:
            if err.code in APPLIED_ERRORS:  # refused in its turn: it took its seq_id
                await self._keep(model_id, seq_id, op)
            raise
        await self._keep(model_id, seq_id, op)
        if isinstance(op, SyncWeightsOp) and isinstance(result, SyncResult):
            # UNAVAILABLE if not shipped
            await self.pool.publish(model_id, result.version, inflight=op.inflight)
        if isinstance(op, LoadStateOp) and isinstance(result, LoadResult):
            self.pool.rewound(model_id, result.step)  # its next versions are new weights
        return result

    async def _keep(self, model_id: str, seq_id: int, op: OrderedOp) -> None:
        """Into the replay log, on its own thread, in the order applied, without
        holding up the answer (writing a large batch's payload takes PostgreSQL
        a while). A failure there leaves a hole (the model would come back at its
        checkpoint), never fails the call, which was applied."""

        def record() -> None:
            try:
                self.replay.record(model_id, seq_id, op)
            except Exception as err:
                log.warning("model %s: seq_id %d not kept for replay: %s", model_id, seq_id, err)

        self._records.submit(record)

    async def sample_stream(
        self, target: SamplerTarget, op: SampleOp
    ) -> AsyncIterator[StreamedSequence]:
        """The worker replies once per sample as it finishes (``more`` replies, in
        order on this server's reply queue), then once at the end. Closing the
        iterator early stops listening; the worker finishes the samples anyway
        (there is no cancel message)."""
        routed = await self.pool.route(target)
        if routed is not None:  # a sampler worker of the pool
            worker_id, target = routed
        else:
            worker_id = await self._route(target, None)
        items: asyncio.Queue[StreamedSequence] = asyncio.Queue()

        def on_item(item: StreamedSequence) -> None:
            if routed is not None:  # a partial one is kept there
                self.pool.partials.note(worker_id, (item.sequence,))
            items.put_nowait(item)

        call = asyncio.ensure_future(
            self._call(worker_id, SampleStreamCall(target, op), on_item=on_item)
        )
        try:
            async with contextlib.aclosing(stream_items(items, call, op.num_samples)) as stream:
                async for item in stream:
                    yield item
        finally:
            if not call.done():
                call.cancel()

    def check_placement(self, target: SamplerTarget) -> None:
        """A refusal goes by the workers table read now, not by the last liveness
        pass (up to ``check_s`` old): a sampler worker that has registered (printed
        "ready") is never refused for not being seen yet. Only on the refusal path,
        so an accepted sampler costs no database read."""
        if not target.placement:  # not a new sampler that chose where it samples
            return
        try:
            self.pool.check(target)
        except UnavailableError:
            self.liveness.read_live()
            self.pool.check(target)

    def model_status(self, model_id: str) -> ModelStatus:
        return self.placement.model_status(model_id)

    def base_model_config(self, name: str) -> ModelConfig:
        return self.bases.config(name)

    def base_model_path(self, name: str) -> Path:
        return self.bases.path(name)

    def base_model_names(self) -> list[str]:
        return self.bases.names()

    def sampler_metrics(self) -> list[SamplerStats]:
        """None here: each worker's samplers run in its process and log their own
        throughput (``treadle.sampler``)."""
        return []

    def pass_metrics(self) -> list[PassStats]:
        """None here, as for the samplers: each worker's engine runs in its process."""
        return []

    def engine_report(self) -> EngineReport | None:
        """None here: each worker reports with its heartbeat (``common.db.workers``)."""
        return None

    def draining_models(self) -> set[str]:
        with self.placement.lock:
            return set(self.placement.draining)

    def close(self) -> None:
        self.liveness.stop()
        self._records.shutdown(wait=True, cancel_futures=False)
        self.transport.close()

    # ---- routing ---------------------------------------------------------------------------

    async def _route(self, target: SamplerTarget, sampler_id: str | None) -> str:
        """``Placement.worker_for_target``; a sampler of a lost model brings the model back
        (``_recover``) as its next training call would."""
        try:
            return self.placement.worker_for_target(target, sampler_id)
        except AbortedError:
            if target.model_id is None:
                raise
            await self._recover(target.model_id)
            return self.placement.worker_for_target(target, sampler_id)

    async def _restore(self, model_id: str, seq_id: int, op: LoadStateOp, digest: str) -> OpResult:
        """A lost model's ``load_state``: the model is made on a live worker from the
        checkpoint (weights and Adam moments), in the call's place. With
        ``optimizer=False`` it is made from the checkpoint one seq_id earlier and
        then applies the call itself, so its moments start at zero as anywhere
        else (and a load that fails leaves it as the checkpoint, never as new)."""
        with self.sessions() as s:
            row = s.get(db.Model, model_id)
            if row is None:
                raise NotFoundError(f"model {model_id} not found")
            spec = convert.model_spec(row)

        async def create(worker_id: str) -> ModelStatus:
            # weights only: the call itself then loads the weights again, with fresh moments
            next_seq_id = seq_id if not op.optimizer else seq_id + 1
            return await self._call(worker_id, CreateModelCall(spec, op.directory, next_seq_id))

        worker_id, status = await self.placement.place(
            spec.base_model,
            self.placement.candidates(spec.base_model, exclude=self.placement.dead_for(model_id)),
            create,
        )
        self.placement.settle(model_id, worker_id, status)
        if not op.optimizer:
            loaded = await self._call(worker_id, SubmitCall(model_id, seq_id, op, digest))
            await self._keep(model_id, seq_id, op)
            log.info("model %s restored on worker %s (weights only)", model_id, worker_id)
            return loaded
        log.info("model %s restored on worker %s at step %d", model_id, worker_id, status.version)
        result = LoadResult(step=status.version)
        self._restored[(model_id, seq_id)] = result
        return result

    async def _recover(self, model_id: str) -> str:
        """Bring a lost model back at its last applied step on a live worker: its
        last checkpoint, then the calls applied since (the replay log); the
        worker it is on now. AbortedError (lost, as before) when the log does not
        hold every call since the checkpoint."""
        lock = self._recovering.setdefault(model_id, asyncio.Lock())
        async with lock:
            try:
                return self.placement.worker_of(model_id)  # another call recovered it meanwhile
            except AbortedError as err:
                lost = err
            with self.sessions() as s:
                row = s.get(db.Model, model_id)
                if row is None:
                    raise NotFoundError(f"model {model_id} not found")
                spec = convert.model_spec(row)
                ckpt = row.last_checkpoint
                start = ckpt.seq_id if ckpt is not None else 0
                directory = ckpt.storage_path if ckpt is not None else None
                source = ckpt.uri if ckpt is not None else "its creation state"
                version = row.version
            # every call answered so far is written first (the log's thread, in order)
            await asyncio.wrap_future(self._records.submit(lambda: None))
            calls = self.replay.calls_since(model_id, start)
            if calls is None:
                raise lost

            async def create(worker_id: str) -> ModelStatus:
                return await self._call(worker_id, CreateModelCall(spec, directory, start + 1))

            p = self.placement
            worker_id, status = await p.place(
                spec.base_model,
                p.candidates(spec.base_model, exclude=p.dead_for(model_id)),
                create,
                none_left=lost,
            )
            with p.lock:
                p.replaying.add(model_id)
                p.status[model_id] = status
            try:
                await self._replay(worker_id, model_id, calls, lost, source)
            finally:
                with p.lock:
                    p.replaying.discard(model_id)
                    status = p.status.get(model_id, status)
            if status.version != version:
                log.warning(
                    "model %s replayed to step %d, but the database says %d",
                    model_id,
                    status.version,
                    version,
                )
            p.settle(model_id, worker_id, status)
            log.warning(
                "model %s, lost with its worker, recovered on worker %s at step %d: "
                "%s and %d call(s) replayed",
                model_id,
                worker_id,
                status.version,
                source,
                len(calls),
            )
            return worker_id

    async def _replay(
        self, worker_id: str, model_id: str, calls: list[Logged], lost: AbortedError, source: str
    ) -> None:
        """Submit the logged calls again, in order; on a failure the copy is
        deleted and the model stays lost."""
        for call in calls:
            try:
                await self._call(worker_id, SubmitCall(model_id, call.seq_id, call.op, call.digest))
            except TreadleError as err:
                if err.code in APPLIED_ERRORS:  # refused in its turn, as the first time
                    continue
                with contextlib.suppress(TreadleError):
                    await self._call(worker_id, DeleteModelCall(model_id))
                with self.placement.lock:
                    self.placement.status.pop(model_id, None)
                raise AbortedError(
                    f"{lost.message}; replaying its calls since {source} failed at "
                    f"seq_id {call.seq_id}: {err.message}"
                ) from None
