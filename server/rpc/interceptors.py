"""gRPC interceptors: the one place domain errors become gRPC status codes, the
one place every answer is stamped with the server instance that gave it (so a
client learns at once that the server it talks to restarted), and the one place
each call is timed, counted and given its request id for the logs."""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from treadle.common.logs import request_context
from treadle.errors import InvalidArgumentError, TreadleError
from treadle.server.call_record import (
    CallRecord,
    reset_current_call,
    set_current_call,
)
from treadle.server.db.outage import database_outage
from treadle.server.metrics import ServerMetrics, rpc_name
from treadle.server.rpc.interceptor_base import WrappingInterceptor
from treadle.wire.metadata import INSTANCE_KEY, REQUEST_ID_KEY, error_trailers, new_request_id

log = logging.getLogger("treadle.server")
#: one line per answered RPC, at INFO
access = logging.getLogger("treadle.server.access")


def status_code(err: TreadleError) -> grpc.StatusCode:
    try:
        return grpc.StatusCode[err.code]
    except KeyError:
        return grpc.StatusCode.UNKNOWN


async def abort_with(context: grpc.aio.ServicerContext, err: TreadleError, instance: str) -> None:
    await context.abort(status_code(err), err.message, error_trailers(err, instance))


async def _abort_unexpected(
    context: grpc.aio.ServicerContext, err: Exception, method: str, instance: str
) -> None:
    """A database outage is UNAVAILABLE (retryable); anything else is a bug: INTERNAL."""
    outage = database_outage(err)
    if outage is not None:
        log.warning("%s: %s (%s)", method, outage.message, type(err).__name__)
        await abort_with(context, outage, instance)
        return
    log.exception("%s failed", method)
    stamp = ((INSTANCE_KEY, instance),) if instance else ()
    await context.abort(grpc.StatusCode.INTERNAL, f"{type(err).__name__}: {err}", stamp)


async def _answer_error(
    context: grpc.aio.ServicerContext, err: Exception, method: str, instance: str
) -> None:
    """Abort the call with the status of a behaviour's exception: a ``TreadleError``'s
    own, an abort already under way passed on as it is, anything else through
    ``_abort_unexpected``."""
    if isinstance(err, grpc.aio.AbortError):
        raise err
    if isinstance(err, TreadleError):
        await abort_with(context, err, instance)
    else:
        await _abort_unexpected(context, err, method, instance)


class ErrorInterceptor(WrappingInterceptor):
    """Maps ``TreadleError`` to its status (with a retry delay in the trailers for
    RESOURCE_EXHAUSTED, and the kind and details of an error that shares its code
    with another); a lost database connection is UNAVAILABLE; any other exception
    is a bug: logged, answered INTERNAL.
    Every answer, success or error, carries ``instance`` in its trailers."""

    def __init__(self, instance: str = "") -> None:
        self.instance = instance

    def wrap_unary(
        self, behavior: Callable[..., Any], method: str
    ) -> Callable[..., Awaitable[Any]]:
        return _wrap_unary(behavior, method, self.instance)

    def wrap_stream(
        self, behavior: Callable[..., AsyncIterator[Any]], method: str
    ) -> Callable[..., AsyncIterator[Any]]:
        return _wrap_stream(behavior, method, self.instance)


def _wrap_unary(
    behavior: Callable[..., Any], method: str, instance: str
) -> Callable[..., Awaitable[Any]]:
    stamp = ((INSTANCE_KEY, instance),) if instance else ()

    async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            response = await behavior(request, context)
            context.set_trailing_metadata(stamp)
            return response
        except Exception as err:  # not CancelledError (a BaseException): it passes
            await _answer_error(context, err, method, instance)

    return wrapped


async def stream_items(
    behavior: Callable[..., Any], request: Any, context: grpc.aio.ServicerContext
) -> AsyncIterator[Any]:
    """A server-streaming behaviour's items, whichever of grpc's two styles it uses:
    an async generator's items, or none for a coroutine that writes its answers with
    ``context.write`` and returns (grpc's health ``Watch``)."""
    out = behavior(request, context)
    if inspect.isawaitable(out) and not hasattr(out, "__aiter__"):
        await out
        return
    async for item in out:
        yield item


def _wrap_stream(
    behavior: Callable[..., AsyncIterator[Any]], method: str, instance: str
) -> Callable[..., AsyncIterator[Any]]:
    stamp = ((INSTANCE_KEY, instance),) if instance else ()

    async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        try:
            async for item in stream_items(behavior, request, context):
                yield item
            context.set_trailing_metadata(stamp)
        except Exception as err:  # not CancelledError (a BaseException): it passes
            await _answer_error(context, err, method, instance)

    return wrapped


class _Undecodable:
    """A request whose bytes did not parse, handed on so the answer can say so."""

    def __init__(self, error: Exception) -> None:
        self.error = error


class DecodeInterceptor(WrappingInterceptor):
    """Answers a request that is not a valid message INVALID_ARGUMENT.

    gRPC's own deserialization failure surfaces as UNKNOWN (the deserializer's
    exception escapes every handler); here the deserializer never raises, and the
    handler refuses what did not parse. Listed after ``AuthInterceptor``, so a
    caller without a key hears UNAUTHENTICATED first, whatever it sent.
    """

    def wrap(self, handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
        if handler.request_deserializer is None:
            return handler
        if handler.request_streaming:
            return handler  # none of ours; a stream's messages are parsed as they come
        parse = handler.request_deserializer

        def tolerant(data: bytes) -> Any:
            try:
                return parse(data)
            except Exception as err:  # DecodeError, or a message with a bad field
                return _Undecodable(err)

        def refuse(request: _Undecodable) -> InvalidArgumentError:
            name = getattr(getattr(parse, "__self__", None), "__name__", "message")
            return InvalidArgumentError(
                f"request: not a valid {name} ({request.error}); send the message "
                "serialized by protobuf, as the generated stubs do"
            )

        if handler.unary_unary is not None:
            inner = handler.unary_unary

            async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
                if isinstance(request, _Undecodable):
                    raise refuse(request)
                return await inner(request, context)

            return handler._replace(request_deserializer=tolerant, unary_unary=unary)
        if handler.unary_stream is not None:
            inner_stream = handler.unary_stream

            async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                if isinstance(request, _Undecodable):
                    raise refuse(request)
                async for item in stream_items(inner_stream, request, context):
                    yield item

            return handler._replace(request_deserializer=tolerant, unary_stream=stream)
        return handler


class ObserveInterceptor(WrappingInterceptor):
    """Outermost: each call's request id (the SDK's, or a new one) set for every
    log line written while it is answered, one access line at INFO when it ends
    (method, status, tenant, milliseconds), and, with ``metrics``, its count and
    latency. The tenant comes from ``AuthInterceptor`` (``server.call_record``)."""

    def __init__(self, metrics: ServerMetrics | None = None) -> None:
        self.metrics = metrics

    def _begin(
        self, rpc: str, context: grpc.aio.ServicerContext
    ) -> tuple[CallRecord, contextvars.Token[CallRecord | None], float]:
        """The call's record, made the current call (its reset token), and its start."""
        request_id = ""
        for key, value in context.invocation_metadata() or ():
            if key == REQUEST_ID_KEY:
                request_id = _clean_request_id(value)
                break
        if self.metrics is not None:
            self.metrics.started()
        record = CallRecord(rpc, request_id or new_request_id())
        return record, set_current_call(record), time.perf_counter()

    def _end(
        self,
        record: CallRecord,
        token: contextvars.Token[CallRecord | None],
        context: grpc.aio.ServicerContext,
        t0: float,
        status: str,
    ) -> None:
        """Count and log the call (``status`` "": the one it ended with); no longer current."""
        seconds = time.perf_counter() - t0
        if status == "":
            status = _status_name(context)
        if self.metrics is not None:
            self.metrics.observe(record.rpc, status, record.tenant, seconds)
        access.info(
            "%s %s %.1f ms",
            record.rpc,
            status,
            seconds * 1e3,
            extra={
                "rpc": record.rpc,
                "status": status,
                "tenant": record.tenant,
                "duration_ms": round(seconds * 1e3, 3),
                "request_id": record.request_id,
            },
        )
        reset_current_call(token)

    def wrap_unary(
        self, behavior: Callable[..., Any], method: str
    ) -> Callable[..., Awaitable[Any]]:
        rpc = rpc_name(method)

        async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> Any:
            record, token, t0 = self._begin(rpc, context)
            status = ""
            try:
                with request_context(record.request_id):
                    return await behavior(request, context)
            except asyncio.CancelledError:
                status = "CANCELLED"
                raise
            finally:
                self._end(record, token, context, t0, status)

        return wrapped

    def wrap_stream(
        self, behavior: Callable[..., AsyncIterator[Any]], method: str
    ) -> Callable[..., AsyncIterator[Any]]:
        rpc = rpc_name(method)

        async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            record, token, t0 = self._begin(rpc, context)
            status = ""
            try:
                with request_context(record.request_id):
                    async for item in stream_items(behavior, request, context):
                        yield item
            except (asyncio.CancelledError, GeneratorExit):
                status = "CANCELLED"
                raise
            finally:
                self._end(record, token, context, t0, status)

        return wrapped


def _clean_request_id(value: str | bytes) -> str:
    """At most 64 printable characters of the caller's id (it goes into logs)."""
    text = value.decode("ascii", "replace") if isinstance(value, bytes) else str(value)
    return "".join(c for c in text[:64] if c.isalnum() or c in "-_.:")


def _status_name(context: grpc.aio.ServicerContext) -> str:
    """The status the call ended with: what an abort set, else OK."""
    code = context.code()
    if code is None:
        return "OK"
    if isinstance(code, grpc.StatusCode):
        return code.name
    for member in grpc.StatusCode:
        if member.value[0] == code:
            return member.name
    return str(code)
