"""Futures returned by every SDK call: ``.result(timeout)`` or ``await fut``."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Generator
from concurrent.futures import Future
from typing import Any, Generic, TypeVar

T = TypeVar("T")
U = TypeVar("U")


class APIFuture(Generic[T]):
    """A call in flight. Submitting never blocks; reading the result does."""

    def __init__(self, inner: Future[T]) -> None:
        self._inner = inner

    def result(self, timeout: float | None = None) -> T:
        return self._inner.result(timeout)

    def done(self) -> bool:
        return self._inner.done()

    def cancel(self) -> bool:
        return self._inner.cancel()

    def exception(self, timeout: float | None = None) -> BaseException | None:
        return self._inner.exception(timeout)

    def add_done_callback(self, fn: Callable[[APIFuture[T]], Any]) -> None:
        self._inner.add_done_callback(lambda _: fn(self))

    def __await__(self) -> Generator[Any, None, T]:
        return asyncio.wrap_future(self._inner).__await__()

    def then(self, fn: Callable[[T], U]) -> APIFuture[U]:
        """A future of ``fn(result)``; errors pass through."""
        out: Future[U] = Future()

        def done(f: Future[T]) -> None:
            if f.cancelled():
                out.cancel()
                return
            exc = f.exception()
            if exc is not None:
                out.set_exception(exc)
                return
            try:
                out.set_result(fn(f.result()))
            except Exception as err:
                out.set_exception(err)

        self._inner.add_done_callback(done)
        return APIFuture(out)

    @property
    def concurrent(self) -> Future[T]:
        return self._inner
