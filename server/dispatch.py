"""Dispatch: how the server hands work to an engine.

``InProcessDispatcher`` drives an engine in this process (the embedded
default). A distributed dispatcher (Celery) implements the same interfaces, so
servicers never know where the engine runs: ``Dispatcher`` (the engine calls),
``Catalog`` (the base models served), ``EngineMetrics`` (live engine stats) and
``Draining`` (models to move off stopping workers).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Protocol, TypeVar

from treadle.common.engine.api import EngineAPI
from treadle.common.engine.domain import (
    ModelStatus,
    SampleOp,
    SamplerTarget,
    SequenceResult,
    StreamedSequence,
)
from treadle.common.engine.messages import (
    CheckTargetCall,
    EngineCall,
    ExportCall,
    SampleCall,
    SampleStreamCall,
)
from treadle.common.engine.model_config import ModelConfig
from treadle.common.engine.report import EngineReport
from treadle.common.engine.stats import PassStats, SamplerStats
from treadle.errors import UnavailableError
from treadle.server.sampler_placement import samples_on_pool

T = TypeVar("T")
R = TypeVar("R")


class Dispatcher(Protocol):
    """Runs engine calls (``treadle.common.engine.messages``) wherever the engine is.

    ``call`` takes every call as it is: the in-process dispatcher hands it to its
    engine, the Celery one to the worker that serves the call's ``route``; neither
    has a method per call."""

    #: the engine runs in this process and stops with it, so a graceful stop of
    #: the server must checkpoint its models first (workers of a distributed
    #: server drain their own)
    engine_in_process: bool

    async def call(self, call: EngineCall[R]) -> R:
        """The call's result. Storage paths in it are the store's (a directory,
        or s3://...); an ``ExportCall``'s ``directory`` is a local directory the
        files end up in."""
        ...

    def sample_stream(self, target: SamplerTarget, op: SampleOp) -> AsyncIterator[StreamedSequence]:
        """Each sample the moment it finishes (every index once, unless an error
        ends the stream); closing the iterator early cancels the rest."""
        ...

    def check_placement(self, target: SamplerTarget) -> None:
        """A new sampler of ``target`` that chose where it samples
        (``target.placement``): UNAVAILABLE now, naming the base model, if it cannot
        sample there (the rule: ``server.sampler_placement``), which the service
        answers as FAILED_PRECONDITION. Synchronous, so an ordered call that makes a
        sampler (``sync_weights``) checks it while building its op and a refusal
        takes the call's ``seq_id``."""
        ...

    def model_status(self, model_id: str) -> ModelStatus: ...
    def close(self) -> None: ...


class BaseCatalog(Protocol):
    """The engine's base models by name (``BaseModelRegistry``)."""

    def config(self, name: str) -> ModelConfig: ...
    def path(self, name: str) -> Path: ...
    def names(self) -> list[str]: ...


class LocalEngine(EngineAPI, Protocol):
    """An engine in this process, as the in-process dispatcher drives it."""

    bases: BaseCatalog

    def sampler_metrics(self) -> list[SamplerStats]: ...
    def pass_metrics(self) -> list[PassStats]: ...
    def report(self) -> EngineReport: ...
    def stop(self, timeout: float = 10.0) -> None: ...


class Stoppable(EngineAPI, Protocol):
    def stop(self) -> None: ...


class Catalog(Protocol):
    """The base models served, as the server sees them (names, configs, files)."""

    def base_model_config(self, name: str) -> ModelConfig: ...
    def base_model_path(self, name: str) -> Path: ...
    def base_model_names(self) -> list[str]: ...


class EngineMetrics(Protocol):
    """Live stats of the engines this server reaches directly (none for workers
    in other processes: each reports its own)."""

    def sampler_metrics(self) -> list[SamplerStats]:
        """Live stats of the samplers this dispatcher reaches directly."""
        ...

    def pass_metrics(self) -> list[PassStats]:
        """How the training passes of the engines reached directly were shared."""
        ...

    def engine_report(self) -> EngineReport | None:
        """What the engine in this process reports (device, memory, models held, its
        scheduler's queue per tenant); None without one: a ``treadle worker``
        writes its report with its heartbeat (``common.db.workers``)."""
        ...


class Draining(Protocol):
    def draining_models(self) -> set[str]:
        """Models on workers that are stopping gracefully: to be moved off, each at
        its first idle moment (``ModelLifecycle``), to a checkpoint it is restored
        from elsewhere on its next call."""
        ...


class Backend(Dispatcher, Catalog, EngineMetrics, Draining, Protocol):
    """What a server is wired with: both dispatchers implement all four
    interfaces; each caller holds the narrow one it uses (``ServerContext``)."""


#: the small interfaces a ``Backend`` is made of, each held by its callers alone
INTERFACES: tuple[type, ...] = (Dispatcher, Catalog, EngineMetrics, Draining)


async def stream_items(
    items: asyncio.Queue[T], done: asyncio.Future[Any], expected: int
) -> AsyncGenerator[T, None]:
    """Yield ``expected`` items from ``items`` as they come. ``done`` resolves when
    the producer has ended, after its last item was put: its error is raised, and
    a producer that ended short is UNAVAILABLE."""
    sent = 0
    get: asyncio.Future[T] | None = None
    try:
        while sent < expected:
            get = asyncio.ensure_future(items.get())
            waits: set[asyncio.Future[Any]] = {get, done}
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            if get.done():
                sent += 1
                yield get.result()
                continue
            get.cancel()  # a cancelled get leaves its item in the queue
            done.result()  # raises the producer's error
            while not items.empty() and sent < expected:
                sent += 1
                yield items.get_nowait()
            if sent < expected:
                raise UnavailableError(f"the stream ended after {sent} of {expected} items")
    finally:
        if get is not None and not get.done():
            get.cancel()


async def _await(fut: Future[T]) -> T:
    """Await an engine future; cancelling the awaiting task cancels the work
    where the engine can still drop it (queued samples, running samples)."""
    return await asyncio.wrap_future(fut)


class InProcessDispatcher:
    engine_in_process = True

    def __init__(self, engine: LocalEngine, staged: Stoppable | None = None) -> None:
        """``staged``: the engine behind a remote store (``StagedEngine``: checkpoints
        move through local staging off the engine thread); without one, storage
        paths are the engine's directories. Built where the server starts."""
        self.engine = engine
        self.staged = staged
        self.api: EngineAPI = staged or engine

    async def call(self, call: EngineCall[R]) -> R:
        if isinstance(call, CheckTargetCall | SampleCall):
            self.check_placement(call.target)
        # an export writes straight into the local directory the server reads it from
        api = self.engine if isinstance(call, ExportCall) else self.api
        return await _await(api.call(call))

    async def sample_stream(
        self, target: SamplerTarget, op: SampleOp
    ) -> AsyncIterator[StreamedSequence]:
        self.check_placement(target)
        loop = asyncio.get_running_loop()
        items: asyncio.Queue[StreamedSequence] = asyncio.Queue()

        def on_sequence(index: int, seq: SequenceResult, compute_s: float) -> None:
            item = StreamedSequence(index, seq, compute_s)
            loop.call_soon_threadsafe(items.put_nowait, item)

        fut = self.api.stream(SampleStreamCall(target, op), on_sequence)
        # Items and the result reach the loop in the order the engine sent them.
        done: asyncio.Future[Any] = asyncio.wrap_future(fut)
        try:
            async with contextlib.aclosing(stream_items(items, done, op.num_samples)) as stream:
                async for item in stream:
                    yield item
        finally:
            if not fut.done():
                fut.cancel()  # the engine frees the remaining rows at its next step

    def check_placement(self, target: SamplerTarget) -> None:
        """No pool here: every sampler is colocated, and one that asked for ``pool``
        is refused."""
        samples_on_pool("colocated", target.placement, target.base_model, False)

    def model_status(self, model_id: str) -> ModelStatus:
        return self.api.model_status(model_id)

    def base_model_config(self, name: str) -> ModelConfig:
        return self.engine.bases.config(name)

    def base_model_path(self, name: str) -> Path:
        return self.engine.bases.path(name)

    def base_model_names(self) -> list[str]:
        return self.engine.bases.names()

    def sampler_metrics(self) -> list[SamplerStats]:
        return self.engine.sampler_metrics()

    def pass_metrics(self) -> list[PassStats]:
        return self.engine.pass_metrics()

    def engine_report(self) -> EngineReport | None:
        return self.engine.report()

    def draining_models(self) -> set[str]:
        return set()  # the engine stops with the server

    def close(self) -> None:
        if self.staged is not None:
            self.staged.stop()  # and its engine
        else:
            self.engine.stop()
