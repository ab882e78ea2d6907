"""A LoRA model's frozen base sharded over a group of ranks (``--ranks N``) with
FSDP2, shared by every LoRA model on it.

A base (name, dtype) gets one FSDP2 root per group (``fsdp.build``, ``frozen``:
its tensors have no gradient), built when the first LoRA model on it is made
and used by every later one, whichever tenant's: the base is sharded once, not
once per tenant. Each layer is gathered for its forward and again for the
backward's recompute (activation checkpointing); FSDP reduce-scatters nothing
for it. The adapters are not FSDP parameters: each rank holds a whole replica
of every adapter and its Adam moments (a few MB, where sharding would add
collectives to every pass and save next to nothing), passed into the sharded
layers with the rank's share of the datums; their gradients are summed over the
ranks at the optimizer step (``collectives.sum_gradients``), so every replica
takes the same step.

What each rank then holds of the base: every rank its 1/N shard (DTensors,
``Shard(0)``); rank 0 also the whole base (``BaseModel.params``), which the
calls only rank 0 runs read whole: its sampler (the torch sampler, the CPU
fallback), ``forward_logprobs``, ``reference_weights``, published versions and
merged exports. A rank other than 0 reads the whole base once from the
checkpoint, to shard it, and then drops it: its LoRA models read the shards.

Every function here is a collective where it says so: each rank calls it in the
same order.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from treadle.workers.engine.base_models import BaseModel
from treadle.workers.model.params import LlamaParams
from treadle.workers.trainer import fsdp
from treadle.workers.trainer.trainer import TrainingModel


class ShardedBases:
    """One rank's FSDP roots of the frozen bases its LoRA models train on."""

    def __init__(self) -> None:
        self._roots: dict[tuple[str, torch.dtype], fsdp.FsdpShards] = {}

    def params_of(self, base: BaseModel) -> LlamaParams | None:
        """On a rank other than 0, what a new LoRA model on ``base`` reads for it: the
        shards, once the base is sharded (None before, and on rank 0: the whole base)."""
        sharding = self._roots.get((base.name, base.dtype))
        if sharding is None or dist.get_rank() == 0:
            return None
        return sharding.params()

    def shard(self, model: TrainingModel) -> None:
        """Every rank (a collective the first time a base is met): a LoRA model just
        made trains on its base's shards, the base sharded now if no LoRA model on
        it was before. A rank other than 0 then drops the whole base."""
        if model.adapter is None:
            raise TypeError(f"model {model.spec.model_id} is not a LoRA model")
        base = model.base
        key = (base.name, base.dtype)
        sharding = self._roots.get(key)
        if sharding is None:  # the whole weights, the same on every rank
            sharding = fsdp.build(model.params, model.cfg, frozen=True)
            self._roots[key] = sharding
        model.sharding = sharding
        if dist.get_rank() != 0:
            model.params = sharding.params()
            base.unload()
