"""The other ranks of an engine's group (``--ranks N``): what the engine hands them.

A worker may be several processes on torch.distributed (``workers.group``): rank 0
runs this engine, and with it everything that decides (scheduler, ordering,
dedupe, fair share, the broker and database connections); the other ranks hold
a replica of every LoRA adapter (on a shard of its base), a shard of every full
fine-tune, and execute, in the same order, each call that changes one or reads
its sharded weights (``forward_logprobs``; a checkpoint's, an export's or a
published version's gathers).
``Peers`` is the seam: the engine calls it for every such call and never asks
how many ranks there are. ``Alone`` is a worker of one process: it
runs each call here, with no torch.distributed in the path.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from treadle.common.engine.domain import (
    AdamConfig,
    ForwardBackwardOp,
    ForwardLogprobsOp,
    ForwardResult,
    LoadResult,
    OptimStepResult,
    SaveResult,
)
from treadle.workers.engine.base_models import BaseModel
from treadle.workers.engine.versions import BaseVersion, WeightSnapshot
from treadle.workers.model.params import LlamaParams
from treadle.workers.model.published import WeightsKeeper
from treadle.workers.sampler.backend import SamplerBackend
from treadle.workers.trainer import batching, checkpoint, trainer
from treadle.workers.trainer.batching import BatchableOp, BatchCall
from treadle.workers.trainer.trainer import TrainingModel
from treadle.workers.trainer.whole import WEIGHTS, WholeTensors


class Peers:
    """What a training model's state-changing calls do on the engine's group.

    Each method runs on the engine thread, after the scheduler admitted the call;
    it applies the call to rank 0's model (the engine's) and to every other
    rank's replica, and returns rank 0's answer, equal to a one-rank worker's."""

    #: the processes of the group (1: this one alone)
    size: int = 1

    def use_sampler(self, sampler: SamplerBackend) -> None:
        """The engine's sampler backend, before any model is made: whether it samples
        from the base weights this process holds (``reads_base_weights``) decides
        whether a group's rank 0 keeps a LoRA base whole beside its shards."""

    def base_params(self, base: BaseModel) -> LlamaParams | None:
        """What a LoRA model made here reads as ``base``'s weights: None, the whole base
        (``base.params``); on a group's rank 0 that keeps only its shards of the
        sharded base, those (so making the model does not read the base again)."""
        return None

    def created(self, model: TrainingModel) -> None:
        """``model`` was just made here (fresh or from a state): make its replicas."""
        raise NotImplementedError

    def deleted(self, model_id: str) -> None:
        """A model was deleted or unloaded here: drop its replicas."""
        raise NotImplementedError

    def forward_backward(self, model: TrainingModel, op: ForwardBackwardOp) -> ForwardResult:
        """Add the gradient of the call's summed loss (its datums split across ranks)."""
        raise NotImplementedError

    def run_batch(self, calls: Sequence[BatchCall], check: Callable[[BatchableOp], None]) -> None:
        """Several LoRA models' ``forward_backward`` / ``forward_logprobs`` calls on one
        base in one pass (``workers.trainer.batching``), each call's ``outcome`` set: a
        call refused by ``check`` (the engine's per-call checks) or by the trainer's,
        or whose loss fails, fails alone. On a group every rank runs its share of
        every call's datums (``workers.trainer.sharded_batching``)."""
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

    def published(self, model: TrainingModel, keep: WeightsKeeper) -> WeightSnapshot | BaseVersion:
        """What ``SyncWeights`` publishes of ``model`` (``TrainingModel.published``). A
        full fine-tune's weights reach ``keep`` (the sampler backend's copy of them,
        ``SamplerBackend.keep_weights``) one whole tensor at a time
        (``whole_tensors``): on a group each is gathered in turn and let go once
        ``keep`` has it, so this rank holds the version ``keep`` makes and one whole
        tensor beyond its shards, never the whole weights twice."""
        if not model.publishes_a_copy:  # a LoRA adapter's copy, or the base's weights
            return model.published(keep)
        with self.whole_tensors(model) as tensors:
            whole = model.whole_weights(tensors.entries(WEIGHTS), tensors.weights())
            return model.published(keep, whole)

    @contextmanager
    def whole_tensors(
        self, model: TrainingModel, *, moments: bool = False
    ) -> Iterator[WholeTensors]:
        """``model``'s weights (a LoRA model's base; with ``moments`` a full fine-tune's
        Adam moments too) whole one tensor at a time, for a read that copies them out
        here (a checkpoint, a merged export, a published version): on a group each is
        gathered in turn, so this rank holds one whole tensor beyond its shards, not
        the whole model."""
        tensors = WholeTensors(model, moments=moments)
        try:
            yield tensors
        finally:
            tensors.close()

    def save_state(self, model: TrainingModel, directory: str | Path, seq_id: int) -> SaveResult:
        """``model``'s weights and Adam moments written here (``checkpoint.save_state``)."""
        if model.adapter is not None:  # the adapter and its moments: whole on every rank
            return checkpoint.save_state(model, directory, seq_id)
        with self.whole_tensors(model, moments=True) as tensors:
            return checkpoint.save_state(model, directory, seq_id, tensors)

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

    def run_batch(self, calls: Sequence[BatchCall], check: Callable[[BatchableOp], None]) -> None:
        batching.run_batch(calls, check)

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
