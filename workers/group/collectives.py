"""What the ranks of a group exchange for one call: a model's whole state (rank 0's,
broadcast), the sum of the gradients, and the per-rank results of a
``ForwardBackward`` merged into the one a single rank would give.

Every function here is a collective: each rank calls it, in the same order,
with the same model; a rank that died or hangs makes it raise after the
process group's timeout (``--collective-timeout``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from treadle.common.engine.domain import ForwardBackwardOp, ForwardLogprobsOp, ForwardResult
from treadle.workers.model.lora import LoraAdapter
from treadle.workers.trainer import fsdp
from treadle.workers.trainer.sharded_base import ShardedBases
from treadle.workers.trainer.trainer import TrainingModel


@torch.no_grad()
def broadcast_state(model: TrainingModel) -> None:
    """Every rank's replica becomes rank 0's: trainable weights, Adam moments, step
    and version; accumulated gradients are dropped (as ``load_state`` drops them)."""
    opt = model.optimizer
    for name, p in model.trainable.items():
        dist.broadcast(p.detach(), src=0)
        dist.broadcast(opt.exp_avg[name], src=0)
        dist.broadcast(opt.exp_avg_sq[name], src=0)
        p.grad = None
    meta: list[Any] = [opt.step_count, opt.weights_moved, model.version]
    dist.broadcast_object_list(meta, src=0)
    opt.step_count, opt.weights_moved, model.version = int(meta[0]), bool(meta[1]), int(meta[2])


def made(model: TrainingModel, bases: ShardedBases) -> None:
    """A model was just created on every rank: rank 0's state everywhere, then a full
    fine-tune sharded over the group; a LoRA model trains on its base's shards
    (``bases``: one sharded base for every LoRA model on it), its adapter replicated
    (a few MB, whose sharding would save nothing and add collectives to every pass)."""
    broadcast_state(model)
    if model.adapter is None:
        fsdp.shard(model)
    else:
        bases.shard(model)


def forward_backward(
    model: TrainingModel, op: ForwardBackwardOp, bases: ShardedBases
) -> ForwardResult | Exception | None:
    """Every rank: its share of a ``ForwardBackward`` through the model's FSDP root
    (``fsdp.forward_backward``); a KL penalty's reference logprobs through the
    model's base sharded over the group (``bases``)."""
    return fsdp.forward_backward(model, op, lambda: bases.root(model.base))


def forward_logprobs(
    model: TrainingModel,
    op: ForwardLogprobsOp,
    bases: ShardedBases,
    reference: LoraAdapter | None = None,
) -> ForwardResult | Exception | None:
    """Every rank: the logprobs of its share of a ``ForwardLogprobs`` (None: no datums)
    through sharded weights: the model's own (a full fine-tune's shards, or a LoRA
    model's adapter on its sharded base), its base sharded over the group
    (``op.reference``; a full fine-tune's base is sharded on first use), or that
    base with the adapter of ``op.reference_weights`` (``reference`` on rank 0,
    broadcast to the others)."""
    if op.reference_weights is not None:
        lora: LoraAdapter | None = share_adapter(reference, model)
        weights = bases.root(model.base)
    elif op.reference:
        lora, weights = None, bases.root(model.base)
    else:
        lora, weights = model.adapter, _sharded(model)
    return fsdp.forward_logprobs(model, op, weights, lora)


def share_adapter(adapter: LoraAdapter | None, model: TrainingModel) -> LoraAdapter:
    """Rank 0's ``adapter`` on every rank (a broadcast of its tensors, a few MB)."""
    payload: list[Any] = [None]
    if dist.get_rank() == 0:
        if adapter is None:
            raise ValueError("rank 0 shares no adapter")
        tensors = {n: t.detach().cpu() for n, t in adapter.named_tensors()}
        payload = [(tensors, adapter.alpha)]
    dist.broadcast_object_list(payload, src=0)
    if adapter is not None:
        return adapter
    tensors, alpha = payload[0]
    where = model.params.device
    return LoraAdapter.from_named_tensors(
        model.cfg, {n: t.to(where) for n, t in tensors.items()}, alpha=float(alpha)
    )


def _sharded(model: TrainingModel) -> fsdp.FsdpShards:
    if not isinstance(model.sharding, fsdp.FsdpShards):
        raise TypeError(f"model {model.spec.model_id} is not sharded")
    return model.sharding


def replicated(model: TrainingModel) -> bool:
    """Whether the model's trainable tensors are whole on every rank (a LoRA adapter,
    its base sharded or not; a model held whole): its gradients are summed over the
    ranks at the step, its loaded state broadcast from rank 0, and rank 0 reads it
    as it is. A full fine-tune's are FSDP's shards instead."""
    return model.sharding is None or model.sharding.frozen


@torch.no_grad()
def sum_gradients(model: TrainingModel) -> None:
    """Each trainable tensor's gradient becomes the sum of every rank's (zero where a
    rank has none): the gradient of the step's summed loss, as on one rank."""
    for p in model.trainable.values():
        # a batched pass's gradient may be a view into one buffer of several adapters'
        # (``LoraRows`` stacks their B matrices): gloo reduces a tensor's storage as if
        # dense, so a strided view would sum the wrong elements (and write past it)
        p.grad = torch.zeros_like(p) if p.grad is None else p.grad.contiguous()
        dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)


def all_ok(ok: bool, where: torch.device) -> bool:
    """Whether every rank's ``ok`` is True (each rank learns the same answer);
    ``where``: the ranks' device (NCCL reduces CUDA tensors only)."""
    flag = torch.tensor([0 if ok else 1], dtype=torch.int64, device=where)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return int(flag.item()) == 0


def split(count: int, parts: int) -> list[range]:
    """``count`` datums in ``parts`` contiguous shares, the larger first (rank 0's)."""
    size, extra = divmod(count, parts)
    out, at = [], 0
    for r in range(parts):
        n = size + (1 if r < extra else 0)
        out.append(range(at, at + n))
        at += n
    return out


def merge_results(results: Sequence[ForwardResult | None]) -> ForwardResult:
    """The ranks' results (None: a rank with no datums), in rank order, as one:
    logprobs concatenated; ``:sum`` metrics added, ``:min``/``:max`` taken over
    ranks, ``:mean`` weighted by each rank's ``ntokens:sum`` (the tokens it was
    a mean over); any other metric is rank 0's."""
    present = [r for r in results if r is not None]
    logprobs: list[np.ndarray] = [lp for r in present for lp in r.logprobs]
    metrics: dict[str, float] = {}
    weights = [r.metrics.get("ntokens:sum", 0.0) for r in present]
    for name in dict.fromkeys(k for r in present for k in r.metrics):
        values = [
            (r.metrics[name], w) for r, w in zip(present, weights, strict=True) if name in r.metrics
        ]
        if name.endswith(":sum"):
            metrics[name] = math.fsum(v for v, _ in values)
        elif name.endswith(":min"):
            metrics[name] = min(v for v, _ in values)
        elif name.endswith(":max"):
            metrics[name] = max(v for v, _ in values)
        elif name.endswith(":mean"):
            total = math.fsum(w for _, w in values)
            metrics[name] = (
                math.fsum(v * w for v, w in values) / total if total > 0 else values[0][0]
            )
        else:
            metrics[name] = values[0][0]
    return ForwardResult(logprobs=tuple(logprobs), metrics=metrics)
