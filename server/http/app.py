"""The HTTP app (FastAPI) and its server (uvicorn), run in the event loop of the
gRPC server so both transports share one service layer, one engine and one
database, with no thread between them.

``start_http(ctx, host, port)`` binds (port 0: any free port, for tests) and
returns a handle with the bound port; ``await handle.stop()`` at shutdown.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass

import uvicorn
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from sqlalchemy.exc import DBAPIError
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from treadle.errors import InvalidArgumentError, TreadleError
from treadle.server.console.routes import install as install_console
from treadle.server.context import ServerContext
from treadle.server.http import (
    errors,
    routes_checkpoints,
    routes_futures,
    routes_sampling,
    routes_session,
    routes_training,
    routes_weights,
)
from treadle.server.http.names import Names
from treadle.server.http.state import HttpState

log = logging.getLogger("treadle.server")


def create_app(ctx: ServerContext) -> FastAPI:
    app = FastAPI(title="treadle tinker-compatible API", docs_url=None, redoc_url=None)
    app.state.ctx = ctx
    app.state.http = HttpState(ctx, names=Names(ctx.session))
    app.state.instance_id = ctx.instance_id
    for module in (
        routes_session,
        routes_training,
        routes_sampling,
        routes_weights,
        routes_checkpoints,
        routes_futures,
    ):
        app.include_router(module.router)
    app.add_exception_handler(TreadleError, errors.treadle_error_handler)
    app.add_exception_handler(DBAPIError, errors.treadle_error_handler)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_middleware(BodyLimit, limit=ctx.config.max_message_bytes)
    install_console(app, ctx)  # the web console (/console)
    app.add_middleware(ServerTiming)
    return app


async def _validation_error(request: Request, err: Exception) -> JSONResponse:
    assert isinstance(err, RequestValidationError)
    where = ".".join(str(p) for p in err.errors()[0].get("loc", ())) if err.errors() else "body"
    return errors.error_response(InvalidArgumentError(f"{where}: {err.errors()[0].get('msg')}"))


class ServerTiming:
    """``Server-Timing: app;dur=<ms>`` on every answer: the time the app took from
    the request's arrival to its answer's headers (a held ``retrieve_future``
    included), so a client can tell the server's share of a call from the
    transport's."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()

        async def timed(message: Message) -> None:
            if message["type"] == "http.response.start":
                dur = (time.perf_counter() - t0) * 1e3
                headers = list(message.get("headers") or [])
                headers.append((b"server-timing", f"app;dur={dur:.3f}".encode()))
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, timed)


class BodyLimit:
    """413 for a request body over the server's message limit (the gRPC one),
    counted as it arrives, before any of it is parsed."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            await self._too_large(scope, receive, send)
            return
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.limit:
                raise _TooLarge
            return message

        try:
            await self.app(scope, counted, send)
        except _TooLarge:
            await self._too_large(scope, receive, send)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        err = errors.PayloadTooLargeError(
            f"body: over the server's limit of {self.limit} bytes (--max-message-bytes)"
        )
        await errors.error_response(err)(scope, receive, send)


class _TooLarge(Exception):
    pass


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield  # the treadle process owns its signals (graceful drain), not uvicorn


@dataclass
class HttpServer:
    server: uvicorn.Server
    task: asyncio.Task[None]
    port: int
    state: HttpState

    async def stop(self) -> None:
        self.state.futures.close()  # held retrieve_future calls answer at once
        self.server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await self.task


def _check_free(host: str, port: int) -> None:
    """A taken port is one line naming the flag, not uvicorn's traceback."""
    if port == 0:
        return
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(address)
    except OSError as err:
        raise InvalidArgumentError(
            f"--http-port: the HTTP API cannot listen on {host}:{port} ({err.strerror or err}); "
            "pass --http-port with a free port (0: any), or -1 for no HTTP API"
        ) from None


async def start_http(ctx: ServerContext, host: str, port: int) -> HttpServer:
    _check_free(host, port)
    app = create_app(ctx)
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        loop="none",
        lifespan="off",
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=2,
        timeout_keep_alive=75,
        # the gRPC port's certificate, when it has one: keys never travel in the clear
        ssl_certfile=str(ctx.config.tls_cert) if ctx.config.tls_cert else None,
        ssl_keyfile=str(ctx.config.tls_key) if ctx.config.tls_key else None,
    )
    server = _Server(config)
    task = asyncio.ensure_future(server.serve())
    while not server.started:
        if task.done():
            task.result()  # the bind failed: raise it
            raise OSError(f"could not bind the HTTP API to {host}:{port}")
        await asyncio.sleep(0.01)
    bound = server.servers[0].sockets[0].getsockname()[1]
    scheme = "https" if ctx.config.tls else "http"
    log.info("tinker-compatible HTTP API on %s://%s:%d/api/v1", scheme, host, bound)
    log.info("web console on %s://%s:%d/console", scheme, host, bound)
    return HttpServer(server, task, int(bound), app.state.http)
