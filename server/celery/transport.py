"""The RPC transport between a server and its ``treadle worker`` processes.

A call is one Celery task on the worker's own queue; a task never waits for its
result: the worker publishes the resolved call to this server's reply queue
(``treadle.common.celery_app``), a thread here consumes it and resolves the
awaiting coroutine. A call is one typed request of ``treadle.common.engine.messages``
and its answer a ``messages.Reply`` (``treadle.common.engine.codec`` msgpack,
framed with the message version); a reply whose value is not of the request's
response type fails the call.

A worker known gone answers every call at once with UNAVAILABLE, and the calls in
flight on it fail (``fail_gone``), so nothing waits on a worker that will not answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

from kombu import Connection

from treadle.common.celery_app import (
    REPLY_CONTENT_TYPE,
    TASK,
    decode_reply,
    make_celery,
    reply_queue,
    worker_queue,
)
from treadle.common.engine import codec
from treadle.common.engine.domain import ModelStatus, StreamedSequence
from treadle.common.engine.messages import EngineCall, Reply
from treadle.common.logs import current_request_id
from treadle.errors import InternalError, TreadleError, UnavailableError

log = logging.getLogger("treadle.server")
R = TypeVar("R")


@dataclass
class Pending:
    fut: asyncio.Future[Any]
    loop: asyncio.AbstractEventLoop
    worker_id: str
    model_id: str | None
    request: EngineCall[Any]
    on_item: Callable[[Any], None] | None = None  # a streamed call's items (on the loop)


class CeleryTransport:
    def __init__(
        self, broker: str, server_id: str, on_status: Callable[[ModelStatus], None]
    ) -> None:
        self.broker = broker
        self.server_id = server_id
        self.app = make_celery(broker)
        self._reply_to = reply_queue(server_id).name
        #: a worker's answer carries its model's status: where the placement keeps it
        self._on_status = on_status
        self._lock = threading.Lock()
        self._pending: dict[str, Pending] = {}
        self._gone: set[str] = set()
        self._stopping = threading.Event()
        self._ready = threading.Event()
        self._consumer = threading.Thread(target=self._consume, name="treadle-replies", daemon=True)
        self._consumer.start()
        if not self._ready.wait(30):
            self._stopping.set()
            raise UnavailableError(f"broker: cannot reach {shown(broker)} within 30 s")

    def is_gone(self, worker_id: str) -> bool:
        with self._lock:
            return worker_id in self._gone

    def busy_workers(self) -> set[str]:
        """Workers with a call in flight."""
        with self._lock:
            return {p.worker_id for p in self._pending.values()}

    def pending_counts(self) -> dict[str, int]:
        """Calls in flight per worker (the sampler pool routes by it)."""
        counts: dict[str, int] = {}
        with self._lock:
            for p in self._pending.values():
                counts[p.worker_id] = counts.get(p.worker_id, 0) + 1
        return counts

    async def call(
        self,
        worker_id: str,
        request: EngineCall[R],
        *,
        on_item: Callable[[StreamedSequence], None] | None = None,
    ) -> R:
        """``request`` on ``worker_id``: its answer, or its error raised; ``on_item``:
        a streamed request's items, on this loop, before the call resolves."""
        loop = asyncio.get_running_loop()
        cid = uuid.uuid4().hex
        fut: asyncio.Future[Any] = loop.create_future()
        payload = codec.encode_message(request)
        model_id = request.status_model
        with self._lock:
            if worker_id in self._gone:
                raise UnavailableError(f"worker {worker_id} is gone")
            self._pending[cid] = Pending(fut, loop, worker_id, model_id, request, on_item)
        try:
            try:
                self.app.send_task(
                    TASK,
                    args=[cid, self._reply_to, payload],
                    # the SDK's id of the call, on the worker's log lines of it
                    kwargs={"request_id": current_request_id()},
                    queue=worker_queue(worker_id),
                    declare=[],  # the worker declared it; a gone worker's stays gone
                    retry=True,
                    retry_policy={"max_retries": 3, "interval_start": 0.1},
                )
            except Exception as err:
                raise UnavailableError(f"broker: could not send the call: {err}") from None
            result: R = await fut
            return result
        finally:
            with self._lock:
                self._pending.pop(cid, None)

    def fail_gone(self, gone: Iterable[str], why: Callable[[Pending], BaseException]) -> None:
        """Mark workers gone (their later calls fail at once) and fail the calls in
        flight on them with ``why(call)``."""
        failed: list[Pending] = []
        with self._lock:
            self._gone |= set(gone)
            for cid, p in list(self._pending.items()):
                if p.worker_id in self._gone:
                    failed.append(self._pending.pop(cid))
        for p in failed:
            resolve_threadsafe(p, why(p))

    def close(self) -> None:
        self._stopping.set()
        self._consumer.join(5)
        with self._lock:
            pending, self._pending = list(self._pending.values()), {}
        for p in pending:
            resolve_threadsafe(p, UnavailableError("the server is shutting down"))

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
            reply = decode_reply(message.body)
        except Exception as err:
            # a worker of another message version: the call fails with the reason
            cid = (getattr(message, "headers", None) or {}).get("cid")
            with self._lock:
                failed = self._pending.pop(cid, None) if isinstance(cid, str) else None
            if failed is None:
                log.exception("dropped a malformed reply")
                return
            log.error("call %s: the worker's reply cannot be read: %s", cid, err)
            resolve_threadsafe(
                failed, err if isinstance(err, TreadleError) else InternalError(str(err))
            )
            return
        cid = reply.cid
        if reply.more:  # an item of a streamed call: it stays pending
            with self._lock:
                streaming = self._pending.get(cid)
            if streaming is not None and streaming.on_item is not None:
                if not isinstance(reply.value, StreamedSequence):
                    log.error("call %s: dropped a streamed item of %s", cid, type(reply.value))
                    return
                with contextlib.suppress(RuntimeError):  # the loop has closed
                    streaming.loop.call_soon_threadsafe(streaming.on_item, reply.value)
            return
        with self._lock:
            pending = self._pending.pop(cid, None)
        if reply.status is not None:
            self._on_status(reply.status)
        if pending is not None:
            resolve_threadsafe(pending, _outcome(pending, reply))


def resolve_threadsafe(p: Pending, outcome: Any) -> None:
    def settle() -> None:
        if p.fut.done():
            return
        if isinstance(outcome, BaseException):
            p.fut.set_exception(outcome)
        else:
            p.fut.set_result(outcome)

    with contextlib.suppress(RuntimeError):  # the loop has closed
        p.loop.call_soon_threadsafe(settle)


def _outcome(p: Pending, reply: Reply) -> Any:
    """The reply's value, if of the request's response type; its error; else an error."""
    if reply.error is not None:
        return reply.error
    if isinstance(reply.value, type(p.request).response):
        return reply.value
    return InternalError(
        f"worker {p.worker_id} answered {type(p.request).__name__} with "
        f"{type(reply.value).__name__}"
    )


def shown(url: str) -> str:
    """A broker URL as it may be logged: its password masked."""
    from urllib.parse import urlparse

    parsed = urlparse(url)
    if parsed.password:
        return url.replace(f":{parsed.password}@", ":***@")
    return url
