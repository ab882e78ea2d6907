"""The sampler pool of a distributed server: sampler workers apart from trainers.

A worker started with ``--role sampler`` serves samplers only. Where a model's
samplers sample is the server's ``--sampler-placement``: ``colocated`` (on the
model's trainer worker, as an embedded server does), ``pool`` (on the sampler
workers serving its base) or ``auto`` (the pool when a sampler worker serves
the base, else colocated); a sampler may choose its own at creation
(``SamplerTarget.placement``), which wins (the rule: ``server.sampler_placement``).

Weights shipped per version. A model's trainer writes a published version once
to the store (``ShipVersionCall``: safetensors, a LoRA adapter's few MB or a
full fine-tune's whole weights); each sampler worker reads it
(``LoadVersionCall``) and acknowledges. ``sync_weights`` publishes the new
version to every pool worker of the base and returns once one serves it; a
version that cannot be shipped (store unreachable) fails ``sync_weights``
UNAVAILABLE and the pool keeps serving the versions it had. A pool worker that
missed a publish (started later) loads the version on the first request for it.
A model rewound by ``load_state`` publishes its version numbers again with other
weights: the files shipped from that step on are dropped (``rewound``), so the
next sync ships the loaded weights, and a pool worker's ``latest`` is the version
last published to it as latest (``LoadVersionCall.latest``), not the highest.

Routing. A sample goes straight to the pool worker with the fewest calls in
flight (a request, with its G samples, stays on one worker, so its prefill is
shared), once that worker serves the version it reads; a ``latest`` sampler
reads the worker's latest version, and a ``sync_weights(inflight=True)`` moves
its running sequences to the new version there, as on a trainer. Every token's
version is the one that wrote it. A pool worker that dies fails its in-flight samples UNAVAILABLE
(the liveness watchdog; the SDK retries them, and they land on another); with
no pool worker left a sampler falls back to its model's worker under ``auto``,
and answers UNAVAILABLE naming the base under ``pool``.

Partial rollouts. A pool worker keeps the partial rollouts it sampled (stopped by
a ``token_budget``); the server notes which worker answered each resume handle
(``KeptPartials``) and sends a resume there, once that worker serves the version
the resuming sampler reads (``route_resume``).
"""

from __future__ import annotations

import asyncio
import logging
import random
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any, TypeVar

from sqlalchemy.orm import Session, sessionmaker

from treadle.common.db import models as db
from treadle.common.engine.domain import SamplerTarget
from treadle.common.engine.messages import (
    CheckTargetCall,
    DeleteModelCall,
    EngineCall,
    LoadVersionCall,
    ShipVersionCall,
)
from treadle.common.store import Store
from treadle.errors import NotFoundError, TreadleError, UnavailableError
from treadle.server.celery.placement import Placement
from treadle.server.celery.pool_partials import KeptPartials
from treadle.server.sampler_placement import samples_on_pool

log = logging.getLogger("treadle.server")
R = TypeVar("R")

Call = Callable[[str, EngineCall[Any]], Awaitable[Any]]


class SamplerPool:
    def __init__(
        self,
        placement: Placement,
        call: Call,
        load_of: Callable[[], dict[str, int]],
        sessions: sessionmaker[Session],
        store: Store | None,
        mode: str = "auto",
        keep_versions: int = 4,
    ) -> None:
        self.placement = placement
        self._call = call
        self._load_of = load_of  # calls in flight per worker (the transport's)
        self.sessions = sessions
        self.store = store
        self.mode = mode
        self.keep_versions = max(1, keep_versions)
        #: model -> the version its ``latest`` samplers read on the pool
        self._latest: dict[str, int] = {}
        #: model -> version -> the storage path it was shipped to (oldest first)
        self._shipped: dict[str, OrderedDict[int, str]] = {}
        #: (worker, model, version, path) each pool worker acknowledged
        self._served: set[tuple[str, str, int, str]] = set()
        #: (worker, model) -> the version acknowledged as the model's latest there
        self._latest_on: dict[tuple[str, str], int] = {}
        self._shipping: dict[tuple[str, int], asyncio.Lock] = {}
        #: models with a sampler that chose the pool (or auto) itself: their versions
        #: are published to the pool whatever the server's placement
        self._chosen: set[str] = set()
        #: which pool worker keeps each partial rollout sampled there
        self.partials = KeptPartials()

    # ---- which workers -------------------------------------------------------------------

    def workers(self, base_model: str) -> list[str]:
        """Live sampler workers serving ``base_model``, fewest calls in flight first."""
        p = self.placement
        with p.lock:
            live = [
                w.worker_id for w in p.live if w.role == "sampler" and base_model in w.base_models
            ]
        live = [w for w in live if not p.is_gone(w)]
        load = self._load_of()
        return sorted(live, key=lambda w: (load.get(w, 0), random.random()))

    def _any_sampler_worker(self) -> bool:
        with self.placement.lock:
            return any(w.role == "sampler" for w in self.placement.live)

    def places(self, base_model: str, chosen: str = "") -> bool:
        """Whether a sampler of ``base_model`` (that chose ``chosen``; "" = the
        server's) samples on the pool now; placed on the pool with no pool worker,
        UNAVAILABLE naming the base."""
        if (chosen or self.mode) == "colocated":
            return False
        return samples_on_pool(self.mode, chosen, base_model, bool(self.workers(base_model)))

    def check(self, target: SamplerTarget) -> None:
        """A new sampler that chose its placement: UNAVAILABLE now if it cannot be
        served (``pool`` with no pool worker of its base; the service answers it
        FAILED_PRECONDITION at creation); a model's sampler that
        chose the pool has the model's later versions published there."""
        self.places(target.base_model, target.placement)
        if target.model_id is not None and target.placement in ("pool", "auto"):
            self._chosen.add(target.model_id)

    # ---- versions --------------------------------------------------------------------------

    async def publish(self, model_id: str, version: int, *, inflight: bool = False) -> None:
        """After ``sync_weights`` made ``version``: ship it and have the pool serve it
        (returns once one pool worker does). A version that cannot be shipped fails
        UNAVAILABLE; the pool keeps what it served. With no pool worker of the base
        there is nothing to publish to, under any placement: the sync stands (the
        sampler it makes may have chosen ``colocated`` or ``auto``), a sampler placed
        on the pool answers UNAVAILABLE naming the base when it samples, and a pool
        worker that comes later loads the version at its first request."""
        chosen = model_id in self._chosen
        if not chosen and (
            self.mode == "colocated" or (self.mode == "auto" and not self._any_sampler_worker())
        ):
            self._latest.pop(model_id, None)  # resolved again from the trainer if a pool comes
            return
        base_model, tenant_id = self._model(model_id)
        if not self.workers(base_model):
            self._latest.pop(model_id, None)  # resolved again from the trainer if a pool comes
            return
        path = await self._ship(model_id, base_model, tenant_id, version)
        target = SamplerTarget(base_model, model_id, version, tenant_id)
        workers = self.workers(base_model)
        acks = await asyncio.gather(
            *(self._load(w, target, path, inflight, latest=True) for w in workers),
            return_exceptions=True,
        )
        served = [w for w, a in zip(workers, acks, strict=True) if not isinstance(a, BaseException)]
        if not served:
            errors = "; ".join(str(a) for a in acks if isinstance(a, BaseException))
            raise UnavailableError(
                f"sync_weights: no sampler worker of base model {base_model!r} could load "
                f"treadle://{model_id}/v/{version} ({errors}); the pool serves the versions it had"
            )
        self._latest[model_id] = version
        log.info(
            "model %s: version %d served by %d sampler worker(s)", model_id, version, len(served)
        )

    async def route(self, target: SamplerTarget) -> tuple[str, SamplerTarget] | None:
        """The pool worker a sample of ``target`` goes to (which has the version it
        reads, loaded first if it lacked it), and the target as sent there; None:
        colocated. A ``latest`` target stays one: the worker samples its latest
        version, and an in-flight publish moves its running sequences on."""
        if not self.places(target.base_model, target.placement):
            return None
        if target.model_id is not None and target.placement:
            self._chosen.add(target.model_id)
        if target.model_id is None:
            return self.workers(target.base_model)[0], target
        model_id = target.model_id
        pinned, path = await self._version_on_pool(target)
        version = pinned.version
        last: TreadleError | None = None
        for worker_id in self.workers(target.base_model):
            try:
                await self._load(worker_id, pinned, path, latest=target.follows_latest)
            except UnavailableError as err:  # gone meanwhile: the next one
                last = err
                continue
            return worker_id, target
        if (target.placement or self.mode) == "pool":
            raise UnavailableError(
                f"no sampler worker of base model {target.base_model!r} could serve "
                f"treadle://{model_id}/v/{version}" + (f": {last.message}" if last else "")
            )
        return None  # auto: back to the model's own worker

    async def route_resume(
        self, target: SamplerTarget, handles: tuple[str, ...]
    ) -> tuple[str, SamplerTarget] | None:
        """The pool worker that keeps the partial rollouts of ``handles``, once it
        serves the version ``target`` reads (loaded first if it lacked it): a resume
        continues them there under the weights the sampler reads now, whatever the
        sampler's placement, since no other worker has them. None: none of them came
        from the pool (``KeptPartials.keeper`` for handles it cannot resume)."""
        worker_id = self.partials.keeper(handles, set(self.workers(target.base_model)))
        if worker_id is None:
            return None
        if target.model_id is not None:
            pinned, path = await self._version_on_pool(target)
            await self._load(worker_id, pinned, path, latest=target.follows_latest)
        return worker_id, target

    def rewound(self, model_id: str, step: int) -> None:
        """``load_state`` put the model at ``step``: the versions shipped from ``step``
        on name weights it will publish again under the same numbers (its next sync
        is ``step``), so they are shipped again when asked for, never served from
        the old files. The pool's ``latest`` stays what it was until that sync, as a
        trainer's samplers do."""
        shipped = self._shipped.get(model_id)
        if not shipped:
            return
        for version in [v for v in shipped if v >= step]:
            self._delete_later(shipped.pop(version))
            self._shipping.pop((model_id, version), None)
        self._served = {s for s in self._served if s[1] != model_id or s[2] < step}
        self._latest_on = {k: v for k, v in self._latest_on.items() if k[1] != model_id}

    def forget(self, model_id: str) -> None:
        """A deleted model: its versions leave the store (off the event loop) and the
        pool workers that served them let them go (in the background)."""
        self._latest.pop(model_id, None)
        self._chosen.discard(model_id)
        for path in self._shipped.pop(model_id, {}).values():
            self._delete_later(path)
        workers = {w for w, m, _, _ in self._served if m == model_id}
        self._served = {s for s in self._served if s[1] != model_id}
        self._latest_on = {k: v for k, v in self._latest_on.items() if k[1] != model_id}
        self._shipping = {k: v for k, v in self._shipping.items() if k[0] != model_id}
        for worker_id in workers:
            task = asyncio.ensure_future(self._call(worker_id, DeleteModelCall(model_id)))
            task.add_done_callback(_quiet)

    # ---- shipping ---------------------------------------------------------------------------

    async def _version_on_pool(self, target: SamplerTarget) -> tuple[SamplerTarget, str]:
        """``target`` pinned to the version it reads on the pool (a ``latest`` one:
        the version last published there, else the trainer's), and the storage path
        that version was shipped to (shipped now if it was not)."""
        assert target.model_id is not None
        model_id = target.model_id
        version = target.version
        if version is None:
            version = self._latest.get(model_id)
        if version is None:  # not published to the pool yet (or a restarted server)
            trainer = self.placement.worker_of(model_id)
            version = (await self._call(trainer, CheckTargetCall(target))).version
        _, tenant_id = self._model(model_id)
        path = await self._ship(model_id, target.base_model, tenant_id, version)
        return replace(target, version=version), path

    async def _ship(self, model_id: str, base_model: str, tenant_id: str, version: int) -> str:
        """The storage path of ``version`` (written by the trainer once)."""
        lock = self._shipping.setdefault((model_id, version), asyncio.Lock())
        async with lock:
            shipped = self._shipped.setdefault(model_id, OrderedDict())
            if version in shipped:
                return shipped[version]
            if self.store is None:
                raise UnavailableError("the sampler pool needs a checkpoint store (--store)")
            path = self.store.state_path(
                tenant_id, model_id, f"pool-v{version}-{uuid.uuid4().hex[:8]}"
            )
            trainer = self.placement.worker_of(model_id)
            try:
                await self._call(trainer, ShipVersionCall(model_id, version, path))
            except NotFoundError:
                raise
            except TreadleError as err:
                raise UnavailableError(
                    f"treadle://{model_id}/v/{version} could not be shipped to the sampler "
                    f"pool: {err.message}; the pool serves the versions it had"
                ) from None
            shipped[version] = path
            while len(shipped) > self.keep_versions:
                old, old_path = shipped.popitem(last=False)
                self._served = {s for s in self._served if s[1:3] != (model_id, old)}
                self._shipping.pop((model_id, old), None)
                self._delete_later(old_path)
            return path

    async def _load(
        self,
        worker_id: str,
        target: SamplerTarget,
        path: str,
        inflight: bool = False,
        *,
        latest: bool = False,
    ) -> None:
        """``worker_id`` serves ``target``'s version (``latest``: as the model's latest
        there); a load this server saw acknowledged is not sent again."""
        assert target.model_id is not None and target.version is not None
        key = (worker_id, target.model_id, target.version, path)
        if key in self._served and (not latest or self._latest_on.get(key[:2]) == key[2]):
            return
        await self._call(worker_id, LoadVersionCall(target, path, inflight, latest))
        self._served.add(key)
        if latest:
            self._latest_on[key[:2]] = target.version

    def _delete_later(self, path: str) -> None:
        store = self.store
        if store is None:
            return

        def delete() -> None:
            try:
                store.delete(path)
            except Exception as err:  # a version left behind costs space, not correctness
                log.warning("could not delete the shipped version %s: %s", path, err)

        asyncio.get_running_loop().run_in_executor(None, delete)

    def _model(self, model_id: str) -> tuple[str, str]:
        with self.sessions() as s:
            row = s.get(db.Model, model_id)
            if row is None:
                raise NotFoundError(f"model {model_id} not found")
            return row.base_model, row.tenant_id


def _quiet(task: asyncio.Future[Any]) -> None:
    """A pool worker gone before it let a deleted model's versions go: nothing to do."""
    if not task.cancelled() and task.exception() is not None:
        log.debug("a pool worker did not release a deleted model: %s", task.exception())
