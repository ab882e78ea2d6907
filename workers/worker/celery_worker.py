"""``treadle worker``: a process that hosts one engine (base models + every
tenant's adapters placed on it) behind a Celery worker consuming its own queue.

Threads, and why:

- main: the Celery worker, ``solo`` pool. The one task decodes a call, hands it
  to the engine and returns at once, so it never blocks on ``seq_id`` order (a
  call waiting for its predecessor waits in the engine's scheduler, not in a
  task slot) and the prefork pool (which forks after OpenMP started) is never used.
- engine: runs every model's calls in ``seq_id`` order (``treadle.workers.engine.loop``).
- store I/O: checkpoint uploads and downloads (``treadle.workers.engine.staging``).
- replies: publishes each resolved call to the reply queue of the server that
  sent it, so neither the engine nor the task thread waits on the broker.
- heartbeat: ``workers.heartbeat_at`` every ``heartbeat_s``, with the engine's report
  (device, memory, models and adapters held, its scheduler's queue per tenant: the
  console's operator page, ``common.engine.report``); a worker the server has
  declared dead stops serving (its models have been marked lost, and may already
  be restored elsewhere).
- drain (on SIGTERM): the worker turns ``draining`` and keeps serving while the
  servers checkpoint its models, one at a time at each one's first idle moment,
  and restore them on other workers at their next calls (``server.lifecycle``).
  Once it hosts no model and answers no call, or after ``drain_timeout_s``, it
  stops as Celery's warm shutdown does; models still here then are lost, as
  with a crash. A second SIGTERM, or SIGINT, stops it at once.
"""

from __future__ import annotations

import logging
import os
import queue
import secrets
import signal
import socket
import threading
import time
from concurrent.futures import Future
from typing import Any

from kombu import Connection

from treadle.common.celery_app import (
    REPLY_CONTENT_TYPE,
    TASK,
    encode_reply,
    make_celery,
    worker_queue,
)
from treadle.common.engine import codec
from treadle.common.engine.api import EngineAPI
from treadle.common.engine.domain import SequenceResult, StreamedSequence
from treadle.common.engine.messages import (
    CALLS,
    CreateModelCall,
    DeleteModelCall,
    EngineCall,
    SampleStreamCall,
    SubmitCall,
    UnloadModelCall,
)
from treadle.common.logs import request_context
from treadle.common.metrics import (
    MetricsEndpoint,
    process_registry,
    serve_metrics,
)
from treadle.errors import FailedPreconditionError, ResourceExhaustedError, UnavailableError
from treadle.workers.engine.collector import EngineCollector
from treadle.workers.engine.flags import engine_config
from treadle.workers.engine.loop import Engine
from treadle.workers.engine.staging import StagedEngine
from treadle.workers.group.launch import build_engine, restart_or_exit
from treadle.workers.worker.config import WorkerConfig

log = logging.getLogger("treadle.worker")

_CALL_TYPES = tuple(CALLS.values())


class Replier:
    """Publishes replies from its own thread and its own broker connection."""

    def __init__(self, broker: str, engine: Engine) -> None:
        self.broker = broker
        self.engine = engine
        self._queue: queue.SimpleQueue[tuple[str, str, Any, str | None, bool] | None] = (
            queue.SimpleQueue()
        )
        self._thread = threading.Thread(target=self._run, name="treadle-replies", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._queue.put(None)
        self._thread.join(5)

    def put(
        self, reply_to: str, cid: str, outcome: Any, model_id: str | None, *, more: bool = False
    ) -> None:
        """``outcome``: a resolved future, a result or an exception; ``more``: an item
        of a streamed call (sent before its final reply, in order)."""
        self._queue.put((reply_to, cid, outcome, model_id, more))

    def _run(self) -> None:
        with Connection(self.broker) as conn:
            producer = conn.Producer()
            while True:
                item = self._queue.get()
                if item is None:
                    return
                reply_to, cid, outcome, model_id, more = item
                try:
                    body = self._encode(cid, outcome, model_id, more)
                    producer.publish(
                        body,
                        exchange="",  # the default exchange: straight to the queue named
                        routing_key=reply_to,
                        content_type=REPLY_CONTENT_TYPE,
                        content_encoding="binary",
                        # readable whatever the body's message version (a server of
                        # another version fails the call with the reason)
                        headers={"cid": cid},
                        retry=True,
                        retry_policy={"max_retries": 5, "interval_start": 0.1},
                    )
                except Exception:
                    log.exception("could not publish the reply of call %s", cid)

    def _encode(self, cid: str, outcome: Any, model_id: str | None, more: bool) -> bytes:
        if isinstance(outcome, Future):
            if outcome.cancelled():
                outcome = UnavailableError(f"call {cid} was cancelled on the worker")
            else:
                err = outcome.exception()
                outcome = err if err is not None else outcome.result()
        status = None
        if model_id is not None and self.engine.has_model(model_id):
            status = self.engine.model_status(model_id)
        try:
            return encode_reply(cid, outcome, status, more=more)
        except codec.CodecError as err:
            return encode_reply(cid, err, status)


class WorkerProcess:
    """One Celery worker process: its engine, its broker consumer, its heartbeat
    (the database's ``Worker`` is the row it keeps; this is the process itself)."""

    def __init__(self, config: WorkerConfig) -> None:
        from treadle.common.db.engine import make_engine, make_session_factory
        from treadle.common.store import make_store

        self.config = config
        self.worker_id = config.worker_id or f"w-{socket.gethostname()}-{secrets.token_hex(4)}"
        self.store = make_store(
            config.store,
            local_root=config.data_dir / "checkpoints",
            endpoint_url=config.s3_endpoint_url,
            staging=config.data_dir / "staging",
        )
        options = engine_config(config, config.models, self.store.local_root)
        self.engine = build_engine(options, on_lost=restart_or_exit(options))
        self.staged = StagedEngine(self.engine, self.store)
        self.api: EngineAPI = self.staged
        self.db = make_engine(config.database_url)
        self.sessions = make_session_factory(self.db)
        self.replies = Replier(config.broker, self.engine)
        self.hosted: set[str] = set()
        self._hosted_lock = threading.Lock()
        self._calls = 0  # calls handed to the engine, not answered yet (under _hosted_lock)
        self._stopping = threading.Event()
        self._draining: threading.Thread | None = None  # started by the first SIGTERM
        self._celery_term: Any = None  # Celery's own SIGTERM handler (warm shutdown)
        self.app = make_celery(config.broker)
        self.app.conf.task_queues = (worker_queue(self.worker_id),)
        self.app.task(name=TASK)(self.handle)

    # ---- the task ----------------------------------------------------------------------

    def handle(self, cid: str, reply_to: str, payload: bytes, request_id: str = "") -> None:
        """Hand the call (an ``engine.messages`` call) to the engine and return; the
        reply goes out when it resolves. ``request_id``: the SDK's id of the call, on
        this worker's log lines of it."""
        with request_context(request_id):
            self._handle(cid, reply_to, payload, request_id)

    def _handle(self, cid: str, reply_to: str, payload: bytes, request_id: str) -> None:
        t0 = time.perf_counter()
        kind, model_id = "?", None
        try:
            msg = codec.decode_message(payload, _CALL_TYPES)
            kind, model_id = type(msg).__name__, msg.status_model
            fut = self._start(msg, cid, reply_to)
        except Exception as err:
            log.info("call %s: %s refused: %s", cid, kind, err, extra={"kind": kind})
            self.replies.put(reply_to, cid, err, None)
            return
        log.info("call %s: %s", cid, kind, extra={"kind": kind, "model_id": model_id or ""})
        self._count_call(1)

        def reply(f: Future[Any]) -> None:
            err = f.exception() if not f.cancelled() else None
            log.info(  # on the engine's thread: the id goes explicitly
                "call %s: %s answered %s in %.1f ms",
                cid,
                kind,
                "OK" if err is None else getattr(err, "code", type(err).__name__),
                (time.perf_counter() - t0) * 1e3,
                extra={"request_id": request_id, "kind": kind, "model_id": model_id or ""},
            )
            self.replies.put(reply_to, cid, f, model_id)
            self._count_call(-1)

        fut.add_done_callback(reply)

    def _count_call(self, delta: int) -> None:
        with self._hosted_lock:
            self._calls += delta

    def _start(self, msg: EngineCall[Any], cid: str, reply_to: str) -> Future[Any]:
        """The engine call of ``msg``, with what this worker keeps about its models
        (which it hosts, its capacity) around the ones that change them."""
        if self.config.role == "sampler" and isinstance(msg, (CreateModelCall, SubmitCall)):
            raise FailedPreconditionError(
                f"worker {self.worker_id} is a sampler worker (--role sampler): it takes "
                "no training model and no training call"
            )
        if isinstance(msg, CreateModelCall):
            return self._create(msg)
        if isinstance(msg, SampleStreamCall):

            def item(index: int, seq: SequenceResult, compute_s: float) -> None:
                out = StreamedSequence(index, seq, compute_s)
                self.replies.put(reply_to, cid, out, None, more=True)

            return self.api.stream(msg, item)
        fut = self.api.call(msg)
        if isinstance(msg, DeleteModelCall):
            model_id = msg.model_id
            fut.add_done_callback(lambda _: self._forget(model_id))
        elif isinstance(msg, UnloadModelCall):
            model_id = msg.model_id
            fut.add_done_callback(lambda f: None if f.exception() else self._forget(model_id))
        return fut

    def _create(self, msg: CreateModelCall) -> Future[Any]:
        spec = msg.spec
        if self.engine.has_model(spec.model_id):  # a server restarted and adopts its models
            done: Future[Any] = Future()
            done.set_result(self.engine.model_status(spec.model_id))
            return done
        with self._hosted_lock:
            if len(self.hosted) >= self.config.capacity:
                raise ResourceExhaustedError(
                    f"worker {self.worker_id} is full ({self.config.capacity} models)",
                    retry_after_s=1.0,
                )
            self.hosted.add(spec.model_id)
        fut = self.api.call(msg)
        fut.add_done_callback(lambda f: self._forget(spec.model_id) if f.exception() else None)
        return fut

    def _forget(self, model_id: str) -> None:
        with self._hosted_lock:
            self.hosted.discard(model_id)

    # ---- lifecycle -----------------------------------------------------------------------

    def _wait_for_schema(self, timeout_s: float = 60.0) -> None:
        """The server owns migrations; a worker waits for the workers table."""
        from sqlalchemy import inspect

        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if inspect(self.db).has_table("workers"):
                    return
                reason = "the database has no workers table yet"
            except Exception as err:  # unreachable database
                reason = f"{type(err).__name__}: {err}"
            if time.monotonic() > deadline:
                raise FailedPreconditionError(
                    f"database_url: {reason}; start `treadle serve` with this database first "
                    "(it applies the migrations)"
                )
            time.sleep(0.5)

    def _register(self) -> None:
        from treadle.common.db import workers as wq

        with self.sessions() as s:
            wq.register_worker(
                s,
                self.worker_id,
                hostname=socket.gethostname(),
                base_models=self.config.models,
                capacity=self.config.capacity,
                role=self.config.role,
            )
            s.commit()
        threading.Thread(target=self._heartbeat, name="treadle-heartbeat", daemon=True).start()
        log.info(
            "worker %s live (role %s): serving %s",
            self.worker_id,
            self.config.role,
            ", ".join(self.config.models),
        )
        print(f"treadle worker {self.worker_id}: ready", flush=True)

    def _heartbeat(self) -> None:
        from treadle.common.db import workers as wq

        while not self._stopping.wait(self.config.heartbeat_s):
            try:
                report = self.engine.report()  # for the console's operator page
            except Exception as err:  # a reading failed: the heartbeat still goes
                log.warning("engine report failed: %s", err)
                report = None
            try:
                with self.sessions() as s:
                    status = wq.heartbeat(s, self.worker_id, report)
                    s.commit()
            except Exception as err:
                log.warning("heartbeat failed: %s", err)
                continue
            if status not in wq.SERVING:
                log.error(
                    "worker %s was declared %s by a server: it stops serving",
                    self.worker_id,
                    status,
                )
                self._stopping.set()
                os.kill(os.getpid(), signal.SIGTERM)
                return

    def _deregister(self) -> None:
        from treadle.common.db import workers as wq

        self._stopping.set()
        try:
            with self.sessions() as s:
                if s.scalar(_status_query(self.worker_id)) in wq.SERVING:
                    wq.set_worker_status(s, self.worker_id, "stopped")
                s.commit()
        except Exception as err:
            log.warning("could not deregister: %s", err)

    # ---- drain -------------------------------------------------------------------------

    def _on_ready(self) -> None:
        self._register()
        self._take_sigterm()

    def _take_sigterm(self) -> None:
        """Put the drain in front of Celery's warm shutdown (run in the main thread,
        once Celery has installed its own handlers)."""
        if self.config.drain_timeout_s <= 0:
            return
        try:
            self._celery_term = signal.getsignal(signal.SIGTERM)
            signal.signal(signal.SIGTERM, self._on_sigterm)
        except ValueError:  # signal handlers are set from the main thread only
            log.warning("SIGTERM stops this worker at once (no drain): not the main thread")

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        if self._draining is None and not self._stopping.is_set():
            self._draining = threading.Thread(target=self._drain, name="treadle-drain", daemon=True)
            self._draining.start()
            return
        # Drained (its own SIGTERM), a second SIGTERM, or declared dead (heartbeat):
        # Celery's warm shutdown.
        if callable(self._celery_term):
            self._celery_term(signum, frame)
        else:
            raise SystemExit(0)

    def _drain(self) -> None:
        from treadle.common.db import workers as wq

        t0 = time.monotonic()
        try:
            with self.sessions() as s:
                if s.scalar(_status_query(self.worker_id)) == "live":
                    wq.set_worker_status(s, self.worker_id, "draining")
                s.commit()
        except Exception as err:
            log.warning("could not mark this worker draining: %s", err)
        left, calls = self._outstanding()
        print(
            f"treadle worker {self.worker_id}: draining {len(left)} model(s), {calls} call(s) "
            f"(at most {self.config.drain_timeout_s:g} s; SIGTERM again to stop now)",
            flush=True,
        )
        deadline = t0 + self.config.drain_timeout_s
        while not self._stopping.is_set():  # set if a server declares this worker dead
            left, calls = self._outstanding()
            if not left and not calls:
                log.info("drained in %.1f s", time.monotonic() - t0)
                break
            if time.monotonic() >= deadline:
                log.warning(
                    "drain timed out after %g s with %d call(s) unanswered; models still "
                    "here are lost: %s",
                    self.config.drain_timeout_s,
                    calls,
                    ", ".join(left) or "none",
                )
                break
            time.sleep(0.1)
        os.kill(os.getpid(), signal.SIGTERM)  # to the main thread: Celery's warm shutdown

    def _serve_metrics(self) -> MetricsEndpoint | None:
        """This worker's engine on ``--metrics-port`` (None: off)."""
        if self.config.metrics_port is None:
            return None
        registry = process_registry()
        registry.register(EngineCollector(self.engine))
        endpoint = serve_metrics(registry, self.config.metrics_host, self.config.metrics_port)
        print(
            f"treadle worker {self.worker_id}: metrics on "
            f"http://{self.config.metrics_host}:{endpoint.port}/metrics",
            flush=True,
        )
        return endpoint

    def _outstanding(self) -> tuple[list[str], int]:
        """The models still hosted here, and the calls not answered yet."""
        with self._hosted_lock:
            return sorted(self.hosted), self._calls

    def run(self) -> int:
        from celery.signals import setup_logging, worker_ready, worker_shutting_down

        # Logging is ours (``treadle.common.logs``: level, text or JSON); a receiver
        # of this signal keeps Celery from configuring the root logger its way.
        setup_logging.connect(lambda **_: None, weak=False)
        self._wait_for_schema()
        self.engine.start()
        metrics = self._serve_metrics()
        self.replies.start()
        worker_ready.connect(lambda **_: self._on_ready(), weak=False)
        # A stopping worker stops heart-beating at once: servers fail its calls
        # rather than wait for replies that will not come.
        worker_shutting_down.connect(lambda **_: self._deregister(), weak=False)
        celery_worker = self.app.Worker(
            hostname=f"{self.worker_id}@{socket.gethostname()}",
            queues=[worker_queue(self.worker_id).name],
            pool_cls="solo",
            concurrency=1,
            loglevel="WARNING",
            without_heartbeat=True,
            without_mingle=True,
            without_gossip=True,
            quiet=True,
            optimization="fair",
        )
        try:
            celery_worker.start()
        finally:
            self._deregister()
            self.engine.stop()
            self.replies.stop()
            self.staged.stop()
            self.db.dispose()
            if metrics is not None:
                metrics.close()
        return int(getattr(celery_worker, "exitcode", 0) or 0)


def _status_query(worker_id: str) -> Any:
    from sqlalchemy import select

    from treadle.common.db.models import Worker

    return select(Worker.status).where(Worker.id == worker_id)


def run_worker(config: WorkerConfig) -> int:
    if config.node_rank > 0:  # another host of a group: its ranks only, no broker
        from treadle.workers.group.launch import run_node

        return run_node(engine_config(config, config.models, None))
    return WorkerProcess(config).run()
