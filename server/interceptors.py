"""gRPC interceptors: the one place domain errors become gRPC status codes, and
the one place every answer is stamped with the server instance that gave it
(so a client learns at once that the server it talks to restarted)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from treadle._rpc import INSTANCE_KEY, error_trailers
from treadle.errors import InvalidArgumentError, TreadleError

log = logging.getLogger("treadle.server")


def status_code(err: TreadleError) -> grpc.StatusCode:
    try:
        return grpc.StatusCode[err.code]
    except KeyError:
        return grpc.StatusCode.UNKNOWN


async def abort_with(context: grpc.aio.ServicerContext, err: TreadleError, instance: str) -> None:
    await context.abort(status_code(err), err.message, error_trailers(err, instance))


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Maps ``TreadleError`` to its status (with a retry delay in the trailers for
    RESOURCE_EXHAUSTED, and the kind and details of an error that shares its code
    with another); any other exception is a bug: logged, answered INTERNAL.
    Every answer, success or error, carries ``instance`` in its trailers."""

    def __init__(self, instance: str = "") -> None:
        self.instance = instance

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        method = handler_call_details.method
        if handler.unary_unary is not None:
            return handler._replace(
                unary_unary=_wrap_unary(handler.unary_unary, method, self.instance)
            )
        if handler.unary_stream is not None:
            return handler._replace(
                unary_stream=_wrap_stream(handler.unary_stream, method, self.instance)
            )
        return handler


def _wrap_unary(
    behavior: Callable[..., Any], method: str, instance: str
) -> Callable[..., Awaitable[Any]]:
    stamp = ((INSTANCE_KEY, instance),) if instance else ()

    async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            response = await behavior(request, context)
            context.set_trailing_metadata(stamp)
            return response
        except TreadleError as err:
            await abort_with(context, err, instance)
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as err:
            log.exception("%s failed", method)
            await context.abort(grpc.StatusCode.INTERNAL, f"{type(err).__name__}: {err}", stamp)

    return wrapped


def _wrap_stream(
    behavior: Callable[..., AsyncIterator[Any]], method: str, instance: str
) -> Callable[..., AsyncIterator[Any]]:
    stamp = ((INSTANCE_KEY, instance),) if instance else ()

    async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        try:
            async for item in behavior(request, context):
                yield item
            context.set_trailing_metadata(stamp)
        except TreadleError as err:
            await abort_with(context, err, instance)
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as err:
            log.exception("%s failed", method)
            await context.abort(grpc.StatusCode.INTERNAL, f"{type(err).__name__}: {err}", stamp)

    return wrapped


class _Undecodable:
    """A request whose bytes did not parse, handed on so the answer can say so."""

    def __init__(self, error: Exception) -> None:
        self.error = error


class DecodeInterceptor(grpc.aio.ServerInterceptor):
    """Answers a request that is not a valid message INVALID_ARGUMENT.

    gRPC's own deserialization failure surfaces as UNKNOWN (the deserializer's
    exception escapes every handler); here the deserializer never raises, and the
    handler refuses what did not parse. Listed after ``AuthInterceptor``, so a
    caller without a key hears UNAUTHENTICATED first, whatever it sent.
    """

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
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
                async for item in inner_stream(request, context):
                    yield item

            return handler._replace(request_deserializer=tolerant, unary_stream=stream)
        return handler
