"""gRPC interceptors: the one place domain errors become gRPC status codes."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from treadle._rpc import RETRY_AFTER_KEY
from treadle.errors import TreadleError

log = logging.getLogger("treadle.server")


def status_code(err: TreadleError) -> grpc.StatusCode:
    try:
        return grpc.StatusCode[err.code]
    except KeyError:
        return grpc.StatusCode.UNKNOWN


async def abort_with(context: grpc.aio.ServicerContext, err: TreadleError) -> None:
    if err.retry_after_s is not None:
        context.set_trailing_metadata(((RETRY_AFTER_KEY, f"{err.retry_after_s:.3f}"),))
    await context.abort(status_code(err), err.message)


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Maps ``TreadleError`` to its status (with a retry delay in the trailers for
    RESOURCE_EXHAUSTED); any other exception is a bug: logged, answered INTERNAL."""

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
            return handler._replace(unary_unary=_wrap_unary(handler.unary_unary, method))
        if handler.unary_stream is not None:
            return handler._replace(unary_stream=_wrap_stream(handler.unary_stream, method))
        return handler


def _wrap_unary(behavior: Callable[..., Any], method: str) -> Callable[..., Awaitable[Any]]:
    async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await behavior(request, context)
        except TreadleError as err:
            await abort_with(context, err)
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as err:
            log.exception("%s failed", method)
            await context.abort(grpc.StatusCode.INTERNAL, f"{type(err).__name__}: {err}")

    return wrapped


def _wrap_stream(
    behavior: Callable[..., AsyncIterator[Any]], method: str
) -> Callable[..., AsyncIterator[Any]]:
    async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        try:
            async for item in behavior(request, context):
                yield item
        except TreadleError as err:
            await abort_with(context, err)
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as err:
            log.exception("%s failed", method)
            await context.abort(grpc.StatusCode.INTERNAL, f"{type(err).__name__}: {err}")

    return wrapped
