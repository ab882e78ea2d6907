"""The console's pages and the few JSON answers their script polls.

Walls: every page but sign-in needs the session cookie, and every id is looked
up through the service layer with the viewer's tenant, so another tenant's run,
checkpoint or download is 404 exactly like a missing one; a malformed, forged
or expired cookie is 401 (sign in again), a forged CSRF token 403, a tenant's
key on an operator page 403. Database reads run in a worker thread.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import re
import tarfile
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import parse_qs, urlsplit

import jinja2
from fastapi import APIRouter, FastAPI
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import FileResponse, HTMLResponse, JSONResponse, RedirectResponse, Response
from starlette.staticfiles import StaticFiles

from treadle.common.store import check_name
from treadle.errors import InvalidArgumentError, NotFoundError, TreadleError, UnauthenticatedError
from treadle.server.console import views
from treadle.server.console.cookies import COOKIE, ConsoleSession, CookieSigner, load_secret
from treadle.server.context import ServerContext
from treadle.server.http import session_trace
from treadle.server.http.errors import status_of

log = logging.getLogger("treadle.server")

HERE = Path(__file__).parent
PREFIX = "/console"
#: how often a run page asks for new points (the issue: at most every 2 s)
POLL_MS = 2000
_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}$")
_FORM_BYTES = 8192

T = TypeVar("T")


class PermissionDeniedError(TreadleError):
    """A signed-in viewer asking for what its key may not do (an operator page with
    a tenant's key, a form without its CSRF token): 403."""

    code = "PERMISSION_DENIED"


#: what every console answer carries: no caching of tenant data, no framing, no
#: referrer to other sites, scripts and styles from this server only
HEADERS = {
    "Cache-Control": "no-store",
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    # same-origin: the console's own forms carry their Origin (checked on every
    # POST); nothing of a console URL leaves for another site
    "Referrer-Policy": "same-origin",
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
    ),
}


class Console:
    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx
        self.signer = CookieSigner(load_secret(ctx.config.data_dir))
        self.templates = jinja2.Environment(
            loader=jinja2.FileSystemLoader(HERE / "templates"),
            autoescape=True,
            undefined=jinja2.StrictUndefined,
        )
        self.secure = ctx.config.tls

    # ---- plumbing ---------------------------------------------------------------------

    async def off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.to_thread(fn, *args)

    def render(self, name: str, status: int = 200, **values: Any) -> HTMLResponse:
        html = self.templates.get_template(name).render(prefix=PREFIX, **values)
        return HTMLResponse(html, status_code=status, headers=HEADERS)

    def error(self, err: TreadleError, viewer: views.Viewer | None = None) -> Response:
        status = status_of(err)
        if status == 401:
            response = self.render("login.html", 401, error=err.message, viewer=None)
            response.delete_cookie(COOKIE, path=PREFIX)
            return response
        titles = {403: "Not allowed", 404: "Not found", 400: "Bad request"}
        return self.render(
            "error.html",
            status,
            viewer=viewer,
            csrf=self.signer.csrf(viewer.session) if viewer else "",
            title=titles.get(status, "Error"),
            # a 404 says nothing of what exists (the message could name an id)
            message="" if status == 404 else err.message,
        )

    async def viewer(self, request: Request) -> views.Viewer:
        session = self.signer.read(request.cookies.get(COOKIE))
        if session is None:
            raise UnauthenticatedError("sign in with an API key")
        return await self.off_loop(views.viewer, self.ctx, session)

    async def form(self, request: Request) -> dict[str, str]:
        """A POSTed form; 403 when the browser says it comes from another site
        (``Origin``; "null" for a cross-site form under our referrer policy): sign-in
        included, which no CSRF token can guard."""
        origin = request.headers.get("origin")
        if origin is not None and urlsplit(origin).netloc != request.headers.get("host", ""):
            raise PermissionDeniedError("the form was sent from another site")
        body = await request.body()
        if len(body) > _FORM_BYTES:
            raise InvalidArgumentError("form: too large")
        try:
            fields = parse_qs(body.decode(), max_num_fields=8, strict_parsing=False)
        except (UnicodeDecodeError, ValueError):
            raise InvalidArgumentError("form: not a form") from None
        return {k: v[0] for k, v in fields.items() if v}

    def check_csrf(self, viewer: views.Viewer, form: dict[str, str]) -> None:
        if not self.signer.check_csrf(viewer.session, form.get("csrf")):
            raise PermissionDeniedError(
                "the form's CSRF token is missing or wrong; reload the page"
            )

    def set_cookie(self, response: Response, value: str, session: ConsoleSession) -> None:
        response.set_cookie(
            COOKIE,
            value,
            max_age=session.cookie_max_age,
            path=PREFIX,
            httponly=True,
            samesite="strict",
            secure=self.secure,
        )

    async def page(
        self, request: Request, build: Callable[[views.Viewer], Awaitable[Response]]
    ) -> Response:
        """A signed-in answer; errors as pages with their status."""
        viewer: views.Viewer | None = None
        try:
            viewer = await self.viewer(request)
            return await build(viewer)
        except TreadleError as err:
            return self.error(err, viewer)


def _id(value: str) -> str:
    """A model id as the console takes it; anything else (``..``) is a missing run."""
    if not _ID.match(value) or ".." in value:
        raise NotFoundError("not found")
    return value


def _name(value: str) -> str:
    try:
        return check_name(value)
    except InvalidArgumentError:
        raise NotFoundError("not found") from None


def _tar(directory: Path, name: str) -> Path:
    fd, tmp = tempfile.mkstemp(prefix="treadle-console-", suffix=".tar")
    with os.fdopen(fd, "wb") as f, tarfile.open(fileobj=f, mode="w") as tar:
        tar.add(directory, arcname=name)
    return Path(tmp)


def install(app: FastAPI, ctx: ServerContext) -> None:
    """Mount the console on the HTTP app: its pages and its static files."""
    console = Console(ctx)
    app.mount(f"{PREFIX}/static", StaticFiles(directory=HERE / "static"), name="console-static")
    app.include_router(router(console))


def router(c: Console) -> APIRouter:
    r = APIRouter(prefix=PREFIX, include_in_schema=False)
    ctx = c.ctx

    @r.get("")
    @r.get("/")
    async def home() -> Response:
        return RedirectResponse(f"{PREFIX}/runs", status_code=303, headers=HEADERS)

    @r.get("/login")
    async def login_page(request: Request) -> Response:
        return c.render("login.html", error="", viewer=None)

    @r.post("/login")
    async def login(request: Request) -> Response:
        try:
            form = await c.form(request)
            tenant_id, key_id = await c.off_loop(views.sign_in, ctx, form.get("api_key", ""))
        except TreadleError as err:
            if status_of(err) != 401:
                response = c.error(err)
                response.delete_cookie(COOKIE, path=PREFIX)
                return response
            log.info("console: a sign-in was refused")  # never the key
            return c.render("login.html", 401, error="That API key is not valid.", viewer=None)
        value, session = c.signer.issue(tenant_id, key_id)
        response = RedirectResponse(f"{PREFIX}/runs", status_code=303, headers=HEADERS)
        c.set_cookie(response, value, session)
        return response

    @r.post("/logout")
    async def logout(request: Request) -> Response:
        async def build(v: views.Viewer) -> Response:
            c.check_csrf(v, await c.form(request))
            response = RedirectResponse(f"{PREFIX}/login", status_code=303, headers=HEADERS)
            response.delete_cookie(COOKIE, path=PREFIX)
            return response

        return await c.page(request, build)

    @r.get("/runs")
    async def runs(request: Request) -> Response:
        async def build(v: views.Viewer) -> Response:
            rows = await c.off_loop(views.runs, ctx, v.tenant_id)
            return c.render("runs.html", viewer=v, csrf=c.signer.csrf(v.session), runs=rows)

        return await c.page(request, build)

    @r.get("/runs/{model_id}")
    async def run(request: Request, model_id: str) -> Response:
        async def build(v: views.Viewer) -> Response:
            data = await c.off_loop(views.run, ctx, v.tenant_id, _id(model_id))
            usage = ctx.service.runs.usage(v.tenant_id, model_id)  # on the loop: exact
            return c.render(
                "run.html",
                viewer=v,
                csrf=c.signer.csrf(v.session),
                run=data,
                usage=usage,
                poll_ms=POLL_MS,
            )

        return await c.page(request, build)

    @r.get("/runs/{model_id}/curves")
    async def curves(request: Request, model_id: str) -> Response:
        async def build(v: views.Viewer) -> Response:
            data = await c.off_loop(views.curves, ctx, v.tenant_id, _id(model_id))
            return JSONResponse(data, headers=HEADERS)

        return await c.page(request, build)

    @r.get("/runs/{model_id}/usage")
    async def usage(request: Request, model_id: str) -> Response:
        async def build(v: views.Viewer) -> Response:
            u = ctx.service.runs.usage(v.tenant_id, _id(model_id))
            return JSONResponse(dataclasses.asdict(u), headers=HEADERS)

        return await c.page(request, build)

    @r.get("/runs/{model_id}/checkpoints/{name}/delete")
    async def confirm_delete(request: Request, model_id: str, name: str) -> Response:
        async def build(v: views.Viewer) -> Response:
            ckpt = await c.off_loop(views.checkpoint, ctx, v.tenant_id, _id(model_id), _name(name))
            return c.render(
                "confirm_delete.html",
                viewer=v,
                csrf=c.signer.csrf(v.session),
                model_id=model_id,
                checkpoint=views.checkpoint_row(ckpt),
            )

        return await c.page(request, build)

    @r.post("/runs/{model_id}/checkpoints/{name}/delete")
    async def delete(request: Request, model_id: str, name: str) -> Response:
        async def build(v: views.Viewer) -> Response:
            c.check_csrf(v, await c.form(request))
            ckpt = await c.off_loop(views.checkpoint, ctx, v.tenant_id, _id(model_id), _name(name))
            await c.off_loop(ctx.service.checkpoints.delete, v.tenant_id, ckpt.path)
            log.info("console: tenant %s deleted checkpoint %s", v.tenant_name, ckpt.path)
            return RedirectResponse(f"{PREFIX}/runs/{model_id}", status_code=303, headers=HEADERS)

        return await c.page(request, build)

    @r.get("/runs/{model_id}/checkpoints/{name}/download")
    async def download(request: Request, model_id: str, name: str) -> Response:
        async def build(v: views.Viewer) -> Response:
            ckpt = await c.off_loop(views.checkpoint, ctx, v.tenant_id, _id(model_id), _name(name))

            def archive() -> Path:
                with ctx.sessions() as s:
                    storage = ctx.service.checkpoints.resolve(s, v.tenant_id, ckpt.path, "path")
                local = ctx.store.fetch(storage)
                try:
                    return _tar(local, f"{model_id}-{name}")
                finally:
                    ctx.store.release(local, storage)

            tar = await c.off_loop(archive)
            return FileResponse(
                tar,
                media_type="application/x-tar",
                filename=f"{model_id}-{name}.tar",
                headers=HEADERS,
                background=BackgroundTask(tar.unlink, missing_ok=True),
            )

        return await c.page(request, build)

    @r.get("/sessions/{session_id}/trace")
    async def session_trace_download(request: Request, session_id: str) -> Response:
        """The session's trace (as the tinker SDK's export_session_trace gives it):
        its runs' calls as slices and their metrics as counters, for Perfetto."""

        async def build(v: views.Viewer) -> Response:
            def make() -> dict[str, Any]:
                timeline = ctx.service.sessions.timeline(v.tenant_id, _id(session_id))
                points = ctx.service.runs.metric_points([m for m, _ in timeline.models])
                return session_trace.trace(timeline, points)

            data = await c.off_loop(make)
            disposition = f'attachment; filename="{session_id}.trace.json"'
            return JSONResponse(data, headers={**HEADERS, "Content-Disposition": disposition})

        return await c.page(request, build)

    @r.get("/operator")
    async def operator(request: Request) -> Response:
        async def build(v: views.Viewer) -> Response:
            if not v.operator:
                raise PermissionDeniedError("the operator pages need the admin tenant's key")
            data = await c.off_loop(views.operator, ctx)
            return c.render("operator.html", viewer=v, csrf=c.signer.csrf(v.session), **data)

        return await c.page(request, build)

    return r
