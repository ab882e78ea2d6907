"""``CeleryDispatcher``: the ``Dispatcher`` of a server whose engines run in
``treadle worker`` processes, reached through Celery (Redis or RabbitMQ).

Placement. A new model goes to the least loaded live worker that serves its base
model and has room (fewest active models; ties broken at random), and
``models.worker_id`` records it. Every later call of that model goes to that
worker's own queue; its engine applies them in ``seq_id`` order whatever order
Celery delivers them in, so ordering, barriers and de-duplication stay where
they are in the embedded server.

Replies. A task never waits for its result: the worker publishes the resolved
call to this server's reply queue (``treadle.workers.celery_app``), a thread
here consumes it and resolves the awaiting coroutine. Payloads both ways are
``treadle.workers.codec`` msgpack.

Liveness. A thread checks the ``workers`` table every ``check_s``: a live worker
whose heartbeat is older than ``worker_timeout_s`` is declared dead (one
conditional UPDATE, so one server wins), its active models become ``lost``, and
every call this server has in flight on it fails with UNAVAILABLE. The model
stays at its last applied step (the database has its version and checkpoints);
later calls on it answer ABORTED naming how to restore it: ``load_state`` of a
checkpoint places it again, on a live worker, at that checkpoint (or
``create_training_client_from_state`` makes a new model from it).

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
store), and its next call restores it on a live worker. A model that its
worker let go of this way before stopping is ``unloaded``, not lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
import random
import secrets
import shutil
import socket
import threading
import time
import uuid
import zlib
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kombu import Connection
from sqlalchemy.orm import Session, sessionmaker

from treadle.common.db import models as db
from treadle.common.db import workers as wq
from treadle.common.store import Store, storage_path_str
from treadle.errors import (
    AbortedError,
    FailedPreconditionError,
    NotFoundError,
    ResourceExhaustedError,
    TreadleError,
    UnavailableError,
)
from treadle.server import convert
from treadle.server.dispatch import stream_items
from treadle.server.replay_log import APPLIED_ERRORS, Logged, ReplayLog
from treadle.workers import codec
from treadle.workers.base_models import BaseModelRegistry
from treadle.workers.celery_app import (
    REPLY_CONTENT_TYPE,
    TASK,
    make_celery,
    reply_queue,
    worker_queue,
)
from treadle.workers.domain import (
    LoadResult,
    LoadStateOp,
    ModelSpec,
    ModelStatus,
    OpResult,
    OrderedOp,
    SampleOp,
    SampleResult,
    SamplerTarget,
    SamplingConfig,
    SaveResult,
    StreamedSequence,
)
from treadle.workers.logs import current_request_id
from treadle.workers.model.config import ModelConfig
from treadle.workers.pass_stats import PassStats
from treadle.workers.sampler import SamplerStats

log = logging.getLogger("treadle.server")


@dataclass
class _Pending:
    fut: asyncio.Future[Any]
    loop: asyncio.AbstractEventLoop
    worker_id: str
    model_id: str | None
    on_item: Callable[[Any], None] | None = None  # a streamed call's items (on the loop)


@dataclass(frozen=True)
class _Live:
    worker_id: str
    base_models: tuple[str, ...]


class CeleryDispatcher:
    engine_in_process = False  # the workers keep the models across a server restart

    def __init__(
        self,
        broker: str,
        sessions: sessionmaker[Session],
        bases: BaseModelRegistry,
        *,
        worker_timeout_s: float = 10.0,
        check_s: float | None = None,
        store: Store | None = None,
        replay_log_bytes: int = 64 * 1024 * 1024,
    ) -> None:
        self.broker = broker
        self.replay = ReplayLog(sessions, replay_log_bytes)
        self._records = ThreadPoolExecutor(1, thread_name_prefix="treadle-replay-log")
        self._recovering: dict[str, asyncio.Lock] = {}
        self._replaying: set[str] = set()  # models being replayed (their status is kept)
        self.store = store
        self.app = make_celery(broker)
        self.server_id = f"srv-{socket.gethostname()}-{secrets.token_hex(4)}"
        self._reply_to = reply_queue(self.server_id).name
        self.sessions = sessions
        self.bases = bases
        self.worker_timeout_s = worker_timeout_s
        self.check_s = check_s or max(0.2, min(2.0, worker_timeout_s / 4))
        self._lock = threading.Lock()
        self._pending: dict[str, _Pending] = {}
        self._placement: dict[str, str] = {}  # model_id -> worker_id
        self._lost: dict[str, str] = {}  # model_id -> the worker it was lost with
        self._status: dict[str, ModelStatus] = {}
        self._gone: set[str] = set()
        self._placing: Counter[str] = Counter()  # creations in flight, per worker
        self._live: list[_Live] = []
        self._draining: set[str] = set()  # model ids on workers stopping gracefully
        self._restored: dict[tuple[str, int], LoadResult] = {}
        self._stopping = threading.Event()
        self._ready = threading.Event()
        self._consumer = threading.Thread(target=self._consume, name="treadle-replies", daemon=True)
        self._watcher = threading.Thread(target=self._watch, name="treadle-watchdog", daemon=True)
        self._consumer.start()
        if not self._ready.wait(30):
            self._stopping.set()
            raise UnavailableError(f"broker: cannot reach {_shown(broker)} within 30 s")
        self._refresh()
        self._watcher.start()

    # ---- Dispatcher ----------------------------------------------------------------------

    async def create_model(
        self, spec: ModelSpec, *, from_state: str | Path | None, next_seq_id: int
    ) -> ModelStatus:
        path = storage_path_str(from_state) if from_state is not None else None
        adopt = self._adoptable(spec.model_id)
        candidates = [adopt] if adopt else self._candidates(spec.base_model)
        last: TreadleError | None = None
        for worker_id in candidates:
            with self._lock:  # counted by _candidates until the DB row says where it went
                self._placing[worker_id] += 1
            try:
                status = await self._call(
                    worker_id, "create", (spec, path, next_seq_id), spec.model_id
                )
                with self.sessions() as s:
                    wq.place_model(s, spec.model_id, worker_id)
                    s.commit()
            except ResourceExhaustedError as err:  # full since we counted: try the next
                last = err
                continue
            finally:
                with self._lock:
                    self._placing[worker_id] -= 1
            with self._lock:
                self._placement[spec.model_id] = worker_id
                self._lost.pop(spec.model_id, None)
                self._status[spec.model_id] = status
            return status  # type: ignore[no-any-return]
        raise last or UnavailableError(f"no live worker serves base model {spec.base_model!r}")

    async def delete_model(self, model_id: str) -> None:
        with self._lock:
            worker_id = self._placement.pop(model_id, None)
            self._lost.pop(model_id, None)
            self._status.pop(model_id, None)
            gone = worker_id in self._gone
        self.replay.forget(model_id)
        if worker_id is None or gone:
            raise NotFoundError(f"model {model_id} not found")
        await self._call(worker_id, "delete", (model_id,), None)

    async def unload_model(
        self, model_id: str, directory: str | Path, *, force: bool = False
    ) -> SaveResult:
        """Checkpoint the idle model to the storage path ``directory`` and free it
        (``force`` is not offered: a worker that stops drains its own models)."""
        worker_id = self._worker_of(model_id)
        path = storage_path_str(directory)
        result = await self._call(worker_id, "unload", (model_id, path), None)
        with self._lock:
            self._placement.pop(model_id, None)
            self._status.pop(model_id, None)
        return result  # type: ignore[no-any-return]

    async def export_weights(
        self, model_id: str, directory: str | Path, *, merged: bool
    ) -> list[str]:
        """The worker exports into the store; the files come down into ``directory``."""
        store = self.store
        if store is None:
            raise FailedPreconditionError("export: this server has no checkpoint store")
        worker_id = self._worker_of(model_id)
        with self.sessions() as s:
            row = s.get(db.Model, model_id)
            if row is None:
                raise NotFoundError(f"model {model_id} not found")
            tenant_id = row.tenant_id
        path = store.state_path(tenant_id, model_id, f"export-{uuid.uuid4().hex[:12]}")
        names = list(await self._call(worker_id, "export", (model_id, path, merged), None))

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
        return names

    async def submit(self, model_id: str, seq_id: int, op: OrderedOp, digest: str) -> OpResult:
        restored = self._restored.get((model_id, seq_id))
        if restored is not None:  # a repeat of the load_state that restored it
            return restored
        try:
            worker_id = self._worker_of(model_id)
        except AbortedError:
            if isinstance(op, LoadStateOp):
                return await self._restore(model_id, seq_id, op)
            worker_id = await self._recover(model_id)
        try:
            result = await self._call(worker_id, "submit", (model_id, seq_id, op, digest), model_id)
        except TreadleError as err:
            if err.code in APPLIED_ERRORS:  # refused in its turn: it took its seq_id
                await self._keep(model_id, seq_id, op)
            raise
        await self._keep(model_id, seq_id, op)
        return result  # type: ignore[no-any-return]

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

    async def sample(
        self, target: SamplerTarget, op: SampleOp, dedupe_key: tuple[str, int, str] | None
    ) -> SampleResult:
        worker_id = await self._route(target, dedupe_key[0] if dedupe_key else None)
        return await self._call(worker_id, "sample", (target, op, dedupe_key), None)  # type: ignore[no-any-return]

    async def sample_stream(
        self, target: SamplerTarget, op: SampleOp
    ) -> AsyncIterator[StreamedSequence]:
        """The worker replies once per sample as it finishes (``more`` replies, in
        order on this server's reply queue), then once at the end. Closing the
        iterator early stops listening; the worker finishes the samples anyway
        (there is no cancel message)."""
        worker_id = await self._route(target, None)
        items: asyncio.Queue[StreamedSequence] = asyncio.Queue()
        call = asyncio.ensure_future(
            self._call(worker_id, "sample_stream", (target, op), None, on_item=items.put_nowait)
        )
        try:
            async with contextlib.aclosing(stream_items(items, call, op.num_samples)) as stream:
                async for item in stream:
                    yield item
        finally:
            if not call.done():
                call.cancel()

    async def resume(
        self,
        target: SamplerTarget,
        sampler_id: str,
        handles: tuple[str, ...],
        params: SamplingConfig,
    ) -> SampleResult:
        """On the worker that sampled through ``sampler_id`` (it keeps the
        handles): resume through the sampler that returned them."""
        worker_id = await self._route(target, sampler_id)
        return await self._call(worker_id, "resume", (target, handles, params), None)  # type: ignore[no-any-return]

    async def check_sampler_target(self, target: SamplerTarget) -> int:
        worker_id = await self._route(target, None)
        return int(await self._call(worker_id, "check_target", (target,), None))

    def model_status(self, model_id: str) -> ModelStatus:
        with self._lock:
            status = self._status.get(model_id)
        if status is None:
            raise NotFoundError(f"model {model_id} not found")
        return status

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

    def draining_models(self) -> set[str]:
        with self._lock:
            return set(self._draining)

    def close(self) -> None:
        self._stopping.set()
        self._records.shutdown(wait=True, cancel_futures=False)
        self._watcher.join(5) if self._watcher.is_alive() else None
        self._consumer.join(5)
        with self._lock:
            pending, self._pending = list(self._pending.values()), {}
        for p in pending:
            _resolve_threadsafe(p, UnavailableError("the server is shutting down"))

    # ---- routing ---------------------------------------------------------------------------

    def _worker_of(self, model_id: str) -> str:
        with self._lock:
            worker_id = self._placement.get(model_id)
            if worker_id is not None and worker_id not in self._gone:
                return worker_id
            lost_with = self._lost.get(model_id) or worker_id
        with self.sessions() as s:
            row = s.get(db.Model, model_id)
            if row is None or row.status == "deleted":
                raise NotFoundError(f"model {model_id} not found")
            if (
                lost_with is None
                and row.status == "active"
                and row.worker_id
                and row.worker_id not in wq.gone_workers(s, [row.worker_id])
            ):
                with self._lock:
                    self._placement[model_id] = row.worker_id
                return row.worker_id
            ckpt = row.last_checkpoint
            hint = f" (its last checkpoint: {ckpt.uri})" if ckpt is not None else ""
            raise AbortedError(
                f"model {model_id} was lost with its worker {lost_with or row.worker_id} "
                f"(no heartbeat for {self.worker_timeout_s:g} s); it stays at step {row.version}. "
                f"Restore it from a checkpoint with load_state{hint}, or create a new model from one"
            )

    async def _route(self, target: SamplerTarget, sampler_id: str | None) -> str:
        """``_worker_for_target``; a sampler of a lost model brings the model back
        (``_recover``) as its next training call would."""
        try:
            return self._worker_for_target(target, sampler_id)
        except AbortedError:
            if target.model_id is None:
                raise
            await self._recover(target.model_id)
            return self._worker_for_target(target, sampler_id)

    def _worker_for_target(self, target: SamplerTarget, sampler_id: str | None) -> str:
        if target.model_id is not None:
            return self._worker_of(target.model_id)
        with self._lock:
            live = [w.worker_id for w in self._live if target.base_model in w.base_models]
            live = [w for w in live if w not in self._gone]
        if not live:
            raise UnavailableError(f"no live worker serves base model {target.base_model!r}")
        if sampler_id is None:
            return random.choice(live)
        # one sampler sticks to one worker, so its seq_id de-duplication holds
        return live[zlib.crc32(sampler_id.encode()) % len(live)]

    def _adoptable(self, model_id: str) -> str | None:
        """A model whose live worker still hosts it (a restarted server adopts it)."""
        with self.sessions() as s:
            row = s.get(db.Model, model_id)
            if row is None or row.status != "active" or not row.worker_id:
                return None
            if wq.gone_workers(s, [row.worker_id]):
                return None
            return row.worker_id

    def _candidates(self, base_model: str, exclude: Iterable[str] = ()) -> list[str]:
        """Live workers serving ``base_model`` with room, least loaded first."""
        skip = set(exclude)
        with self.sessions() as s:
            live = wq.live_workers(s, _utcnow() - dt.timedelta(seconds=self.worker_timeout_s))
            loads = wq.worker_loads(s)
            rows = [
                (loads.get(w.id, 0), random.random(), w.id)
                for w in live
                if base_model in wq.base_models_of(w)
                and loads.get(w.id, 0) < w.capacity
                and w.id not in skip
            ]
        with self._lock:
            # Creations in flight count too: concurrent creates would otherwise all
            # read the same loads and pile onto one worker.
            rows = [(n + self._placing[w], r, w) for n, r, w in rows if w not in self._gone]
        if not rows:
            raise UnavailableError(
                f"no live worker serves base model {base_model!r} with room for another model "
                f"(start one: treadle worker --model {base_model}=DIR --broker ...)"
            )
        return [w for _, _, w in sorted(rows)]

    async def _restore(self, model_id: str, seq_id: int, op: LoadStateOp) -> LoadResult:
        with self.sessions() as s:
            row = s.get(db.Model, model_id)
            if row is None:
                raise NotFoundError(f"model {model_id} not found")
            spec = convert.model_spec(row)
        with self._lock:
            dead = {w for w in (self._lost.get(model_id), self._placement.get(model_id)) if w}
        status = None
        last: TreadleError | None = None
        for worker_id in self._candidates(spec.base_model, exclude=dead):
            try:
                status = await self._call(
                    worker_id, "create", (spec, op.directory, seq_id + 1), model_id
                )
            except ResourceExhaustedError as err:
                last = err
                continue
            with self.sessions() as s:
                wq.place_model(s, model_id, worker_id)
                s.commit()
            with self._lock:
                self._placement[model_id] = worker_id
                self._lost.pop(model_id, None)
                self._status[model_id] = status
            break
        if status is None:
            raise last or UnavailableError(f"no live worker serves base model {spec.base_model!r}")
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
                return self._worker_of(model_id)  # another call recovered it meanwhile
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
            with self._lock:
                dead = {w for w in (self._lost.get(model_id), self._placement.get(model_id)) if w}
            last: TreadleError = lost
            for worker_id in self._candidates(spec.base_model, exclude=dead):
                try:
                    status = await self._call(
                        worker_id, "create", (spec, directory, start + 1), model_id
                    )
                except ResourceExhaustedError as err:
                    last = err
                    continue
                with self._lock:
                    self._replaying.add(model_id)
                    self._status[model_id] = status
                try:
                    await self._replay(worker_id, model_id, calls, lost, source)
                finally:
                    with self._lock:
                        self._replaying.discard(model_id)
                with self._lock:
                    status = self._status.get(model_id, status)
                if status.version != version:
                    log.warning(
                        "model %s replayed to step %d, but the database says %d",
                        model_id,
                        status.version,
                        version,
                    )
                with self.sessions() as s:
                    wq.place_model(s, model_id, worker_id)
                    s.commit()
                with self._lock:
                    self._placement[model_id] = worker_id
                    self._lost.pop(model_id, None)
                    self._status[model_id] = status
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
            raise last

    async def _replay(
        self, worker_id: str, model_id: str, calls: list[Logged], lost: AbortedError, source: str
    ) -> None:
        """Submit the logged calls again, in order; on a failure the copy is
        deleted and the model stays lost."""
        for call in calls:
            try:
                await self._call(
                    worker_id, "submit", (model_id, call.seq_id, call.op, call.digest), model_id
                )
            except TreadleError as err:
                if err.code in APPLIED_ERRORS:  # refused in its turn, as the first time
                    continue
                with contextlib.suppress(TreadleError):
                    await self._call(worker_id, "delete", (model_id,), None)
                with self._lock:
                    self._status.pop(model_id, None)
                raise AbortedError(
                    f"{lost.message}; replaying its calls since {source} failed at "
                    f"seq_id {call.seq_id}: {err.message}"
                ) from None

    # ---- calls and replies ---------------------------------------------------------------------

    async def _call(
        self,
        worker_id: str,
        kind: str,
        args: tuple[Any, ...],
        model_id: str | None,
        *,
        on_item: Callable[[Any], None] | None = None,
    ) -> Any:
        loop = asyncio.get_running_loop()
        cid = uuid.uuid4().hex
        fut: asyncio.Future[Any] = loop.create_future()
        with self._lock:
            if worker_id in self._gone:
                raise UnavailableError(f"worker {worker_id} is gone")
            self._pending[cid] = _Pending(fut, loop, worker_id, model_id, on_item)
        try:
            try:
                self.app.send_task(
                    TASK,
                    args=[cid, self._reply_to, kind, codec.encode(args)],
                    # the SDK's id of the call, on the worker's log lines of it
                    kwargs={"request_id": current_request_id()},
                    queue=worker_queue(worker_id),
                    declare=[],  # the worker declared it; a gone worker's stays gone
                    retry=True,
                    retry_policy={"max_retries": 3, "interval_start": 0.1},
                )
            except Exception as err:
                raise UnavailableError(f"broker: could not send the call: {err}") from None
            return await fut
        finally:
            with self._lock:
                self._pending.pop(cid, None)

    def _consume(self) -> None:
        while not self._stopping.is_set():
            try:
                with Connection(self.broker, connect_timeout=5) as conn:
                    conn.ensure_connection(max_retries=3)
                    with conn.Consumer(
                        [reply_queue(self.server_id)],  # declared here, before any call
                        on_message=self._on_reply,
                        no_ack=True,
                        accept=[REPLY_CONTENT_TYPE],
                    ):
                        self._ready.set()
                        while not self._stopping.is_set():
                            with contextlib.suppress(socket.timeout, TimeoutError):
                                conn.drain_events(timeout=0.5)
            except Exception as err:
                if self._stopping.is_set():
                    return
                log.warning("reply channel: %s; reconnecting", err)
                time.sleep(0.5)

    def _on_reply(self, message: Any) -> None:
        try:
            reply = codec.decode(message.body)
            cid, ok, value, status = reply["cid"], reply["ok"], reply["value"], reply["status"]
        except Exception:
            log.exception("dropped a malformed reply")
            return
        if reply.get("more"):  # an item of a streamed call: it stays pending
            with self._lock:
                streaming = self._pending.get(cid)
            if streaming is not None and streaming.on_item is not None:
                with contextlib.suppress(RuntimeError):  # the loop has closed
                    streaming.loop.call_soon_threadsafe(streaming.on_item, value)
            return
        with self._lock:
            pending = self._pending.pop(cid, None)
            if isinstance(status, ModelStatus) and (
                status.model_id in self._placement or status.model_id in self._replaying
            ):
                self._status[status.model_id] = status
        if pending is not None:
            _resolve_threadsafe(pending, value if ok else _as_error(value))

    # ---- liveness ---------------------------------------------------------------------------------

    def _refresh(self) -> None:
        """One liveness pass: declare stale workers dead, mark their models lost, fail
        the calls in flight on any gone worker, and refresh the live-worker list."""
        now = _utcnow()
        with self._lock:
            in_use = set(self._placement.values()) | {p.worker_id for p in self._pending.values()}
        with self.sessions() as s:
            declared = wq.declare_dead(s, now - dt.timedelta(seconds=self.worker_timeout_s))
            lost_models = wq.mark_models_lost(s, wq.stopped_workers_with_models(s))
            gone = wq.gone_workers(s, in_use)
            live = [
                _Live(w.id, tuple(wq.base_models_of(w)))
                for w in wq.live_workers(s, now - dt.timedelta(seconds=self.worker_timeout_s))
            ]
            draining = wq.active_models_on(s, wq.draining_workers(s))
            # Models a draining worker let go of before it stopped were checkpointed
            # and wait to be restored elsewhere: moved, not lost.
            with self._lock:
                leaving = [m for m, w in self._placement.items() if w in gone]
            moved = wq.unloaded_models(s, leaving)
            stopped = wq.stopped_cleanly(s, gone)
            s.commit()
        for worker_id in declared:
            log.warning(
                "worker %s declared dead (no heartbeat for %g s)", worker_id, self.worker_timeout_s
            )
        if lost_models:
            log.warning("models lost with their workers: %s", ", ".join(lost_models))
        failed: list[_Pending] = []
        with self._lock:
            self._live = live
            self._draining = draining
            self._gone |= gone
            for model_id, worker_id in list(self._placement.items()):
                if worker_id in gone:
                    del self._placement[model_id]
                    if model_id not in moved:
                        self._lost[model_id] = worker_id
                    self._status.pop(model_id, None)
            for cid, p in list(self._pending.items()):
                if p.worker_id in gone:
                    failed.append(self._pending.pop(cid))
        for p in failed:
            why = (
                "stopped"
                if p.worker_id in stopped
                else f"stopped answering (no heartbeat for {self.worker_timeout_s:g} s)"
            )
            _resolve_threadsafe(
                p,
                UnavailableError(
                    f"worker {p.worker_id} {why}"
                    + (f"; model {p.model_id} stays at its last applied step" if p.model_id else "")
                ),
            )

    def _watch(self) -> None:
        while not self._stopping.wait(self.check_s):
            try:
                self._refresh()
            except Exception:
                log.exception("worker liveness check failed")


def _resolve_threadsafe(p: _Pending, outcome: Any) -> None:
    def settle() -> None:
        if p.fut.done():
            return
        if isinstance(outcome, BaseException):
            p.fut.set_exception(outcome)
        else:
            p.fut.set_result(outcome)

    with contextlib.suppress(RuntimeError):  # the loop has closed
        p.loop.call_soon_threadsafe(settle)


def _as_error(value: Any) -> BaseException:
    if isinstance(value, BaseException):
        return value
    return UnavailableError(f"worker answered an error it could not describe: {value!r}")


def _utcnow() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


def _shown(url: str) -> str:
    from urllib.parse import urlparse

    parsed = urlparse(url)
    if parsed.password:
        return url.replace(f":{parsed.password}@", ":***@")
    return url
