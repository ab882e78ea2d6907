"""A full fine-tune sharded over a group of ranks (``--ranks N``): each rank keeps
1/N of every trainable tensor, of its gradient and of its two AdamW moments
(ZeRO-3 / FSDP's "full shard", on torch.distributed's collectives).

A tensor's shard is a flat slice: the tensor flattened, padded with zeros to a
multiple of N, rank r's N-th part. Between calls a rank holds only its shards
(``TrainingModel.params`` then holds flat shards, never run by a forward). A
call that needs the whole weights gathers them (``whole``: an all-gather per
tensor), runs on them and drops them; a ``ForwardBackward`` (``forward_backward``)
gathers the weights, runs the rank's share of the datums on them, and
reduce-scatters the whole gradient into the shard's (the sum over ranks, as the
data-parallel step's). AdamW steps each rank's shards (the update is
elementwise; the padding stays zero), with the clip and update norms summed
over the group, so every rank's shard moves as the same slice of a one-rank
model would.

Every function here is a collective: each rank calls it in the same order.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import Tensor

from treadle.common.engine.domain import ForwardBackwardOp, ForwardResult
from treadle.workers.model.params import LlamaParams
from treadle.workers.trainer import trainer
from treadle.workers.trainer.trainer import Sharding, TrainingModel


class FlatShards(Sharding):
    """Flat, zero-padded 1/N slices over the default process group."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], element_size: int) -> None:
        self.rank = dist.get_rank()
        self.size = dist.get_world_size()
        #: each tensor's whole shape, by name
        self.shapes = shapes
        self.full_bytes = sum(math.prod(s) for s in shapes.values()) * element_size

    @classmethod
    def of(cls, model: TrainingModel) -> FlatShards:
        shapes = {n: tuple(t.shape) for n, t in model.params.named_tensors()}
        return cls(shapes, model.params.embed_tokens.element_size())

    def take(self, full: Tensor) -> Tensor:
        """This rank's slice of ``full`` (a copy: the whole tensor can be freed)."""
        chunk = -(-full.numel() // self.size)
        flat = full.detach().reshape(-1)[self.rank * chunk : (self.rank + 1) * chunk]
        out = full.new_zeros(chunk)
        out[: flat.numel()] = flat
        return out

    def gather(self, name: str, shard: Tensor) -> Tensor:
        """The whole tensor ``name`` from every rank's ``shard``."""
        whole = shard.new_empty(shard.numel() * self.size)
        dist.all_gather_single(whole, shard.detach())
        shape = self.shapes[name]
        return whole[: math.prod(shape)].view(shape)

    def reduce(self, whole: Tensor | None, shard: Tensor) -> Tensor:
        """This rank's slice of the sum over ranks of ``whole`` (None: zeros here)."""
        padded = shard.new_zeros(shard.numel() * self.size)
        if whole is not None:
            padded[: whole.numel()] = whole.reshape(-1)
        out = shard.new_empty(shard.numel())
        dist.reduce_scatter_single(out, padded)
        return out

    def all_sum(self, value: Tensor) -> Tensor:
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
        return value


@torch.no_grad()
def shard(model: TrainingModel) -> None:
    """Every rank: a whole model (the same on every rank) becomes this rank's shards;
    accumulated gradients are dropped."""
    sharding = FlatShards.of(model)
    opt = model.optimizer
    model.params = model.params.map(sharding.take)
    opt.params = dict(model.params.named_tensors())
    opt.exp_avg = {n: sharding.take(t) for n, t in opt.exp_avg.items()}
    opt.exp_avg_sq = {n: sharding.take(t) for n, t in opt.exp_avg_sq.items()}
    opt.reduce = sharding.all_sum
    model.sharding = sharding


@torch.no_grad()
def unshard(model: TrainingModel) -> None:
    """Every rank: the model becomes whole again (weights and moments gathered)."""
    sharding = _sharding(model)
    opt = model.optimizer
    _gather_weights(model, sharding)
    opt.exp_avg = {n: sharding.gather(n, t) for n, t in opt.exp_avg.items()}
    opt.exp_avg_sq = {n: sharding.gather(n, t) for n, t in opt.exp_avg_sq.items()}
    opt.reduce = None
    model.sharding = None


@contextmanager
def whole(model: TrainingModel, *, moments: bool) -> Iterator[None]:
    """Every rank: the whole weights (and with ``moments`` the Adam moments) in the
    model for the duration, its shards back after (what the body changed is dropped)."""
    sharding = _sharding(model)
    opt = model.optimizer
    kept = (model.params, opt.params, opt.exp_avg, opt.exp_avg_sq)
    with torch.no_grad():
        _gather_weights(model, sharding)
        if moments:
            opt.exp_avg = {n: sharding.gather(n, t) for n, t in opt.exp_avg.items()}
            opt.exp_avg_sq = {n: sharding.gather(n, t) for n, t in opt.exp_avg_sq.items()}
    try:
        yield
    finally:
        model.params, opt.params, opt.exp_avg, opt.exp_avg_sq = kept


def forward_backward(
    model: TrainingModel, op: ForwardBackwardOp
) -> ForwardResult | Exception | None:
    """Every rank: its share of a ``ForwardBackward`` (possibly none: None) on the
    gathered weights; the whole gradients summed over ranks into each shard's gradient.

    A failure of the share itself (out of memory on one rank, say) is returned,
    not raised, once the collectives are done, so no rank is left waiting; a
    failed collective raises."""
    sharding = _sharding(model)
    outcome: ForwardResult | None = None
    failed: Exception | None = None
    with whole(model, moments=False):
        for p in model.optimizer.params.values():
            p.requires_grad_(True)
        try:
            outcome = trainer.forward_backward(model, op) if op.data else None
        except Exception as err:  # raised below, once every rank has its gradient
            failed = err
        grads = {n: p.grad for n, p in model.optimizer.params.items()}
    with torch.no_grad():
        for name, part in model.optimizer.params.items():
            summed = sharding.reduce(grads.pop(name), part)
            part.grad = summed if part.grad is None else part.grad.add_(summed)
    return failed if failed is not None else outcome


def _sharding(model: TrainingModel) -> FlatShards:
    if not isinstance(model.sharding, FlatShards):
        raise TypeError(f"model {model.spec.model_id} is not sharded")
    return model.sharding


def _gather_weights(model: TrainingModel, sharding: FlatShards) -> None:
    tensors = {n: sharding.gather(n, t) for n, t in model.optimizer.params.items()}
    model.params = LlamaParams.from_state_dict(model.cfg, tensors)
    model.optimizer.params = dict(model.params.named_tensors())
