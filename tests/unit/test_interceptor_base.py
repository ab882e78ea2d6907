"""``WrappingInterceptor``: which handlers its subclasses' wrappers reach."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from treadle.server.interceptor_base import WrappingInterceptor


class _Tagging(WrappingInterceptor):
    def __init__(self, *, open_prefixes: tuple[str, ...] = (), client_streams: bool) -> None:
        self.open_prefixes = open_prefixes
        self.client_streams = client_streams
        self.wrapped: list[tuple[str, str]] = []

    def wrap_unary(
        self, behavior: Callable[..., Any], method: str
    ) -> Callable[..., Awaitable[Any]]:
        self.wrapped.append(("unary", method))
        return behavior

    def wrap_stream(
        self, behavior: Callable[..., AsyncIterator[Any]], method: str
    ) -> Callable[..., AsyncIterator[Any]]:
        self.wrapped.append(("stream", method))
        return behavior


class _Details(grpc.HandlerCallDetails):
    def __init__(self, method: str) -> None:
        self.method = method
        self.invocation_metadata = ()


def _handlers() -> dict[str, grpc.RpcMethodHandler]:
    def noop(*args: Any) -> None:
        return None

    return {
        "uu": grpc.unary_unary_rpc_method_handler(noop),
        "us": grpc.unary_stream_rpc_method_handler(noop),
        "su": grpc.stream_unary_rpc_method_handler(noop),
        "ss": grpc.stream_stream_rpc_method_handler(noop),
    }


def _pass(icpt: WrappingInterceptor, method: str, handler: grpc.RpcMethodHandler | None) -> Any:
    async def continuation(details: grpc.HandlerCallDetails) -> Any:
        return handler

    return asyncio.run(icpt.intercept_service(continuation, _Details(method)))


def test_server_answers_are_wrapped_and_client_streams_only_when_asked() -> None:
    plain = _Tagging(client_streams=False)
    for kind, handler in _handlers().items():
        assert _pass(plain, f"/S/{kind}", handler) is not None
    assert plain.wrapped == [("unary", "/S/uu"), ("stream", "/S/us")]
    every = _Tagging(client_streams=True)
    for kind, handler in _handlers().items():
        _pass(every, f"/S/{kind}", handler)
    assert [w for w, _ in every.wrapped] == ["unary", "stream", "unary", "stream"]


def test_open_methods_and_unknown_methods_pass_unwrapped() -> None:
    icpt = _Tagging(open_prefixes=("/open.Health/",), client_streams=True)
    handler = _handlers()["uu"]
    assert _pass(icpt, "/open.Health/Check", handler) is handler
    assert _pass(icpt, "/S/missing", None) is None
    assert icpt.wrapped == []
    _pass(icpt, "/S/uu", handler)
    assert icpt.wrapped == [("unary", "/S/uu")]
