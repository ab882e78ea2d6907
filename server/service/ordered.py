"""The ordered-call pipeline, written once for every transport.

One ordered call on a training model goes: the model loaded (restored if it
was unloaded for idling) and counted in use; the restart check of the client's
numbering; ``seq_id`` >= 1; the op built (bad input becomes a ``RejectedOp``
that still takes its ``seq_id``); the op's row inserted unless the ``seq_id`` is
a repeat (a repeat is neither admitted against the quota nor counted again);
dispatched to the engine, which applies it in order exactly once; the row
finished (with the engine in this process, behind the answer: ``OpEndings``);
usage counted once, by the call that finished the row.

``CallHandle`` lets a transport that answers later (an HTTP future) start a
call, learn at once whether it was admitted, and await its result the moment
the engine has it, without polling.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Generator
from typing import Any, Generic, TypeVar

from treadle.common.engine.domain import OpResult, OrderedOp, RejectedOp
from treadle.common.engine.messages import SubmitCall
from treadle.errors import InvalidArgumentError, TreadleError
from treadle.server import restarts
from treadle.server.accounting.metering import CallMeter
from treadle.server.context import ServerContext
from treadle.server.db import ops_log
from treadle.server.service.op_endings import Ending, OpEndings
from treadle.server.service.types import OrderedCall

R = TypeVar("R")

#: resolved when a call has passed admission (or failed before it)
Admission = asyncio.Future[None]


class OrderedPipeline:
    """Runs ordered calls through the pipeline; the one place they are metered."""

    def __init__(self, ctx: ServerContext, meter: CallMeter, endings: OpEndings) -> None:
        self.ctx = ctx
        self.meter = meter
        self.endings = endings

    async def run(
        self,
        tenant: str,
        call: OrderedCall,
        build: Callable[[], OrderedOp],
        kind: str,
        *,
        admitted: Admission | None = None,
    ) -> OpResult:
        """Apply the call (or return its recorded result) and return the engine's
        result. ``build`` makes the op; a ``TreadleError`` it raises becomes the
        call's answer, after the call has taken its ``seq_id``. ``admitted`` is
        resolved once the call is queued for the engine, or fails with the error
        that stopped it before (not found, over quota, a bad ``seq_id``)."""
        try:
            # Restores the model first if it was unloaded for idling (same seq_ids).
            async with self.ctx.lifecycle.using(tenant, call.model_id):
                # A client numbering from before a restart, past where the model is back: at once.
                restarts.check_client_numbering(
                    self.ctx.instance_id,
                    self.ctx.restored,
                    call.numbering,
                    call.model_id,
                    call.seq_id,
                    lambda: self.ctx.dispatcher.model_status(call.model_id),
                )
                return await self._submit(tenant, call, build, kind, admitted)
        except BaseException as err:
            _fail(admitted, err)
            raise

    async def _submit(
        self,
        tenant: str,
        call: OrderedCall,
        build: Callable[[], OrderedOp],
        kind: str,
        admitted: Admission | None,
    ) -> OpResult:
        if call.seq_id < 1:
            raise InvalidArgumentError(f"seq_id: must be >= 1 (got {call.seq_id})")
        try:
            op = build()
        except TreadleError as err:
            op = RejectedOp(err, kind=kind)
        ticket = None
        try:
            with self.ctx.connection() as conn:
                # A repeat of a recorded call is not admitted (or counted) again; a
                # call over quota raises here and its row is rolled back.
                if ops_log.insert_op_if_new(conn, call.model_id, call.seq_id, kind, call.digest):
                    ticket, op = self.meter.admit_ordered(tenant, call.model_id, call.seq_id, op)
        except Exception:
            self.meter.release_ordered(call.model_id, call.seq_id, ticket)
            raise
        if admitted is not None and not admitted.done():
            admitted.set_result(None)
        try:
            result = await self.ctx.dispatcher.call(
                SubmitCall(call.model_id, call.seq_id, op, call.digest)
            )
        except TreadleError as err:
            self._finish(call, "failed", err.code)
            raise
        finally:
            self.meter.release_ordered(call.model_id, call.seq_id, ticket)
        # applied now, exactly once: counted by the call that ends its row

        def ended() -> None:
            self.meter.count_ordered(tenant, call.model_id, op, result)
            if self.ctx.step_metrics is not None:  # the run's curves
                self.ctx.step_metrics.add(call.model_id, call.seq_id, op.kind, result)

        self._finish(call, "done", None, ended)
        return result

    def _finish(
        self,
        call: OrderedCall,
        status: str,
        code: str | None,
        on_ended: Callable[[], None] | None = None,
    ) -> None:
        """Record the call's end; ``on_ended`` runs if this was the call that ended
        it (a call that failed UNAVAILABLE ends done when its repeat, same payload,
        is applied). With the engine in this process the end is written behind the
        answer (``OpEndings``), else before it."""
        ending = Ending(call.model_id, call.seq_id, status, code, call.digest, on_ended)
        if self.ctx.dispatcher.engine_in_process:
            self.endings.end(ending)
            return
        with self.ctx.connection() as conn:
            ended = ops_log.finish_pending_op(
                conn, call.model_id, call.seq_id, status, code, call.digest
            )
        if ended and on_ended is not None:
            on_ended()


def _fail(admitted: Admission | None, err: BaseException) -> None:
    if admitted is None or admitted.done():
        return
    if isinstance(err, asyncio.CancelledError):
        admitted.cancel()
    else:
        admitted.set_exception(err)


def _retrieve(fut: asyncio.Future[Any]) -> None:
    """Mark a future's error as seen: the handle's owner may only ever look at one
    of the two futures, and asyncio would log the other's as never retrieved."""
    if not fut.cancelled():
        fut.exception()


class CallHandle(Generic[R]):
    """A call started in its own task: ``await handle.admitted()`` raises what
    refused it before it was queued (NOT_FOUND, RESOURCE_EXHAUSTED with its retry
    delay, INVALID_ARGUMENT for a bad seq_id); ``await handle`` gives its result
    the moment the engine finishes (or raises its error); ``add_done_callback``
    tells a callback instead. Awaiting is shielded: a waiter that gives up (an
    HTTP long poll's timeout) leaves the call running."""

    def __init__(self, task: asyncio.Task[R], admitted: Admission) -> None:
        self._task = task
        self._admitted = admitted
        task.add_done_callback(_retrieve)
        admitted.add_done_callback(_retrieve)

    @classmethod
    def start(cls, call: Callable[..., Awaitable[R]], *args: Any) -> CallHandle[R]:
        """Start ``call(*args, admitted=...)`` (a service method) in a task."""
        admitted: Admission = asyncio.get_running_loop().create_future()

        async def run() -> R:
            try:
                return await call(*args, admitted=admitted)
            except BaseException as err:  # once admitted, only the task carries it
                _fail(admitted, err)
                raise
            finally:
                if not admitted.done():
                    admitted.set_result(None)

        return cls(asyncio.ensure_future(run()), admitted)

    async def admitted(self) -> None:
        await asyncio.shield(self._admitted)

    def done(self) -> bool:
        return self._task.done()

    def result(self) -> R:
        """The result of a finished call (``asyncio.InvalidStateError`` before)."""
        return self._task.result()

    def add_done_callback(self, callback: Callable[[CallHandle[R]], None]) -> None:
        self._task.add_done_callback(lambda _: callback(self))

    def cancel(self) -> None:
        self._task.cancel()

    def __await__(self) -> Generator[Any, None, R]:
        return asyncio.shield(self._task).__await__()
