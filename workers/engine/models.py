"""The training models of one engine and the status each last published.

The models are touched only on the engine thread; their status (version, next
expected ``seq_id``, last checkpoint) is read from any thread, so it is kept
apart, behind a lock, and replaced whole after every applied call.
"""

from __future__ import annotations

import threading

from treadle.common.engine.domain import ModelStatus
from treadle.errors import NotFoundError
from treadle.workers.trainer.trainer import TrainingModel


class ModelRegistry:
    def __init__(self) -> None:
        #: model id -> the model (engine thread only)
        self.models: dict[str, TrainingModel] = {}
        self._status: dict[str, ModelStatus] = {}
        self._status_lock = threading.Lock()
        #: model -> the last seq_id applied before it started holding gradients
        #: (absent: it holds none), where a forced unload checkpoints it
        self._clean_seq: dict[str, int] = {}

    def require(self, model_id: str) -> TrainingModel:
        model = self.models.get(model_id)
        if model is None:
            raise NotFoundError(f"model {model_id} not found")
        return model

    def remove(self, model_id: str) -> TrainingModel:
        model = self.models.pop(model_id, None)
        if model is None:
            raise NotFoundError(f"model {model_id} not found")
        self._clean_seq.pop(model_id, None)
        return model

    def forget_status(self, model_id: str) -> None:
        with self._status_lock:
            self._status.pop(model_id, None)

    def publish_status(self, model_id: str, next_seq_id: int) -> ModelStatus:
        model = self.models[model_id]
        status = ModelStatus(
            model_id=model_id,
            version=model.version,
            next_seq_id=next_seq_id,
            last_checkpoint_seq_id=model.last_checkpoint_seq_id,
        )
        with self._status_lock:
            self._status[model_id] = status
        return status

    def note_applied(self, model_id: str, seq_id: int) -> None:
        """After ``seq_id`` was applied: remember the last state without gradients."""
        model = self.models.get(model_id)
        if model is None:
            return
        if holds_gradients(model):  # the state is still that of the last clean call
            self._clean_seq.setdefault(model_id, seq_id - 1)
        else:
            self._clean_seq.pop(model_id, None)

    def clean_seq(self, model_id: str, default: int) -> int:
        """The last seq_id whose state the model's weights and optimizer still are."""
        return self._clean_seq.get(model_id, default)

    # ---- any thread ---------------------------------------------------------------------

    def status(self, model_id: str) -> ModelStatus:
        with self._status_lock:
            status = self._status.get(model_id)
        if status is None:
            raise NotFoundError(f"model {model_id} not found")
        return status

    def has(self, model_id: str) -> bool:
        with self._status_lock:
            return model_id in self._status

    def count(self) -> int:
        with self._status_lock:
            return len(self._status)


def holds_gradients(model: TrainingModel) -> bool:
    return any(p.grad is not None for p in model.trainable.values())
