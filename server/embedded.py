"""Run a server on a background thread with its own event loop: for the demo,
tests and benchmarks that drive it through the SDK from the same process."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import grpc

from treadle.server.app import create_server
from treadle.server.config import ServerConfig
from treadle.server.context import ServerContext
from treadle.server.dispatch import Dispatcher


class EmbeddedServer:
    def __init__(
        self, config: ServerConfig, dispatcher_factory: Callable[[], Dispatcher] | None = None
    ) -> None:
        self.config = config
        self._factory = dispatcher_factory
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="treadle-server", daemon=True
        )
        self.server: grpc.aio.Server | None = None
        self.ctx: ServerContext | None = None
        self.port = 0

    @property
    def address(self) -> str:
        return f"{self.config.host}:{self.port}"

    def _run(self, coro: Any, timeout: float | None = 120) -> Any:
        fut: Future[Any] = asyncio.run_coroutine_threadsafe(coro, self._loop)
        return fut.result(timeout)

    def start(self) -> EmbeddedServer:
        self._thread.start()

        async def boot() -> None:
            dispatcher = self._factory() if self._factory else None
            self.server, self.port, self.ctx = await create_server(self.config, dispatcher)
            await self.server.start()

        self._run(boot())
        return self

    def stop(self) -> None:
        if self.server is not None:
            self._run(self.server.stop(grace=1))
        if self.ctx is not None:
            self.ctx.dispatcher.close()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    def __enter__(self) -> EmbeddedServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
