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
    ModelSpec,
    ModelStatus,
    OpResult,
    OrderedOp,
    SampleOp,
    SampleResult,
    SamplerTarget,
    SamplingConfig,
    SaveResult,
    SequenceResult,
    StreamedSequence,
)
from treadle.common.engine.stats import PassStats
from treadle.common.store import Store, storage_path_str
from treadle.errors import UnavailableError
from treadle.workers.engine.loop import Engine
from treadle.workers.engine.staging import StagedEngine
from treadle.workers.model.config import ModelConfig
from treadle.workers.sampler.torch_sampler import SamplerStats

T = TypeVar("T")


class Dispatcher(Protocol):
    async def create_model(
        self, spec: ModelSpec, *, from_state: str | Path | None, next_seq_id: int
    ) -> ModelStatus:
        """``from_state``: a checkpoint's storage path (a directory, or s3://...)."""
        ...

    #: the engine runs in this process and stops with it, so a graceful stop of
    #: the server must checkpoint its models first (workers of a distributed
    #: server drain their own)
    engine_in_process: bool

    async def delete_model(self, model_id: str) -> None: ...
    async def unload_model(
        self, model_id: str, directory: Path, *, force: bool = False
    ) -> SaveResult:
        """Checkpoint an idle model into ``directory`` and free it (FAILED_PRECONDITION
        when it is not idle; ``force``: checkpoint what is applied anyway, see
        ``Engine.unload_model``)."""
        ...

    async def export_weights(self, model_id: str, directory: Path, *, merged: bool) -> list[str]:
        """Write the model's current weights as files into ``directory`` (a PEFT
        adapter, or merged HF checkpoint with tokenizer files); their names."""
        ...

    async def submit(self, model_id: str, seq_id: int, op: OrderedOp, digest: str) -> OpResult: ...
    async def sample(
        self, target: SamplerTarget, op: SampleOp, dedupe_key: tuple[str, int, str] | None
    ) -> SampleResult: ...
    def sample_stream(self, target: SamplerTarget, op: SampleOp) -> AsyncIterator[StreamedSequence]:
        """Each sample the moment it finishes (every index once, unless an error
        ends the stream); closing the iterator early cancels the rest."""
        ...

    async def resume(
        self,
        target: SamplerTarget,
        sampler_id: str,
        handles: tuple[str, ...],
        params: SamplingConfig,
    ) -> SampleResult:
        """Continue partial rollouts (``Engine.resume``); ``sampler_id`` routes it."""
        ...

    async def check_sampler_target(self, target: SamplerTarget) -> int: ...
    def model_status(self, model_id: str) -> ModelStatus: ...
    def close(self) -> None: ...


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

    def __init__(self, engine: Engine, store: Store | None = None) -> None:
        self.engine = engine
        #: with a remote store (S3), checkpoints move through local staging off the
        #: engine thread; with a local one, storage paths are the engine's directories
        self.staged = (
            StagedEngine(engine, store) if store is not None and not store.is_local else None
        )
        #: every call but export goes through this one typed API (``workers.engine_api``)
        self.api: EngineAPI = self.staged or engine

    async def create_model(
        self, spec: ModelSpec, *, from_state: str | Path | None, next_seq_id: int
    ) -> ModelStatus:
        path = storage_path_str(from_state) if from_state is not None else None
        return await _await(self.api.create_model(spec, from_state=path, next_seq_id=next_seq_id))

    async def delete_model(self, model_id: str) -> None:
        await _await(self.api.delete_model(model_id))

    async def unload_model(
        self, model_id: str, directory: Path, *, force: bool = False
    ) -> SaveResult:
        path = storage_path_str(directory)  # with a remote store, uploaded there
        return await _await(self.api.unload_model(model_id, path, force=force))

    async def export_weights(self, model_id: str, directory: Path, *, merged: bool) -> list[str]:
        return await _await(self.engine.export_weights(model_id, directory, merged=merged))

    async def submit(self, model_id: str, seq_id: int, op: OrderedOp, digest: str) -> OpResult:
        return await _await(self.api.submit(model_id, seq_id, op, digest))

    async def sample(
        self, target: SamplerTarget, op: SampleOp, dedupe_key: tuple[str, int, str] | None
    ) -> SampleResult:
        return await _await(self.api.sample(target, op, dedupe_key=dedupe_key))

    async def sample_stream(
        self, target: SamplerTarget, op: SampleOp
    ) -> AsyncIterator[StreamedSequence]:
        loop = asyncio.get_running_loop()
        items: asyncio.Queue[StreamedSequence] = asyncio.Queue()

        def on_sequence(index: int, seq: SequenceResult, compute_s: float) -> None:
            item = StreamedSequence(index, seq, compute_s)
            loop.call_soon_threadsafe(items.put_nowait, item)

        fut = self.api.sample(target, op, on_sequence=on_sequence)
        # Items and the result reach the loop in the order the engine sent them.
        done: asyncio.Future[Any] = asyncio.wrap_future(fut)
        try:
            async with contextlib.aclosing(stream_items(items, done, op.num_samples)) as stream:
                async for item in stream:
                    yield item
        finally:
            if not fut.done():
                fut.cancel()  # the engine frees the remaining rows at its next step

    async def resume(
        self,
        target: SamplerTarget,
        sampler_id: str,
        handles: tuple[str, ...],
        params: SamplingConfig,
    ) -> SampleResult:
        return await _await(self.api.resume(target, handles, params))

    async def check_sampler_target(self, target: SamplerTarget) -> int:
        return await _await(self.api.check_sampler_target(target))

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

    def draining_models(self) -> set[str]:
        return set()  # the engine stops with the server

    def close(self) -> None:
        if self.staged is not None:
            self.staged.stop()
        self.engine.stop()
