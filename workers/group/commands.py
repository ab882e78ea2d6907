"""What rank 0 hands another rank: one command per state-changing call, in the
order the engine applied them, through a queue per rank (``channel``)."""

from __future__ import annotations

from dataclasses import dataclass

from treadle.common.engine.domain import (
    AdamConfig,
    ForwardBackwardOp,
    ForwardLogprobsOp,
    ModelSpec,
)


@dataclass(frozen=True)
class ReplicaCreate:
    """Make a replica of a new model; its state then arrives by broadcast."""

    spec: ModelSpec
    max_context: int
    checkpoint_activations: bool
    memory_limit_bytes: int


@dataclass(frozen=True)
class ReplicaDelete:
    model_id: str


@dataclass(frozen=True)
class ReplicaForwardBackward:
    """The rank's share of a call's datums (possibly none: it still joins the gather)."""

    model_id: str
    op: ForwardBackwardOp


@dataclass(frozen=True)
class ReplicaBatch:
    """The rank's shares of a batched pass's calls (LoRA models on one sharded base),
    in the batch's order, each a (model id, share) pair (a share possibly without
    datums: the rank still joins the pass); ``no_grad_pass``: some rank's share needs
    the pass without gradients (``workers.trainer.sharded_batching``)."""

    members: tuple[tuple[str, ForwardBackwardOp | ForwardLogprobsOp], ...]
    no_grad_pass: bool


@dataclass(frozen=True)
class ReplicaForwardLogprobs:
    """The rank's share of a ``ForwardLogprobs`` (possibly none: it still joins the
    gathers) through the sharded weights it reads: the model's own, or its base
    (``op.reference``), or its base with an adapter rank 0 broadcasts
    (``op.reference_weights``)."""

    model_id: str
    op: ForwardLogprobsOp


@dataclass(frozen=True)
class ReplicaOptimStep:
    """Sum the gradients over the group, then step (every rank the same update)."""

    model_id: str
    adam: AdamConfig


@dataclass(frozen=True)
class ReplicaLoadState:
    """Rank 0 loaded a state: take its weights, moments and step by broadcast."""

    model_id: str


@dataclass(frozen=True)
class ReplicaGather:
    """Rank 0 reads a sharded model whole: join the all-gather of its shards."""

    model_id: str
    moments: bool


@dataclass(frozen=True)
class RankStop:
    """The engine stopped: exit."""


RankCommand = (
    ReplicaCreate
    | ReplicaDelete
    | ReplicaForwardBackward
    | ReplicaBatch
    | ReplicaForwardLogprobs
    | ReplicaOptimStep
    | ReplicaLoadState
    | ReplicaGather
    | RankStop
)
