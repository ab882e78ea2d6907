"""Run a server on a background thread with its own event loop: for the demo,
tests and benchmarks that drive it through the SDK from the same process."""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import grpc

from treadle.errors import InvalidArgumentError
from treadle.server.app import create_server, prepare_process
from treadle.server.auth import check_key
from treadle.server.config import ServerConfig
from treadle.server.context import ServerContext
from treadle.server.dispatch import Backend


class EmbeddedServer:
    """The server in this process. Its default tenant's key is ``.api_key``: on a
    fresh data directory that is env ``TREADLE_API_KEY`` when it holds a valid key
    (so a client in this process that reads the variable just works), else a new
    random key, which is then put in ``TREADLE_API_KEY`` if that is unset."""

    def __init__(
        self, config: ServerConfig, dispatcher_factory: Callable[[], Backend] | None = None
    ) -> None:
        env_key = os.environ.get("TREADLE_API_KEY", "")
        if config.auth and not config.bootstrap_api_key and env_key:
            with contextlib.suppress(InvalidArgumentError):  # not ours: a random key then
                config = config.with_(bootstrap_api_key=check_key(env_key))
        self.config = config
        if dispatcher_factory is None:
            prepare_process(config)
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

    @property
    def http_url(self) -> str | None:
        """The base URL of the tinker-compatible HTTP API (TINKER_BASE_URL), if served."""
        http = self.ctx.http if self.ctx is not None else None
        scheme = "https" if self.config.tls else "http"
        return f"{scheme}://{self.config.host}:{http.port}" if http is not None else None

    @property
    def api_key(self) -> str | None:
        """The default tenant's API key (None with auth off, or when its key file
        was removed or the key revoked)."""
        key = self.ctx.default_key if self.ctx is not None else None
        return key.key if key is not None else None

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
        if self.api_key and not os.environ.get("TREADLE_API_KEY"):
            os.environ["TREADLE_API_KEY"] = self.api_key
        return self

    def flush_records(self) -> None:
        """Write now what the server writes behind its answers, every few seconds
        (the ends of calls, then the step metrics and usage they add): on the
        server's loop, which owns those queues and runs their timed flushes, so a
        flush from here never finds a queue taken by one still writing."""

        async def flush() -> None:
            if self.ctx is None:
                return
            self.ctx.service.op_endings.flush()
            if self.ctx.step_metrics is not None:
                self.ctx.step_metrics.flush()
            if self.ctx.usage is not None:
                self.ctx.usage.flush()

        self._run(flush())

    def stop(self, *, checkpoint: bool = False) -> None:
        """Stop the server. By default as a crash would, for the engine's state (the
        models come back at their last checkpoint); ``checkpoint=True`` stops as
        ``treadle serve`` does on SIGTERM, checkpointing every model first."""
        if checkpoint and self.server is not None and self.ctx is not None:
            from treadle.server.cli import graceful_stop

            server = self.server
            self._run(graceful_stop(server, self.ctx), timeout=None)
        else:
            if self.ctx is not None:
                self._run(self.ctx.lifecycle.stop())
            if self.ctx is not None and self.ctx.http is not None:
                self._run(self.ctx.http.stop())
            if self.server is not None:
                self._run(self.server.stop(grace=1))
            if self.ctx is not None:
                self._run(self.ctx.service.op_endings.close())  # they count usage
            if self.ctx is not None and self.ctx.usage is not None:
                self._run(self.ctx.usage.close())
            if self.ctx is not None and self.ctx.step_metrics is not None:
                self._run(self.ctx.step_metrics.close())
            if self.ctx is not None:
                self.ctx.dispatcher.close()
                if self.ctx.metrics is not None:
                    self.ctx.metrics.close()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    def __enter__(self) -> EmbeddedServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
