"""Every call a server makes on an engine, each declared once, here.

A call is one frozen dataclass: its fields are the call's arguments, its type
parameter and ``response`` its result, and its class variables say what the
layers around the engine need to know without a branch per call:

- ``ordered``: applied in the model's ``seq_id`` order (``SubmitCall``; the
  server's ops log records it, the replay log keeps it);
- ``fetches`` / ``uploads``: the fields that hold storage paths (``treadle://``
  or ``s3://``) the engine reads or writes; ``StagedEngine`` downloads and
  uploads them around the call, with a remote store, from this declaration
  alone (an ordered call's op declares its own, ``domain``);
- ``status_model``, ``route``: the model whose status the reply carries, and
  which worker the call goes to (the model's, or the sampler target's).

Every layer runs a call as it is: ``EngineAPI.call(call)`` in-process, the
same message through Celery (``codec`` frames it with ``VERSION``, and
``CALLS`` is the one table of what may arrive), and the engine's handler
registry (``treadle.workers.engine.calls``) binds each to its code. Adding a
call is a class here and a handler there.

Bump ``VERSION`` whenever a call's fields change meaning; a server and its
workers must then be upgraded together (the refusal says which side is older).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, TypeVar, get_args

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
)
from treadle.errors import TreadleError

#: the message format both ends speak; carried in every message (2: calls named ``*Call``;
#: 3: ``SamplerTarget.placement``, ``LoadVersionCall.latest``)
VERSION = 3

R = TypeVar("R")


# ---- results that are not domain dataclasses --------------------------------------


@dataclass(frozen=True)
class Deleted:
    model_id: str


@dataclass(frozen=True)
class Exported:
    names: tuple[str, ...]  # the files written under the export's storage path


@dataclass(frozen=True)
class TargetVersion:
    version: int  # the weights version a sampler target resolves to now


@dataclass(frozen=True)
class Shipped:
    """A published version written to the store for the sampler pool."""

    version: int
    size_bytes: int


@dataclass(frozen=True)
class StreamEnd:
    """The last reply of a streamed sample: how many items came before it."""

    count: int


# ---- calls --------------------------------------------------------------------------------


@dataclass(frozen=True)
class CallRoute:
    """Where a call runs: on the worker of ``model_id``, or on the worker that
    serves ``target`` (``sampler_key``: the sampler whose earlier calls went
    there, e.g. the one holding a partial rollout's handles)."""

    model_id: str | None = None
    target: SamplerTarget | None = None
    sampler_key: str | None = None


class EngineCall(Generic[R]):
    """A call on an engine (see the module's docstring)."""

    #: the types the reply's value may be (checked where it is received)
    response: ClassVar[tuple[type, ...]]
    ordered: ClassVar[bool] = False
    #: fields holding storage paths the engine reads (downloaded first)
    fetches: ClassVar[tuple[str, ...]] = ()
    #: fields holding storage paths the engine writes (uploaded after)
    uploads: ClassVar[tuple[str, ...]] = ()

    @property
    def status_model(self) -> str | None:
        """The model whose status the reply carries (the server keeps it)."""
        return None

    @property
    def route(self) -> CallRoute:
        raise NotImplementedError


@dataclass(frozen=True)
class CreateModelCall(EngineCall[ModelStatus]):
    response = (ModelStatus,)
    fetches = ("from_state",)
    spec: ModelSpec
    from_state: str | None = None  # a checkpoint's storage path
    next_seq_id: int = 1

    @property
    def status_model(self) -> str | None:
        return self.spec.model_id

    @property
    def route(self) -> CallRoute:
        return CallRoute(model_id=self.spec.model_id)


@dataclass(frozen=True)
class DeleteModelCall(EngineCall[Deleted]):
    response = (Deleted,)
    model_id: str

    @property
    def route(self) -> CallRoute:
        return CallRoute(model_id=self.model_id)


@dataclass(frozen=True)
class UnloadModelCall(EngineCall[SaveResult]):
    """Checkpoint an idle model into ``directory`` and free it (``Engine.unload_model``)."""

    response = (SaveResult,)
    uploads = ("directory",)
    model_id: str
    directory: str  # the storage path the checkpoint goes to
    force: bool = False

    @property
    def route(self) -> CallRoute:
        return CallRoute(model_id=self.model_id)


@dataclass(frozen=True)
class SubmitCall(EngineCall[OpResult]):
    """An ordered training call; what it stages, its ``op`` says (``OrderedOp``)."""

    response = get_args(OpResult)
    ordered = True
    model_id: str
    seq_id: int
    op: OrderedOp
    digest: str

    @property
    def status_model(self) -> str | None:
        return self.model_id

    @property
    def route(self) -> CallRoute:
        return CallRoute(model_id=self.model_id)


@dataclass(frozen=True)
class SampleCall(EngineCall[SampleResult]):
    """``dedupe_key`` = (sampler_id, seq_id, payload digest): a repeat shares the
    first call's result."""

    response = (SampleResult,)
    target: SamplerTarget
    op: SampleOp
    dedupe_key: tuple[str, int, str] | None = None

    @property
    def route(self) -> CallRoute:
        key = self.dedupe_key[0] if self.dedupe_key else None
        return CallRoute(target=self.target, sampler_key=key)


@dataclass(frozen=True)
class SampleStreamCall(EngineCall[StreamEnd]):
    """A sample answered one ``StreamedSequence`` per sample as it finishes (each
    a reply with ``more``), then ``StreamEnd`` (``EngineAPI.stream``)."""

    response = (StreamEnd,)
    target: SamplerTarget
    op: SampleOp

    @property
    def route(self) -> CallRoute:
        return CallRoute(target=self.target)


@dataclass(frozen=True)
class ResumeCall(EngineCall[SampleResult]):
    """Continue partial rollouts on the worker that sampled them (``sampler_id``)."""

    response = (SampleResult,)
    target: SamplerTarget
    handles: tuple[str, ...]
    params: SamplingConfig
    sampler_id: str = ""

    @property
    def route(self) -> CallRoute:
        return CallRoute(target=self.target, sampler_key=self.sampler_id or None)


@dataclass(frozen=True)
class CheckTargetCall(EngineCall[TargetVersion]):
    response = (TargetVersion,)
    target: SamplerTarget

    @property
    def route(self) -> CallRoute:
        return CallRoute(target=self.target)


@dataclass(frozen=True)
class ExportCall(EngineCall[Exported]):
    """The model's weights as files (a PEFT adapter, or merged) under ``directory``."""

    response = (Exported,)
    uploads = ("directory",)
    model_id: str
    directory: str  # the storage path the files go to
    merged: bool = False

    @property
    def route(self) -> CallRoute:
        return CallRoute(model_id=self.model_id)


@dataclass(frozen=True)
class ShipVersionCall(EngineCall[Shipped]):
    """Write the published ``version`` of a model (its LoRA adapter, or full
    weights) as safetensors under ``directory``, for sampler workers to load
    (``LoadVersionCall``): one upload, many readers."""

    response = (Shipped,)
    uploads = ("directory",)
    model_id: str
    version: int
    directory: str  # the storage path the version goes to

    @property
    def route(self) -> CallRoute:
        return CallRoute(model_id=self.model_id)


@dataclass(frozen=True)
class LoadVersionCall(EngineCall[TargetVersion]):
    """A sampler worker loads a version shipped by the model's trainer
    (``ShipVersionCall``) and serves it from then on; the reply is its ack."""

    response = (TargetVersion,)
    fetches = ("directory",)
    target: SamplerTarget  # the model, base and version shipped
    directory: str
    #: PipelineRL: sequences following the model's latest weights on this worker
    #: continue under this version from their next token (``SyncWeightsOp.inflight``)
    inflight: bool = False
    #: this version is the model's latest here from now on (a publish, or the
    #: version a ``latest`` sampler reads), even if a higher one was shipped before
    #: (a model rewound by ``load_state`` publishes its numbers again); else a
    #: version loaded for a pinned sampler, which leaves the latest as it was
    latest: bool = False

    @property
    def route(self) -> CallRoute:
        return CallRoute(target=self.target)


# ---- the reply --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Reply:
    """A worker's answer to the call ``cid``: its value or its error; ``status``:
    the status of the call's ``status_model`` after it; ``more``: one item of a
    streamed call (a ``StreamedSequence``), whose last reply comes later."""

    cid: str
    value: Any = None
    error: TreadleError | None = None
    status: ModelStatus | None = None
    more: bool = False


#: every call that may arrive at a worker, by the name it travels under
CALLS: Mapping[str, type[EngineCall[Any]]] = {
    cls.__name__: cls
    for cls in (
        CreateModelCall,
        DeleteModelCall,
        UnloadModelCall,
        SubmitCall,
        SampleCall,
        SampleStreamCall,
        ResumeCall,
        CheckTargetCall,
        ExportCall,
        ShipVersionCall,
        LoadVersionCall,
    )
}

#: every type a message is framed as (calls, replies and their result types)
MESSAGES: Mapping[str, type] = {
    **CALLS,
    **{
        cls.__name__: cls
        for cls in (
            Reply,
            CallRoute,
            Deleted,
            Exported,
            TargetVersion,
            StreamEnd,
            Shipped,
        )
    },
}
