"""The typed API a server reaches an engine through, in its own process.

``Engine`` (local directories) and ``StagedEngine`` (storage paths, staged to
and from a remote store) both implement it, so the in-process dispatcher and the
Celery worker hold one ``EngineAPI`` and never ask which. Every call is
thread-safe and returns at once: a future, resolved on the engine's thread
(``model_status`` and ``has_model`` answer at once). Paths are storage paths:
local directories for an ``Engine``, anything the store holds for a
``StagedEngine``. Each call that returns a future travels between a server and
a worker as its own message (``treadle.common.engine.messages``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Protocol, runtime_checkable

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
)

#: a streamed sample's callback: (sample index, sequence, engine seconds since the last)
OnSequence = Callable[[int, SequenceResult, float], None]


@runtime_checkable
class EngineAPI(Protocol):
    def create_model(
        self, spec: ModelSpec, *, from_state: str | None = None, next_seq_id: int = 1
    ) -> Future[ModelStatus]: ...

    def delete_model(self, model_id: str) -> Future[None]: ...

    def unload_model(
        self, model_id: str, directory: str, *, force: bool = False
    ) -> Future[SaveResult]: ...

    def submit(
        self, model_id: str, seq_id: int, op: OrderedOp, digest: str
    ) -> Future[OpResult]: ...

    def sample(
        self,
        target: SamplerTarget,
        op: SampleOp,
        *,
        dedupe_key: tuple[str, int, str] | None = None,
        on_sequence: OnSequence | None = None,
    ) -> Future[SampleResult]: ...

    def resume(
        self, target: SamplerTarget, handles: Sequence[str], params: SamplingConfig
    ) -> Future[SampleResult]: ...

    def check_sampler_target(self, target: SamplerTarget) -> Future[int]: ...

    def export_weights(self, model_id: str, directory: str, *, merged: bool) -> Future[list[str]]:
        """The model's current weights as files under ``directory``; their names."""
        ...

    def model_status(self, model_id: str) -> ModelStatus: ...

    def has_model(self, model_id: str) -> bool: ...
