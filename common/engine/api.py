"""The one API a server reaches an engine through, in its own process.

Every call is a message (``treadle.common.engine.messages``), run as it is:
``call(message)`` returns a future at once, resolved on the engine's thread
with the call's result; ``stream`` is the one call that answers in pieces (a
streamed sample: each sequence as it finishes, then ``StreamEnd``).
``model_status`` and ``has_model`` answer at once. ``Engine`` (local
directories) and ``StagedEngine`` (storage paths, staged to and from a remote
store) both implement it, so the in-process dispatcher and the Celery worker
hold one ``EngineAPI`` and never ask which; neither declares a method per call.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from typing import Protocol, TypeVar, runtime_checkable

from treadle.common.engine.domain import ModelStatus, SequenceResult
from treadle.common.engine.messages import EngineCall, SampleStreamCall, StreamEnd

R = TypeVar("R")

#: a streamed sample's callback: (sample index, sequence, engine seconds since the last)
OnSequence = Callable[[int, SequenceResult, float], None]


@runtime_checkable
class EngineAPI(Protocol):
    def call(self, call: EngineCall[R]) -> Future[R]: ...

    def stream(self, call: SampleStreamCall, on_sequence: OnSequence) -> Future[StreamEnd]: ...

    def model_status(self, model_id: str) -> ModelStatus: ...

    def has_model(self, model_id: str) -> bool: ...
