"""The SDK's futures: a call that does work answers ``{request_id}`` at once and
its result is fetched with ``retrieve_future``.

``retrieve_future`` holds the request until the call's task finishes (up to
``hold_s``, then ``try_again``, which the SDK follows with the next poll at
once), so a result reaches the client the moment the engine has it: no polling
interval. A request id the server does not know (expired, or made before a
restart, or another tenant's) answers 410, on which the SDK resubmits the
original request; its ``seq_id`` makes that resubmission exactly-once.

An answer that carries the result (or its error) has the header
``x-treadle-ready-monotonic``: when the call's task finished, in this host's
``time.monotonic()`` seconds (CLOCK_MONOTONIC, system-wide on Linux), so a
client on the same host can measure how long the result took to reach it.

Finished results are dropped ``keep_s`` after they finished, oldest first, from a
queue in finishing order: a call's bookkeeping is O(1) amortised however many
results are held (no scan of every entry per call).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from starlette.responses import JSONResponse, Response

from treadle.server.http import errors
from treadle.server.http.wire import PROTOBUF

#: on a retrieve_future answer with the result: when it was ready (time.monotonic() seconds)
READY_HEADER = "x-treadle-ready-monotonic"
#: turns a call's result into the answer of retrieve_future: JSON (a dict) or protobuf (bytes)
Encoder = Callable[[Any], "dict[str, Any] | bytes"]


@dataclass
class _Entry:
    tenant: str
    task: asyncio.Task[Any]
    encode: Encoder
    finished: float | None = None
    key: tuple[str, ...] | None = None  # its ``once`` key, dropped with it


class Futures:
    def __init__(
        self,
        hold_s: float = 30.0,
        keep_s: float = 900.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.hold_s = hold_s
        self.keep_s = keep_s  # how long a finished result stays retrievable
        self._clock = clock
        self._entries: dict[str, _Entry] = {}
        self._keys: dict[tuple[str, ...], str] = {}  # (tenant, *key) -> request id
        #: (when it finished, request id), in finishing order: the next to expire first
        self._done: deque[tuple[float, str]] = deque()

    def start(self, tenant: str, work: Awaitable[Any], encode: Encoder) -> str:
        """Run ``work`` in a task; its request id."""
        self._expire()
        request_id = uuid.uuid4().hex
        task = asyncio.ensure_future(work)
        entry = _Entry(tenant, task, encode)
        task.add_done_callback(lambda t: self._finished(request_id, entry, t))
        self._entries[request_id] = entry
        return request_id

    def once(
        self,
        tenant: str,
        key: tuple[str, ...],
        work: Callable[[], Awaitable[Any]],
        encode: Encoder,
    ) -> str:
        """``start``, unless a call of this key was started already (a retried
        create_model of the same session and ``model_seq_id``): its request id."""
        if not key[-1]:
            return self.start(tenant, work(), encode)
        existing = self._keys.get((tenant, *key))
        if existing is not None and existing in self._entries:
            entry = self._entries[existing]
            failed = entry.task.done() and (entry.task.cancelled() or entry.task.exception())
            if not failed:
                return existing
        request_id = self.start(tenant, work(), encode)
        self._keys[(tenant, *key)] = request_id
        self._entries[request_id].key = (tenant, *key)
        return request_id

    async def retrieve(self, tenant: str, request_id: str) -> Response:
        entry = self._entries.get(request_id)
        if entry is None or entry.tenant != tenant:
            raise errors.GoneError(
                f"request_id: {request_id!r} is not held here; resubmit the request"
            )
        if not entry.task.done():
            await asyncio.wait({entry.task}, timeout=self.hold_s)
        if not entry.task.done():
            return JSONResponse(
                {"type": "try_again", "request_id": request_id, "queue_state": "active"}
            )
        answer = _answer(entry)
        if entry.finished is not None:
            answer.headers[READY_HEADER] = f"{entry.finished:.6f}"
        return answer

    def cancel(self, tenant: str, request_id: str) -> bool:
        entry = self._entries.get(request_id)
        if entry is None or entry.tenant != tenant or entry.task.done():
            return False
        entry.task.cancel()
        return True

    def close(self) -> None:
        for entry in self._entries.values():
            entry.task.cancel()
        self._entries.clear()
        self._keys.clear()
        self._done.clear()

    def _finished(self, request_id: str, entry: _Entry, task: asyncio.Task[Any]) -> None:
        entry.finished = self._clock()
        self._done.append((entry.finished, request_id))
        if not task.cancelled():
            with contextlib.suppress(BaseException):
                task.exception()  # seen here: retrieve_future reports it

    def _expire(self) -> None:
        """Drop the results finished more than ``keep_s`` ago: from the front of
        the finishing-order queue, so each result is looked at once."""
        horizon = self._clock() - self.keep_s
        while self._done and self._done[0][0] < horizon:
            _, request_id = self._done.popleft()
            entry = self._entries.pop(request_id, None)
            key = entry.key if entry is not None else None
            if key is not None and self._keys.get(key) == request_id:
                del self._keys[key]


def _answer(entry: _Entry) -> Response:
    if entry.task.cancelled():
        return JSONResponse({"error": "CANCELLED: the request was cancelled", "category": "user"})
    err = entry.task.exception()
    if err is not None:
        return JSONResponse(errors.failed_future(err))
    body = entry.encode(entry.task.result())
    if isinstance(body, bytes):
        return Response(body, media_type=PROTOBUF)
    return JSONResponse(body)
