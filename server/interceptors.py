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
from treadle.errors import TreadleError

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
