"""Rank 0's side of a group (``engine.peers.Peers``): each state-changing call is
handed to every other rank (``channel``), then run here and on them alike
(SPMD), the collectives joining the ranks' parts (``collectives``).

A ``ForwardBackward``'s datums are split across the ranks (data parallel). A
full fine-tune is sharded with FSDP2 (``trainer.fsdp``): each rank holds 1/N of
its weights, gradients and Adam moments; FSDP all-gathers each layer's weights
for a ``ForwardBackward`` and reduce-scatters the gradient. A LoRA model's frozen
base is sharded the same way, once per base for every LoRA model on it
(``trainer.sharded_base``); its adapter is replicated on every rank, the
gradients summed at the optimizer step, so every rank takes the same step.
A ``ForwardLogprobs`` runs the same way, without gradient: its datums split
across the ranks, each share through the sharded weights (the model's, or its
base for ``reference`` and a reference adapter, which rank 0 broadcasts), the
results gathered here in datum order. Only rank 0 samples, saves and exports:
a checkpoint, a merged export and a full fine-tune's published version walk the
model one whole tensor at a time (``whole_tensors``: each gathered, written or
copied, dropped). Rank 0 keeps a LoRA base whole beside its shards only for a sampler that reads it there (the
torch samplers; ``use_sampler``). What a call is checked for (data, loss
inputs, the memory of each rank's share) is checked here, for every share,
before any rank starts, so a refused call changes no rank.

A collective that fails (a rank died, or hung past ``--collective-timeout``)
fails the call UNAVAILABLE and breaks the group: every later call fails
UNAVAILABLE at once, and the worker stops so that its supervisor restarts it
(the models come back from their checkpoints and the ops log, as after any
worker restart).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

import torch.distributed as dist

from treadle.common.engine.domain import (
    AdamConfig,
    ForwardBackwardOp,
    ForwardLogprobsOp,
    ForwardResult,
    LoadResult,
    OptimStepResult,
)
from treadle.errors import InternalError, TreadleError, UnavailableError
from treadle.workers.engine.base_models import BaseModel
from treadle.workers.engine.peers import Peers
from treadle.workers.engine.versions import WeightSnapshot
from treadle.workers.group import collectives
from treadle.workers.group.channel import CommandChannel
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
from treadle.workers.model.params import LlamaParams
from treadle.workers.sampler.backend import SamplerBackend
from treadle.workers.trainer import checkpoint, fsdp, sharded_batching, trainer, whole
from treadle.workers.trainer.batching import BatchableOp, BatchCall
from treadle.workers.trainer.sharded_base import KeepWhole, ShardedBases, ShardsOnly
from treadle.workers.trainer.trainer import TrainingModel
from treadle.workers.trainer.validation import check_adam
from treadle.workers.trainer.whole import WholeTensors

log = logging.getLogger("treadle.group")
T = TypeVar("T")
_Op = TypeVar("_Op", ForwardBackwardOp, ForwardLogprobsOp)


class GroupPeers(Peers):
    def __init__(
        self,
        channel: CommandChannel,
        on_broken: Callable[[str], None] | None = None,
        on_closed: Callable[[], None] | None = None,
    ) -> None:
        self.channel = channel
        self.size = channel.world_size
        #: the bases sharded over the group, one for every model on each; rank 0 keeps
        #: a LoRA base whole beside its shards unless its sampler does not read it
        self.bases = ShardedBases(KeepWhole())
        #: why the group cannot run calls any more ("" while it can)
        self.broken = ""
        self._on_broken = on_broken
        self._on_closed = on_closed

    # ---- Peers ---------------------------------------------------------------------------

    def created(self, model: TrainingModel) -> None:
        command = ReplicaCreate(
            model.spec,
            model.max_context,
            model.checkpoint_activations,
            model.memory_limit_bytes,
        )
        self._all(command, lambda: collectives.made(model, self.bases))

    def deleted(self, model_id: str) -> None:
        if not self.broken:
            self.channel.post([ReplicaDelete(model_id)] * (self.size - 1))

    def forward_backward(self, model: TrainingModel, op: ForwardBackwardOp) -> ForwardResult:
        self._check()
        trainer.check_call(model, op)  # the whole call first: one rank's messages
        shares = self._shares(op)
        for share in shares:  # every share is checked before any rank starts
            if share.data:
                trainer.prepare_forward_backward(model, share)
        self.channel.post([ReplicaForwardBackward(model.spec.model_id, s) for s in shares[1:]])
        mine: ForwardResult | None = None
        failed: Exception | None = None
        if model.sharding is not None:
            outcome = self._collective(
                lambda: collectives.forward_backward(model, shares[0], self.bases)
            )
            if isinstance(outcome, Exception):
                failed = outcome
            else:
                mine = outcome
        else:
            try:
                mine = trainer.forward_backward(model, shares[0]) if shares[0].data else None
            except Exception as err:  # reported after the gather: the others wait on it
                failed = err
        gathered: list[object] = [None] * self.size
        self._collective(lambda: dist.gather_object(mine, gathered, dst=0))
        if failed is not None:
            raise self._diverged(f"rank 0: {type(failed).__name__}: {failed}") from failed
        errors = [g for g in gathered if isinstance(g, BaseException)]
        if errors:
            raise self._diverged(str(errors[0]))
        return collectives.merge_results(
            [g if isinstance(g, ForwardResult) else None for g in gathered]
        )

    def run_batch(self, calls: Sequence[BatchCall], check: Callable[[BatchableOp], None]) -> None:
        ready: list[tuple[BatchCall, list[BatchableOp]]] = []
        no_grad_pass = False
        for call in calls:  # every call and every share checked before any rank starts
            try:
                self._check()
                check(call.op)
                trainer.check_call(call.model, call.op)
                shares = self._shares(call.op)
                if isinstance(call.op, ForwardLogprobsOp):
                    no_grad_pass = True
                else:
                    for share in shares:
                        if share.data:
                            prep = trainer.prepare_forward_backward(call.model, share)
                            no_grad_pass = no_grad_pass or prep.needs_reference
            except TreadleError as err:  # this call fails alone
                call.outcome = err
                continue
            ready.append((call, shares))
        if not ready:
            return
        members = [call for call, _ in ready]
        try:
            sharded_batching.shared_base(members)
            self.channel.post(
                [
                    ReplicaBatch(
                        tuple((call.model.spec.model_id, shares[r]) for call, shares in ready),
                        no_grad_pass,
                    )
                    for r in range(1, self.size)
                ]
            )
            mine = [BatchCall(call.model, shares[0]) for call, shares in ready]
            self._collective(lambda: sharded_batching.run_shares(mine, no_grad_pass=no_grad_pass))
            gathered: list[Any] = [None] * self.size
            self._collective(
                lambda: dist.gather_object([call.outcome for call in mine], gathered, dst=0)
            )
        except TreadleError as err:  # the group broke (or a model is not on a sharded base)
            for call in members:
                call.outcome = err
            return
        for i, call in enumerate(members):
            outcomes = [per_rank[i] for per_rank in gathered]
            errors = [o for o in outcomes if isinstance(o, Exception)]
            call.outcome = (
                errors[0]  # a share failed: the call failed, on every rank left out of the sum
                if errors
                else collectives.merge_results(
                    [o if isinstance(o, ForwardResult) else None for o in outcomes]
                )
            )

    def forward_logprobs(
        self, model: TrainingModel, op: ForwardLogprobsOp, weights: WeightSnapshot | None
    ) -> ForwardResult:
        self._check()
        if model.sharding is None or (weights is not None and weights.adapter is None):
            # a model held whole, or a reference that is a whole copy here already
            return trainer.forward_logprobs(model, op, weights)
        shares = self._shares(op)
        self.channel.post([ReplicaForwardLogprobs(model.spec.model_id, s) for s in shares[1:]])
        adapter = None if weights is None else weights.adapter
        mine = self._collective(
            lambda: collectives.forward_logprobs(model, shares[0], self.bases, adapter)
        )
        gathered: list[object] = [None] * self.size
        self._collective(lambda: dist.gather_object(mine, gathered, dst=0))
        # nothing changed on any rank: a share's failure fails the call, not the group
        for rank, got in enumerate(gathered):
            if isinstance(got, TreadleError):
                raise got
            if isinstance(got, BaseException):
                raise InternalError(
                    f"forward_logprobs failed on rank {rank}: {type(got).__name__}: {got}"
                )
        return collectives.merge_results(
            [g if isinstance(g, ForwardResult) else None for g in gathered]
        )

    def optim_step(self, model: TrainingModel, adam: AdamConfig) -> OptimStepResult:
        check_adam(adam)
        result: list[OptimStepResult] = []

        failed: list[BaseException] = []

        def step() -> None:
            if collectives.replicated(model):  # a sharded model's were reduce-scattered
                collectives.sum_gradients(model)
            try:
                result.append(model.optim_step(adam))
            except Exception as err:  # e.g. out of memory here only: told to every rank
                failed.append(err)
            if not collectives.all_ok(not failed, model.params.device):
                why = f"rank 0: {failed[0]}" if failed else "another rank failed its step"
                raise self._diverged(why)

        self._all(ReplicaOptimStep(model.spec.model_id, adam), step)
        return result[0]

    def load_state(
        self, model: TrainingModel, directory: str | Path, optimizer: bool
    ) -> LoadResult:
        self._check()
        state = checkpoint.read_state(model, directory, optimizer=optimizer)  # every check
        if collectives.replicated(model):
            loaded = checkpoint.apply_state(model, state)
            self._all(
                ReplicaLoadState(model.spec.model_id), lambda: collectives.broadcast_state(model)
            )
            return loaded
        result: list[LoadResult] = []

        def load() -> None:  # every rank: whole, rank 0's state everywhere, sharded again
            fsdp.unshard(model)
            result.append(checkpoint.apply_state(model, state))
            collectives.made(model, self.bases)

        self._all(ReplicaLoadState(model.spec.model_id), load)
        return result[0]

    def use_sampler(self, sampler: SamplerBackend) -> None:
        # the torch samplers read a LoRA base's whole weights here; vLLM loads its own
        self.bases.keeping = KeepWhole() if sampler.reads_base_weights else ShardsOnly()

    def base_params(self, base: BaseModel) -> LlamaParams | None:
        return self.bases.params_of(base)

    @contextmanager
    def whole_tensors(
        self, model: TrainingModel, *, moments: bool = False
    ) -> Iterator[WholeTensors]:
        tensors = WholeTensors(model, moments=moments)
        if not whole.sharded(model, moments=moments):  # held whole here: nothing to gather
            yield tensors
            return
        self._check()
        self.channel.post([ReplicaGather(model.spec.model_id, moments)] * (self.size - 1))
        try:
            yield tensors  # each read gathers its tensor, the other ranks joining
        finally:
            self._collective(tensors.close)  # what was not read: the others wait on it

    def close(self) -> None:
        if not self.broken:
            self.channel.post([RankStop()] * (self.size - 1))
            self.broken = "the worker stopped"
        if self._on_closed is not None:
            self._on_closed()

    # ---- the group's health ---------------------------------------------------------------

    def _shares(self, op: _Op) -> list[_Op]:
        """The call's datums in one contiguous share per rank (rank 0's first and largest)."""
        return [
            replace(op, data=tuple(op.data[i] for i in r))
            for r in collectives.split(len(op.data), self.size)
        ]

    def _all(self, command: RankCommand, run: Callable[[], None]) -> None:
        self._check()
        self.channel.post([command] * (self.size - 1))
        self._collective(run)

    def _check(self) -> None:
        if self.broken:
            raise UnavailableError(f"the worker's group of ranks is down: {self.broken}")

    def _collective(self, run: Callable[[], T]) -> T:
        try:
            return run()
        except TreadleError:
            raise
        except (RuntimeError, dist.DistError) as err:
            raise self._break(f"a collective failed (a rank died or hung): {err}") from err

    def _diverged(self, why: str) -> UnavailableError:
        # a rank failed where the others did not: their gradients now differ
        return self._break(f"a rank failed its share of the call: {why}")

    def _break(self, why: str) -> UnavailableError:
        self.broken = why
        log.error("group: %s; the worker must restart its group", why)
        if self._on_broken is not None:
            self._on_broken(why)
        return UnavailableError(f"the worker's group of ranks failed: {why}")
