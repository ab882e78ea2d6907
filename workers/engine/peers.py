"""The other ranks of an engine's group (``--ranks N``): what the engine hands them.

A worker may be several processes on torch.distributed (``workers.group``): rank 0
runs this engine, and with it everything that decides (scheduler, ordering,
dedupe, fair share, the broker and database connections); the other ranks hold
a replica of every LoRA adapter (on a shard of its base), a shard of every full
fine-tune, and execute, in the same order, each call that changes one.
``Peers`` is the seam: the engine calls it for every such call and never asks
how many ranks there are. ``Alone`` is a worker of one process: it
runs each call here, with no torch.distributed in the path.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from treadle.common.engine.domain import (
    AdamConfig,
    ForwardBackwardOp,
    ForwardLogprobsOp,
    ForwardResult,
    LoadResult,
    OptimStepResult,
)
from treadle.workers.engine.versions import WeightSnapshot
from treadle.workers.trainer import checkpoint, trainer
from treadle.workers.trainer.trainer import TrainingModel


class Peers:
    """What a training model's state-changing calls do on the engine's group.

    Each method runs on the engine thread, after the scheduler admitted the call;
    it applies the call to rank 0's model (the engine's) and to every other
    rank's replica, and returns rank 0's answer, equal to a one-rank worker's."""

    #: the processes of the group (1: this one alone)
    size: int = 1

    def created(self, model: TrainingModel) -> None:
        """``model`` was just made here (fresh or from a state): make its replicas."""
        raise NotImplementedError

    def deleted(self, model_id: str) -> None:
        """A model was deleted or unloaded here: drop its replicas."""
        raise NotImplementedError

    def forward_backward(self, model: TrainingModel, op: ForwardBackwardOp) -> ForwardResult:
        """Add the gradient of the call's summed loss (its datums split across ranks)."""
        raise NotImplementedError

    def forward_logprobs(
        self, model: TrainingModel, op: ForwardLogprobsOp, weights: WeightSnapshot | None
    ) -> ForwardResult:
        """The logprobs of the call's datums under the model's weights, its base
        (``op.reference``) or ``weights`` (``op.reference_weights``, resolved); no
        gradient. On a group, read through the sharded weights with the datums split
        across the ranks, as a ``forward_backward``'s are."""
        raise NotImplementedError

    def optim_step(self, model: TrainingModel, adam: AdamConfig) -> OptimStepResult:
        raise NotImplementedError

    def load_state(
        self, model: TrainingModel, directory: str | Path, optimizer: bool
    ) -> LoadResult:
        raise NotImplementedError

    @contextmanager
    def whole(self, model: TrainingModel, *, moments: bool = False) -> Iterator[None]:
        """``model``'s whole weights here (and its Adam moments with ``moments``) for a
        call that reads them on this rank alone: publishing a version, ``save_state``,
        exports. A full fine-tune sharded over the group is gathered for the duration;
        a model held whole is as it is."""
        yield

    def close(self) -> None:
        """The engine stopped: stop the other ranks."""
        raise NotImplementedError


class Alone(Peers):
    """A worker of one process: every call runs here only."""

    def created(self, model: TrainingModel) -> None:
        pass

    def deleted(self, model_id: str) -> None:
        pass

    def forward_backward(self, model: TrainingModel, op: ForwardBackwardOp) -> ForwardResult:
        return trainer.forward_backward(model, op)

    def forward_logprobs(
        self, model: TrainingModel, op: ForwardLogprobsOp, weights: WeightSnapshot | None
    ) -> ForwardResult:
        return trainer.forward_logprobs(model, op, weights)

    def optim_step(self, model: TrainingModel, adam: AdamConfig) -> OptimStepResult:
        return model.optim_step(adam)

    def load_state(
        self, model: TrainingModel, directory: str | Path, optimizer: bool
    ) -> LoadResult:
        return checkpoint.load_state(model, directory, optimizer=optimizer)

    def close(self) -> None:
        pass
