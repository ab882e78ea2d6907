"""``WrappingInterceptor``: which handlers its subclasses' wrappers reach."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import pytest

from treadle.errors import NotFoundError
from treadle.server.rpc.interceptor_base import WrappingInterceptor
from treadle.server.rpc.interceptors import ErrorInterceptor
from treadle.wire.metadata import INSTANCE_KEY


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


class _Context:
    """What the error interceptor uses of a servicer context."""

    def __init__(self) -> None:
        self.aborted: tuple[grpc.StatusCode, str] | None = None
        self.trailers: Any = None

    async def abort(self, code: grpc.StatusCode, details: str = "", trailers: Any = ()) -> None:
        self.aborted = (code, details)
        raise grpc.aio.AbortError()

    def set_trailing_metadata(self, trailers: Any) -> None:
        self.trailers = trailers


@pytest.mark.parametrize("streamed", [False, True])
def test_error_interceptor_answers_each_kind_of_failure(streamed: bool) -> None:
    icpt = ErrorInterceptor("inst-1")
    mine = grpc.aio.AbortError()
    cases = [
        (NotFoundError("model m not found"), (grpc.StatusCode.NOT_FOUND, "model m not found")),
        (ValueError("boom"), (grpc.StatusCode.INTERNAL, "ValueError: boom")),
        (mine, None),  # an abort under way passes on as it is
    ]

    def failing(err: Exception) -> Callable[..., Any]:
        if streamed:

            async def stream(request: Any, context: Any) -> AsyncIterator[int]:
                yield 1
                raise err

            return icpt.wrap_stream(stream, "/S/m")

        async def unary(request: Any, context: Any) -> int:
            raise err

        return icpt.wrap_unary(unary, "/S/m")

    async def call(behavior: Callable[..., Any], ctx: _Context) -> None:
        if streamed:
            async for _ in behavior(None, ctx):
                pass
        else:
            await behavior(None, ctx)

    for err, answer in cases:
        ctx = _Context()
        with pytest.raises(grpc.aio.AbortError) as raised:
            asyncio.run(call(failing(err), ctx))
        assert ctx.aborted == answer
        assert (raised.value is mine) == (answer is None)
        assert ctx.trailers is None  # no success stamp on a failure


def test_error_interceptor_stamps_a_success_with_the_instance() -> None:
    async def unary(request: Any, context: Any) -> int:
        return 7

    ctx = _Context()
    assert asyncio.run(ErrorInterceptor("inst-1").wrap_unary(unary, "/S/m")(None, ctx)) == 7
    assert ctx.trailers == ((INSTANCE_KEY, "inst-1"),) and ctx.aborted is None
