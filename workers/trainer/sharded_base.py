"""A base model's frozen weights sharded over a group of ranks (``--ranks N``) with
FSDP2, shared by every model that reads them: the LoRA models on it (their base)
and the full fine-tunes of it (their reference: ``reference`` logprobs and a KL
penalty's).

A base (name, dtype) gets one FSDP2 root per group (``fsdp.build``, ``frozen``:
its tensors have no gradient), built when the first model needs it (a LoRA
model's creation; a full fine-tune's first reference pass) and used by every
later one, whichever tenant's: the base is sharded once, not once per tenant.
Each layer is gathered for its forward (and again for the backward's recompute,
under activation checkpointing); FSDP reduce-scatters nothing for it. The
adapters are not FSDP parameters: each rank holds a whole replica of every
adapter and its Adam moments (a few MB, where sharding would add collectives to
every pass and save next to nothing), passed into the sharded layers with the
rank's share of the datums; their gradients are summed over the ranks at the
optimizer step (``collectives.sum_gradients``), so every replica takes the same
step.

What a rank keeps of the whole base once it is sharded is its ``BaseKeeping``:
every rank its 1/N shard (DTensors, ``Shard(0)``); the whole base besides only
where a sampler in that process samples from it (``KeepWhole``: rank 0 with the
torch sampler, the CPU fallback). Every other rank, and rank 0 when its sampler
loads its own copy of the base (vLLM), drops the whole base once it is sharded
(``ShardsOnly``): its LoRA models read the shards, and a read that needs whole
tensors (a merged export) gathers them one at a time (``fsdp.Gathered``). Every
rank reads the whole base once from the checkpoint, to shard it.

Every function here is a collective where it says so: each rank calls it in the
same order.
"""

from __future__ import annotations

from typing import Protocol

import torch

from treadle.workers.engine.base_models import BaseModel
from treadle.workers.model.params import LlamaParams
from treadle.workers.trainer import fsdp
from treadle.workers.trainer.trainer import TrainingModel


class BaseKeeping(Protocol):
    """What a rank keeps of a base besides its shards, and what its LoRA models read."""

    def sharded(self, base: BaseModel) -> None:
        """``base`` was just sharded here: keep its whole weights, or drop them."""
        ...

    def params(self, base: BaseModel, sharding: fsdp.FsdpShards) -> LlamaParams:
        """What this rank's LoRA models on ``base`` read as its weights."""
        ...


class KeepWhole:
    """The whole base is kept beside the shards, and the LoRA models read it as on one
    rank: rank 0 when its sampler samples from this process's base weights (the
    torch samplers). Its whole reads (a merged export) need no collective."""

    def sharded(self, base: BaseModel) -> None:
        pass

    def params(self, base: BaseModel, sharding: fsdp.FsdpShards) -> LlamaParams:
        return base.params


class ShardsOnly:
    """Only the shards are kept: the whole base is dropped once sharded, and the LoRA
    models read the shards (DTensors). Every rank other than 0; rank 0 too when its
    sampler loads its own copy of the base (vLLM)."""

    def sharded(self, base: BaseModel) -> None:
        base.unload()

    def params(self, base: BaseModel, sharding: fsdp.FsdpShards) -> LlamaParams:
        return sharding.params()


class ShardedBases:
    """One rank's FSDP roots of the frozen bases its models read."""

    def __init__(self, keeping: BaseKeeping | None = None) -> None:
        self._roots: dict[tuple[str, torch.dtype], fsdp.FsdpShards] = {}
        self.keeping: BaseKeeping = keeping if keeping is not None else ShardsOnly()

    def root(self, base: BaseModel) -> fsdp.FsdpShards:
        """``base``'s FSDP root; a collective the first time a base is met (every
        rank reads it whole, shards it, then keeps what its ``keeping`` says)."""
        key = (base.name, base.dtype)
        sharding = self._roots.get(key)
        if sharding is None:  # the whole weights, the same on every rank
            sharding = fsdp.build(base.params, base.cfg, frozen=True)
            self._roots[key] = sharding
            self.keeping.sharded(base)
        return sharding

    def params_of(self, base: BaseModel) -> LlamaParams | None:
        """What a new LoRA model on ``base`` reads for it once the base is sharded (None
        before: the whole base, which sharding it then needs)."""
        sharding = self._roots.get((base.name, base.dtype))
        return None if sharding is None else self.keeping.params(base, sharding)

    def shard(self, model: TrainingModel) -> None:
        """Every rank (a collective the first time a base is met): a LoRA model just
        made trains on its base's shards, the base sharded now if it was not yet."""
        if model.adapter is None:
            raise TypeError(f"model {model.spec.model_id} is not a LoRA model")
        sharding = self.root(model.base)
        model.sharding = sharding
        model.params = self.keeping.params(model.base, sharding)
