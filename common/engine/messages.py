"""The wire between a server and its ``treadle worker`` processes: one typed
message per ``EngineAPI`` call, and the typed reply.

A request names the engine call it makes (``call``, on any ``EngineAPI``), so a
worker dispatches on the message's type, never on a string; ``REQUESTS`` is the
one table of what may arrive. Each request's ``Response`` is what its reply
carries: a domain dataclass where the engine already answers one, else one of
the small response types below. ``treadle.common.engine.codec`` frames every message
with ``VERSION`` and refuses a message of another version or of a type not
listed here (``encode_message`` / ``decode_message``).

Bump ``VERSION`` whenever a message's fields change meaning; a server and its
workers must then be upgraded together (the refusal says which side is older).
"""

from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, TypeVar, get_args

from treadle.common.engine.api import EngineAPI, OnSequence
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

#: the message format both ends speak; carried in every message
VERSION = 1

R = TypeVar("R")


def _mapped(fut: Future[Any], fn: Any) -> Future[Any]:
    """A future resolved with ``fn(result)`` of ``fut`` (or its error)."""
    out: Future[Any] = Future()

    def done(f: Future[Any]) -> None:
        if f.cancelled():
            out.cancel()
        elif (err := f.exception()) is not None:
            out.set_exception(err)
        else:
            out.set_result(fn(f.result()))

    fut.add_done_callback(done)
    return out


# ---- responses that are not domain dataclasses ------------------------------------


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
class StreamEnd:
    """The last reply of a streamed sample: how many items came before it."""

    count: int


# ---- requests -------------------------------------------------------------------------------


class Request(Generic[R]):
    """A call on an engine. ``status_model``: the model whose status the reply
    carries (the server keeps it as the model's status), if any."""

    #: the types the reply's value may be (checked where it is received)
    response: ClassVar[tuple[type, ...]]

    @property
    def status_model(self) -> str | None:
        return None

    def call(self, api: EngineAPI) -> Future[R]:
        raise NotImplementedError


@dataclass(frozen=True)
class CreateModel(Request[ModelStatus]):
    response = (ModelStatus,)
    spec: ModelSpec
    from_state: str | None = None  # a checkpoint's storage path
    next_seq_id: int = 1

    @property
    def status_model(self) -> str | None:
        return self.spec.model_id

    def call(self, api: EngineAPI) -> Future[ModelStatus]:
        return api.create_model(self.spec, from_state=self.from_state, next_seq_id=self.next_seq_id)


@dataclass(frozen=True)
class DeleteModel(Request[Deleted]):
    response = (Deleted,)
    model_id: str

    def call(self, api: EngineAPI) -> Future[Deleted]:
        return _mapped(api.delete_model(self.model_id), lambda _: Deleted(self.model_id))


@dataclass(frozen=True)
class UnloadModel(Request[SaveResult]):
    response = (SaveResult,)
    model_id: str
    directory: str  # the storage path the checkpoint goes to
    force: bool = False

    def call(self, api: EngineAPI) -> Future[SaveResult]:
        return api.unload_model(self.model_id, self.directory, force=self.force)


@dataclass(frozen=True)
class Submit(Request[OpResult]):
    response = get_args(OpResult)
    model_id: str
    seq_id: int
    op: OrderedOp
    digest: str

    @property
    def status_model(self) -> str | None:
        return self.model_id

    def call(self, api: EngineAPI) -> Future[OpResult]:
        return api.submit(self.model_id, self.seq_id, self.op, self.digest)


@dataclass(frozen=True)
class Sample(Request[SampleResult]):
    response = (SampleResult,)
    target: SamplerTarget
    op: SampleOp
    dedupe_key: tuple[str, int, str] | None = None

    def call(self, api: EngineAPI) -> Future[SampleResult]:
        return api.sample(self.target, self.op, dedupe_key=self.dedupe_key)


@dataclass(frozen=True)
class SampleStream(Request[StreamEnd]):
    """A sample answered one ``StreamedSequence`` per sample as it finishes (each
    a reply with ``more``), then ``StreamEnd``."""

    response = (StreamEnd,)
    target: SamplerTarget
    op: SampleOp

    def stream(self, api: EngineAPI, on_sequence: OnSequence) -> Future[StreamEnd]:
        fut = api.sample(self.target, self.op, on_sequence=on_sequence)
        return _mapped(fut, lambda r: StreamEnd(len(r.sequences)))

    def call(self, api: EngineAPI) -> Future[StreamEnd]:
        return self.stream(api, lambda i, s, t: None)


@dataclass(frozen=True)
class Resume(Request[SampleResult]):
    response = (SampleResult,)
    target: SamplerTarget
    handles: tuple[str, ...]
    params: SamplingConfig

    def call(self, api: EngineAPI) -> Future[SampleResult]:
        return api.resume(self.target, self.handles, self.params)


@dataclass(frozen=True)
class CheckTarget(Request[TargetVersion]):
    response = (TargetVersion,)
    target: SamplerTarget

    def call(self, api: EngineAPI) -> Future[TargetVersion]:
        return _mapped(api.check_sampler_target(self.target), TargetVersion)


@dataclass(frozen=True)
class Export(Request[Exported]):
    response = (Exported,)
    model_id: str
    directory: str  # the storage path the files go to
    merged: bool = False

    def call(self, api: EngineAPI) -> Future[Exported]:
        fut = api.export_weights(self.model_id, self.directory, merged=self.merged)
        return _mapped(fut, lambda names: Exported(tuple(names)))


# ---- the reply --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Reply:
    """A worker's answer to the call ``cid``: its value or its error; ``status``:
    the status of the request's ``status_model`` after it; ``more``: one item of a
    streamed call (a ``StreamedSequence``), whose last reply comes later."""

    cid: str
    value: Any = None
    error: TreadleError | None = None
    status: ModelStatus | None = None
    more: bool = False


#: every request that may arrive at a worker, by the name it travels under
REQUESTS: Mapping[str, type[Request[Any]]] = {
    cls.__name__: cls
    for cls in (
        CreateModel,
        DeleteModel,
        UnloadModel,
        Submit,
        Sample,
        SampleStream,
        Resume,
        CheckTarget,
        Export,
    )
}

#: every type a message is framed as (requests, replies and their response types)
MESSAGES: Mapping[str, type] = {
    **REQUESTS,
    **{cls.__name__: cls for cls in (Reply, Deleted, Exported, TargetVersion, StreamEnd)},
}
