"""The handler of each ordered op, registered by the op's type (as losses are
by name): what applying it to a training model means, on the engine thread.

``OrderedExecutor.apply`` looks the handler up; an op with none is an internal
error (a test checks that every member of ``OrderedOp`` has one).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from treadle.common.engine.domain import (
    ForwardBackwardOp,
    ForwardLogprobsOp,
    LoadStateOp,
    OpResult,
    OptimStepOp,
    RejectedOp,
    SaveStateOp,
    SyncResult,
    SyncWeightsOp,
)
from treadle.workers.trainer import reference, trainer

if TYPE_CHECKING:
    from treadle.workers.engine.ordered import OrderedExecutor
    from treadle.workers.trainer.trainer import TrainingModel

Op = TypeVar("Op")
OpHandler = Callable[["OrderedExecutor", "TrainingModel", int, Any], OpResult]

#: op type -> its handler: (executor, model, seq_id, op) -> result
OP_HANDLERS: dict[type, OpHandler] = {}


def applies(kind: type[Op]) -> Callable[[Callable[..., OpResult]], OpHandler]:
    def register(fn: Callable[..., OpResult]) -> OpHandler:
        OP_HANDLERS[kind] = fn
        return fn

    return register


@applies(RejectedOp)
def _rejected(ex: OrderedExecutor, model: TrainingModel, seq_id: int, op: RejectedOp) -> OpResult:
    raise op.error


@applies(ForwardBackwardOp)
def _forward_backward(
    ex: OrderedExecutor, model: TrainingModel, seq_id: int, op: ForwardBackwardOp
) -> OpResult:
    ex.check_size(op.data)
    return ex.peers.forward_backward(model, op)


@applies(ForwardLogprobsOp)
def _forward_logprobs(
    ex: OrderedExecutor, model: TrainingModel, seq_id: int, op: ForwardLogprobsOp
) -> OpResult:
    ex.check_size(op.data)
    trainer.check_forward_logprobs(model, op)  # bad data fails before any read
    weights = None
    if op.reference_weights is not None:
        weights = reference.resolve(model, op.reference_weights, ex.versions)
    return ex.peers.forward_logprobs(model, op, weights)


@applies(OptimStepOp)
def _optim_step(
    ex: OrderedExecutor, model: TrainingModel, seq_id: int, op: OptimStepOp
) -> OpResult:
    return ex.auto_checkpoint(model, seq_id, ex.peers.optim_step(model, op.adam))


@applies(SyncWeightsOp)
def _sync_weights(
    ex: OrderedExecutor, model: TrainingModel, seq_id: int, op: SyncWeightsOp
) -> OpResult:
    ex.publish(model, inflight=op.inflight)
    return SyncResult(version=model.version)


@applies(SaveStateOp)
def _save_state(
    ex: OrderedExecutor, model: TrainingModel, seq_id: int, op: SaveStateOp
) -> OpResult:
    result = ex.peers.save_state(model, op.directory, seq_id)
    model.last_checkpoint_seq_id = seq_id
    ex.call_stats.checkpoint(result.size_bytes)
    return result


@applies(LoadStateOp)
def _load_state(
    ex: OrderedExecutor, model: TrainingModel, seq_id: int, op: LoadStateOp
) -> OpResult:
    return ex.peers.load_state(model, op.directory, op.optimizer)
