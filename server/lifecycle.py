"""Idle models: TTL unloading and transparent restore.

A loaded model whose TTL passes with no call and no heartbeat of the client
session it was created in is checkpointed (the ``auto`` checkpoint, kind
``auto``) and freed from the engine; its row says ``unloaded``. Nothing is lost:
the next call on it (or ``RestoreModel``) loads it back from that checkpoint at
the same ``seq_id``, so the client carries on as if nothing happened. A model
that is not idle (a call in flight, or gradients accumulated for a step not yet
taken) is never unloaded.

Every model-bound call runs inside ``using(tenant, model_id)``, which restores
the model if need be, counts the call in flight, and resets the idle clock.
Transitions (unload, restore) of one model never overlap: a call that arrives
during an unload waits for it, then restores.

The same unload moves models off a worker that is stopping gracefully
(``treadle worker`` on SIGTERM: ``draining``): each is unloaded at its first
idle moment, whatever its TTL, and its next call restores it on another
worker at the same ``seq_id``. A model holding gradients of a step not yet
taken is refused by its engine and tried again later; the draining worker
serves its calls meanwhile, so the step can finish.

And the embedded server's own graceful stop (``shutdown``: ``treadle serve`` on
SIGTERM/SIGINT), whose engine stops with it: it keeps serving while it unloads
every model at its first idle moment, for at most its drain timeout, then stops
serving and unloads what is left with ``force``: what is applied is
checkpointed (a model holding gradients at the seq_id before they started), so
a planned restart loses nothing a client was told was done, except the
gradients of a step not taken by then (``docs/restarts.md``).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import TYPE_CHECKING, Any

from sqlalchemy import select

from treadle.common.db import models as db
from treadle.common.engine.messages import CreateModelCall, UnloadModelCall
from treadle.common.store import state_uri, storage_path_str
from treadle.errors import NotFoundError, TreadleError, UnavailableError
from treadle.server.db import queries
from treadle.server.restarts import RestorePoint
from treadle.server.rpc import convert

if TYPE_CHECKING:
    from treadle.server.context import ServerContext

log = logging.getLogger("treadle.server")

#: The checkpoint name an unload writes (shared with the auto-checkpoint policy).
AUTO_NAME = "auto"
#: how often models on draining workers are looked at, and how long one whose
#: engine refused to let go (gradients held, calls waiting) is left before a retry
DRAIN_POLL_S = 0.2
#: how often the background task looks for checkpoints past their TTL
EXPIRY_POLL_S = 30.0
DRAIN_RETRY_S = 1.0


class ModelLifecycle:
    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx
        #: model_id -> unix time of the last call that started or ended
        self.last_used: dict[str, float] = {}
        self.inflight: dict[str, int] = {}
        self._transitions: dict[str, asyncio.Task[bool]] = {}
        self._sweeper: asyncio.Task[None] | None = None
        self._mover: asyncio.Task[None] | None = None
        self._refused: dict[str, float] = {}  # model_id -> when its engine last refused
        #: the server is stopping (``shutdown``): no model is loaded back any more
        self.stopping = False

    # ---- calls -----------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def using(self, tenant: str, model_id: str) -> AsyncIterator[None]:
        """The tenant's model, loaded, counted in flight for the duration."""
        await self._ensure_loaded(tenant, model_id)
        # No await between the check above and this count: the sweeper cannot slip in.
        self.inflight[model_id] = self.inflight.get(model_id, 0) + 1
        self.last_used[model_id] = time.time()
        try:
            yield
        finally:
            left = self.inflight.get(model_id, 1) - 1
            if left > 0:
                self.inflight[model_id] = left
            else:
                self.inflight.pop(model_id, None)
            self.last_used[model_id] = time.time()

    def touch(self, model_id: str) -> None:
        """Start (or restart) a model's idle clock, e.g. when it is created."""
        self.last_used[model_id] = time.time()

    def forget(self, model_id: str) -> None:
        self.last_used.pop(model_id, None)
        self.inflight.pop(model_id, None)
        self._refused.pop(model_id, None)
        self.ctx.restored.pop(model_id, None)

    async def wait_idle_transition(self, model_id: str) -> None:
        """Wait for an unload or restore of the model in progress, if any."""
        task = self._transitions.get(model_id)
        if task is not None:
            with contextlib.suppress(Exception):
                await asyncio.shield(task)

    async def _ensure_loaded(self, tenant: str, model_id: str) -> None:
        while True:
            owner = self.ctx.owners.get(model_id)
            if owner is not None:
                if owner != tenant:
                    raise NotFoundError(f"model {model_id!r} not found")
                return
            task = self._transitions.get(model_id)
            if task is None and self.stopping:  # it was checkpointed for the restart
                raise UnavailableError(
                    f"the server is stopping; model {model_id} is checkpointed and comes "
                    "back on the restarted server (retry)"
                )
            if task is None:
                task = self._start(model_id, self._restore(tenant, model_id))
                await asyncio.shield(task)  # a restore's errors are the caller's
                continue
            with contextlib.suppress(Exception):
                await asyncio.shield(task)  # someone else's unload or restore

    def _start(self, model_id: str, coro: Coroutine[Any, Any, bool]) -> asyncio.Task[bool]:
        task = asyncio.ensure_future(coro)
        self._transitions[model_id] = task
        task.add_done_callback(lambda _: self._transitions.pop(model_id, None))
        return task

    # ---- restore ---------------------------------------------------------------

    async def _restore(self, tenant: str, model_id: str) -> bool:
        ctx = self.ctx
        with ctx.session() as s:
            row = queries.get_model(s, tenant, model_id)
            if row is None or row.status != "unloaded":
                raise NotFoundError(f"model {model_id!r} not found")
            ckpt = row.last_checkpoint
            if ckpt is None:  # an unload always records its checkpoint; never guess
                raise NotFoundError(f"model {model_id!r} not found")
            spec = convert.model_spec(row)
            path, seq_id, uri = ckpt.storage_path, ckpt.seq_id, ckpt.uri
        status = await ctx.dispatcher.call(
            CreateModelCall(spec, storage_path_str(path) if path else None, seq_id + 1)
        )
        with ctx.session() as s:
            queries.set_model_status(s, model_id, "active", version=status.version)
        ctx.owners[model_id] = tenant
        ctx.restored[model_id] = RestorePoint(seq_id, status.version, uri)
        self.last_used[model_id] = time.time()
        log.info("restored model %s at seq_id %d", model_id, seq_id)
        return True

    # ---- unload ----------------------------------------------------------------

    def idle_models(self, now: float | None = None) -> list[str]:
        """Loaded models past their TTL: no call and no session heartbeat since."""
        ttl = self.ctx.config.model_ttl_s
        if not ttl:
            return []
        now = time.time() if now is None else now
        candidates = []
        for model_id in list(self.ctx.owners):
            last = self.last_used.setdefault(model_id, now)
            if (
                now - last >= ttl
                and not self.inflight.get(model_id)
                and model_id not in self._transitions
            ):
                candidates.append(model_id)
        if not candidates:
            return []
        with self.ctx.session() as s:
            rows = s.execute(
                select(db.Model.id, db.ClientSession.last_heartbeat_at)
                .join(db.ClientSession, db.Model.session_id == db.ClientSession.id)
                .where(db.Model.id.in_(candidates), db.ClientSession.ended_at.is_(None))
            ).all()
        beating = {m for m, beat in rows if now - beat.timestamp() < ttl}
        return [m for m in candidates if m not in beating]

    def expire_checkpoints(self, now: float | None = None) -> list[str]:
        """Delete the checkpoints past their TTL (``set_checkpoint_ttl``); the paths deleted."""
        when = None if now is None else dt.datetime.fromtimestamp(now, dt.timezone.utc)
        return self.ctx.service.checkpoints.expire(when)

    async def sweep(self, now: float | None = None) -> list[str]:
        """Unload every idle model (and delete expired checkpoints); the ids unloaded."""
        self.expire_checkpoints(now)
        unloaded = []
        for model_id in self.idle_models(now):
            # Re-checked after each await: a call may have arrived meanwhile.
            if (
                model_id not in self.ctx.owners
                or self.inflight.get(model_id)
                or model_id in self._transitions
            ):
                continue
            if await self._start(model_id, self._unload(model_id)):
                unloaded.append(model_id)
        return unloaded

    async def _unload(self, model_id: str, force: bool = False) -> bool:
        ctx = self.ctx
        tenant = ctx.owners.pop(model_id)
        # The dispatcher writes the checkpoint into the store (uploading it if remote).
        storage_path = ctx.store.state_path(tenant, model_id, AUTO_NAME)
        try:
            saved = await ctx.dispatcher.call(
                UnloadModelCall(model_id, storage_path_str(storage_path), force=force)
            )
        except TreadleError as err:  # not idle after all (or lost, not in the engine): leave it be
            log.info("model %s not unloaded: %s", model_id, err)
            ctx.owners[model_id] = tenant
            self.last_used[model_id] = time.time()
            return False
        try:
            with ctx.session() as s:
                ckpt = queries.put_checkpoint(
                    s,
                    tenant_id=tenant,
                    model_id=model_id,
                    name=AUTO_NAME,
                    uri=state_uri(model_id, AUTO_NAME),
                    storage_path=storage_path,
                    seq_id=saved.seq_id,
                    step=saved.step,
                    kind="auto",
                    size_bytes=saved.size_bytes,
                )
                queries.update_model_progress(s, model_id, version=saved.step, last_checkpoint=ckpt)
                queries.set_model_status(s, model_id, "unloaded")
        except Exception:
            # The engine let go but the database does not know: load it back at once.
            log.exception("model %s: could not record its unload; loading it back", model_id)
            await _reload(ctx, tenant, model_id, storage_path, saved.seq_id)
            return False
        self.forget(model_id)
        log.info(
            "unloaded idle model %s at seq_id %d (checkpoint %s)",
            model_id,
            saved.seq_id,
            state_uri(model_id, AUTO_NAME),
        )
        return True

    # ---- models on draining workers ---------------------------------------------

    async def move_draining(self, now: float | None = None) -> list[str]:
        """Unload this server's models on draining workers that are idle now; the
        ids moved. Each comes back on another worker at its next call."""
        now = time.time() if now is None else now
        moved = []
        for model_id in sorted(self.ctx.draining.draining_models()):
            if (
                model_id not in self.ctx.owners
                or self.inflight.get(model_id)
                or model_id in self._transitions
                or now - self._refused.get(model_id, -math.inf) < DRAIN_RETRY_S
            ):
                continue
            if await self._start(model_id, self._unload(model_id)):
                self._refused.pop(model_id, None)
                moved.append(model_id)
            else:
                self._refused[model_id] = time.time()
        return moved

    # ---- the server's own graceful stop --------------------------------------------

    async def shutdown(
        self, timeout_s: float, stop_serving: Callable[[], Awaitable[None]]
    ) -> tuple[list[str], list[str]]:
        """Checkpoint every loaded model before the server stops; the ids unloaded
        idle, and those unloaded with ``force`` after ``timeout_s``.

        The server keeps serving meanwhile (a ``forward_backward``'s
        ``optim_step`` still lands), but loads no model back: a call on one
        already checkpointed answers UNAVAILABLE, which the SDK retries until
        the restarted server answers it at the same ``seq_id``.
        ``stop_serving`` ends the gRPC service before the forced unloads.
        A distributed server's workers keep their models: nothing to do."""
        await self.stop()
        self.stopping = True
        if not self.ctx.dispatcher.engine_in_process:
            await stop_serving()
            return [], []
        idle: list[str] = []
        deadline = time.monotonic() + timeout_s
        while self.ctx.owners and time.monotonic() < deadline:
            for model_id in sorted(self.ctx.owners):
                if self.inflight.get(model_id) or model_id in self._transitions:
                    continue
                if await self._start(model_id, self._unload(model_id)):
                    idle.append(model_id)
            if self.ctx.owners:
                await asyncio.sleep(DRAIN_POLL_S)
        await stop_serving()
        forced = []
        for model_id in sorted(self.ctx.owners):
            await self.wait_idle_transition(model_id)
            if model_id in self.ctx.owners and await self._start(
                model_id, self._unload(model_id, force=True)
            ):
                forced.append(model_id)
        return idle, forced

    # ---- the background tasks ----------------------------------------------------

    def start(self) -> None:
        if self.ctx.config.model_ttl_s and self._sweeper is None:
            self._sweeper = asyncio.ensure_future(self._run())
        if self._mover is None:
            self._mover = asyncio.ensure_future(self._move())

    async def stop(self) -> None:
        tasks = [t for t in (self._sweeper, self._mover) if t is not None]
        self._sweeper = self._mover = None
        for task in tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _expire_logged(self) -> None:
        try:
            expired = self.expire_checkpoints()
        except Exception:
            log.exception("deleting expired checkpoints failed")
            return
        if expired:
            log.info("deleted expired checkpoints: %s", ", ".join(expired))

    async def _move(self) -> None:
        last_expiry = -math.inf
        while True:
            await asyncio.sleep(DRAIN_POLL_S)
            if time.monotonic() - last_expiry >= EXPIRY_POLL_S:
                last_expiry = time.monotonic()
                await self._expire_logged()
            if not self.ctx.draining.draining_models():
                continue
            try:
                moved = await self.move_draining()
            except Exception:
                log.exception("moving models off draining workers failed")
                continue
            if moved:
                log.info("moved off draining workers: %s", ", ".join(moved))

    async def _run(self) -> None:
        interval = self.ctx.config.sweep_interval_s
        while True:
            await asyncio.sleep(interval)
            try:
                await self.sweep()
            except Exception:
                log.exception("idle-model sweep failed")


async def _reload(
    ctx: ServerContext, tenant: str, model_id: str, storage_path: str, seq_id: int
) -> None:
    with ctx.session() as s:
        row = s.get(db.Model, model_id)
        assert row is not None
        spec = convert.model_spec(row)
    await ctx.dispatcher.call(CreateModelCall(spec, storage_path_str(storage_path), seq_id + 1))
    ctx.owners[model_id] = tenant
