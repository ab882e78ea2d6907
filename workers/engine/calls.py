"""The engine's handler of each call (``treadle.common.engine.messages``),
registered by the call's type, the way losses are registered by name.

``Engine.call`` looks the handler up and runs it; a call with no handler is
refused (a test checks that every call in ``messages.CALLS`` has one). Each
handler maps the call's fields onto the engine's own thread-safe methods and
returns their future, with the call's result type.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, TypeVar

from treadle.common.engine.messages import (
    CheckTargetCall,
    CreateModelCall,
    Deleted,
    DeleteModelCall,
    EngineCall,
    ExportCall,
    Exported,
    LoadVersionCall,
    ResumeCall,
    SampleCall,
    SampleStreamCall,
    Shipped,
    ShipVersionCall,
    StreamEnd,
    SubmitCall,
    TargetVersion,
    UnloadModelCall,
)
from treadle.common.futures import mapped

if TYPE_CHECKING:
    from treadle.workers.engine.loop import Engine

C = TypeVar("C", bound=EngineCall[Any])
Handler = Callable[["Engine", Any], "Future[Any]"]

#: call type -> the engine's handler of it
HANDLERS: dict[type[EngineCall[Any]], Handler] = {}


def handles(kind: type[C]) -> Callable[[Callable[[Engine, C], Future[Any]]], Handler]:
    def register(fn: Callable[[Engine, C], Future[Any]]) -> Handler:
        HANDLERS[kind] = fn
        return fn

    return register


@handles(CreateModelCall)
def _create(engine: Engine, c: CreateModelCall) -> Future[Any]:
    return engine.create_model(c.spec, from_state=c.from_state, next_seq_id=c.next_seq_id)


@handles(DeleteModelCall)
def _delete(engine: Engine, c: DeleteModelCall) -> Future[Any]:
    return mapped(engine.delete_model(c.model_id), lambda _: Deleted(c.model_id))


@handles(UnloadModelCall)
def _unload(engine: Engine, c: UnloadModelCall) -> Future[Any]:
    return engine.unload_model(c.model_id, c.directory, force=c.force)


@handles(SubmitCall)
def _submit(engine: Engine, c: SubmitCall) -> Future[Any]:
    return engine.submit(c.model_id, c.seq_id, c.op, c.digest)


@handles(SampleCall)
def _sample(engine: Engine, c: SampleCall) -> Future[Any]:
    return engine.sample(c.target, c.op, dedupe_key=c.dedupe_key)


@handles(SampleStreamCall)
def _sample_stream(engine: Engine, c: SampleStreamCall) -> Future[Any]:
    """Unstreamed (a caller with no callback): the count of samples at the end."""
    return stream(engine, c, lambda i, s, t: None)


@handles(ResumeCall)
def _resume(engine: Engine, c: ResumeCall) -> Future[Any]:
    return engine.resume(c.target, c.handles, c.params)


@handles(CheckTargetCall)
def _check_target(engine: Engine, c: CheckTargetCall) -> Future[Any]:
    return mapped(engine.check_sampler_target(c.target), TargetVersion)


@handles(ExportCall)
def _export(engine: Engine, c: ExportCall) -> Future[Any]:
    fut = engine.export_weights(c.model_id, c.directory, merged=c.merged)
    return mapped(fut, lambda names: Exported(tuple(names)))


@handles(ShipVersionCall)
def _ship_version(engine: Engine, c: ShipVersionCall) -> Future[Any]:
    fut = engine.ship_version(c.model_id, c.version, c.directory)
    return mapped(fut, lambda size: Shipped(c.version, size))


@handles(LoadVersionCall)
def _load_version(engine: Engine, c: LoadVersionCall) -> Future[Any]:
    return mapped(
        engine.load_version(c.target, c.directory, inflight=c.inflight, latest=c.latest),
        TargetVersion,
    )


def stream(
    engine: Engine, c: SampleStreamCall, on_sequence: Callable[..., None]
) -> Future[StreamEnd]:
    fut = engine.sample(c.target, c.op, on_sequence=on_sequence)
    return mapped(fut, lambda r: StreamEnd(len(r.sequences)))
