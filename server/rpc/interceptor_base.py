"""The plumbing the server's interceptors share: find the handler of a call and
replace its behaviour with a wrapped one (``WrappingInterceptor``)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc


class WrappingInterceptor(grpc.aio.ServerInterceptor):
    """Wraps the behaviour of every handler it passes: a unary answer with
    ``wrap_unary``, a streamed one with ``wrap_stream``, each given the method's
    full name. Methods starting with one of ``open_prefixes`` pass unwrapped;
    client-streaming handlers are wrapped only where ``client_streams`` is set."""

    open_prefixes: tuple[str, ...] = ()
    client_streams = False

    def wrap_unary(
        self, behavior: Callable[..., Any], method: str
    ) -> Callable[..., Awaitable[Any]]:
        raise NotImplementedError

    def wrap_stream(
        self, behavior: Callable[..., AsyncIterator[Any]], method: str
    ) -> Callable[..., AsyncIterator[Any]]:
        raise NotImplementedError

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method.startswith(self.open_prefixes):
            return handler
        return self.wrap(handler, method)

    def wrap(self, handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
        """The handler with its behaviour wrapped (``wrap_unary`` / ``wrap_stream``);
        an interceptor that changes more of a handler overrides this."""
        if handler.unary_unary is not None:
            return handler._replace(unary_unary=self.wrap_unary(handler.unary_unary, method))
        if handler.unary_stream is not None:
            return handler._replace(unary_stream=self.wrap_stream(handler.unary_stream, method))
        if not self.client_streams:
            return handler
        if handler.stream_unary is not None:
            return handler._replace(stream_unary=self.wrap_unary(handler.stream_unary, method))
        return handler._replace(stream_stream=self.wrap_stream(handler.stream_stream, method))
