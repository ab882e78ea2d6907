"""A rank other than 0: its copies of the engine's training models (a LoRA model's
adapter replica on its base's shards, a full fine-tune's shards), and a loop that executes rank 0's commands
in order (``channel``), joining each call's collectives. It decides nothing and
talks to nobody but its group."""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from treadle.common.engine.domain import ForwardResult
from treadle.workers.device import device
from treadle.workers.engine.base_models import BaseModelRegistry, parse_dtype
from treadle.workers.engine.config import EngineConfig
from treadle.workers.group import collectives
from treadle.workers.group.channel import CommandChannel, RankGone
from treadle.workers.group.commands import (
    RankCommand,
    RankStop,
    ReplicaBatch,
    ReplicaCreate,
    ReplicaDelete,
    ReplicaForwardBackward,
    ReplicaForwardLogprobs,
    ReplicaGather,
    ReplicaLoadState,
    ReplicaOptimStep,
)
from treadle.workers.trainer import fsdp, sharded_batching, trainer, whole
from treadle.workers.trainer.batching import BatchCall
from treadle.workers.trainer.sharded_base import ShardedBases
from treadle.workers.trainer.trainer import TrainingModel

log = logging.getLogger("treadle.group")


class Replicas:
    """One rank's copies of the training models, and what each command does to them."""

    def __init__(self, config: EngineConfig, where: torch.device) -> None:
        self.bases = BaseModelRegistry(config.base_models, where)
        self.models: dict[str, TrainingModel] = {}
        #: the LoRA bases sharded over the group (this rank's shards of them)
        self.sharded = ShardedBases()

    def run(self, command: RankCommand) -> bool:
        """Execute one command; False: stop."""
        if isinstance(command, RankStop):
            return False
        if isinstance(command, ReplicaCreate):
            base = self.bases.get(command.spec.base_model, parse_dtype(command.spec.dtype))
            model = TrainingModel(
                command.spec,
                base,
                max_context=command.max_context,
                checkpoint_activations=command.checkpoint_activations,
                memory_limit_bytes=command.memory_limit_bytes,
                base_params=self.sharded.params_of(base),
            )
            self.models[command.spec.model_id] = model
            collectives.made(model, self.sharded)
        elif isinstance(command, ReplicaDelete):
            self.models.pop(command.model_id, None)
        elif isinstance(command, ReplicaForwardBackward):
            outcome: ForwardResult | Exception | None = None
            model = self.models[command.model_id]
            if model.sharding is not None:  # joins the gathers even with no datums
                outcome = collectives.forward_backward(model, command.op, self.sharded)
            else:
                try:
                    if command.op.data:
                        outcome = trainer.forward_backward(model, command.op)
                except Exception as err:  # rank 0 reports it (and breaks the group)
                    outcome = err
            dist.gather_object(outcome, None, dst=0)
        elif isinstance(command, ReplicaBatch):
            calls = [BatchCall(self.models[mid], op) for mid, op in command.members]
            sharded_batching.run_shares(calls, no_grad_pass=command.no_grad_pass)
            dist.gather_object([call.outcome for call in calls], None, dst=0)
        elif isinstance(command, ReplicaForwardLogprobs):
            model = self.models[command.model_id]
            logprobs = collectives.forward_logprobs(model, command.op, self.sharded)
            dist.gather_object(logprobs, None, dst=0)
        elif isinstance(command, ReplicaOptimStep):
            model = self.models[command.model_id]
            if collectives.replicated(model):  # a sharded model's were reduce-scattered
                collectives.sum_gradients(model)
            try:
                model.optim_step(command.adam)
                ok = True
            except Exception:  # rank 0 breaks the group: the replicas no longer agree
                log.exception("group: rank %d: optim_step failed", dist.get_rank())
                ok = False
            collectives.all_ok(ok, model.params.device)
        elif isinstance(command, ReplicaLoadState):
            model = self.models[command.model_id]
            if collectives.replicated(model):
                collectives.broadcast_state(model)
            else:  # whole while rank 0's state arrives, then sharded again
                fsdp.unshard(model)
                collectives.made(model, self.sharded)
        elif isinstance(command, ReplicaGather):
            whole.join(self.models[command.model_id], moments=command.moments)
        return True


def serve_rank(channel: CommandChannel, config: EngineConfig, where: torch.device) -> None:
    """Execute rank 0's commands until it says stop or is gone."""
    if config.threads > 0:
        torch.set_num_threads(config.threads)
    replicas = Replicas(config, where)
    while True:
        try:
            command = channel.take()
        except RankGone:
            log.warning("group: rank 0 is gone; rank %d exits", channel.rank)
            return
        if not replicas.run(command):
            return


def resolve_rank_device(config: EngineConfig, local_rank: int) -> torch.device:
    """CUDA: the rank's own GPU (``cuda:<local rank>``); else the engine's device."""
    where = device.resolve(config.device)
    return torch.device("cuda", local_rank) if where.type == "cuda" else where
