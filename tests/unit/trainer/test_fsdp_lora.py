"""A LoRA model's frozen base sharded over 2 ranks with FSDP2
(``workers.trainer.sharded_base``, issue 36) equals the same model on one rank.

Two real processes on gloo. Each holds two LoRA models (two tenants' adapters,
different seeds) on one base sharded once: both models' ``sharding`` is the same
FSDP root, its tensors DTensors of which each rank keeps its rows (half of the
base's elements, at most a row more per tensor), frozen (no gradient). Rank 1
no longer holds the whole base (dropped once sharded); rank 0 keeps it (its
sampler and whole reads). Each rank also holds the same two models whole (the
one-rank twins, fed every datum). Three rounds of calls, alternating the two
models: a call of three datums with a KL penalty (the base's reference logprobs
through the sharded base), one of a single datum (rank 1 has none and joins the
all-gathers with a zero loss), then each model's step with its adapter's
gradients summed over the ranks: the losses add up to the twin's, and every
adapter and Adam moment equals its twin's. float64: agreement to rounding.

Then ``forward_logprobs`` runs on the sharded base too, each rank its share of
the datums (a call of one datum: rank 1 has none and joins the all-gathers), the
results gathered in datum order: of each model (its adapter), of the base
(``reference``) and of the other tenant's adapter as ``reference_weights`` (rank
0's adapter broadcast to rank 1), each equal to its twin's. Run twice: rank 0
keeping the whole base (``KeepWhole``: its torch sampler reads it), and rank 0
dropping it like rank 1 (``ShardsOnly``: a vLLM sampler loads its own), where
no rank holds the whole base after the first model's creation.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from typing import TypeVar

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from tests.unit.trainer.two_ranks import on_two_ranks
from treadle.common.engine.domain import (
    AdamConfig,
    DatumData,
    ForwardBackwardOp,
    ForwardLogprobsOp,
    ModelSpec,
    ReferenceWeights,
)
from treadle.workers.engine.base_models import BaseModelRegistry
from treadle.workers.engine.versions import WeightSnapshot
from treadle.workers.group import collectives
from treadle.workers.model.tiny import build_tiny_model
from treadle.workers.trainer import fsdp, trainer
from treadle.workers.trainer.sharded_base import KeepWhole, ShardedBases, ShardsOnly
from treadle.workers.trainer.trainer import TrainingModel

pytestmark = pytest.mark.slow

ROUNDS = 3
_Op = TypeVar("_Op", ForwardBackwardOp, ForwardLogprobsOp)
ADAM = AdamConfig(learning_rate=1e-2, weight_decay=0.1, grad_clip_norm=0.5)
SPECS = [
    ModelSpec("a", "tenant-a", "tiny", 4, 0.0, 1, "float64"),
    ModelSpec("b", "tenant-b", "tiny", 2, 0.0, 2, "float64"),
]
TOLERANCE = 1e-10


def _datum(rng: np.random.Generator, length: int) -> DatumData:
    inputs = {
        "target_tokens": rng.integers(3, 60, length),
        "weights": np.ones(length),
        "logprobs": -rng.random(length),
        "advantages": rng.normal(size=length),
    }
    return DatumData(rng.integers(3, 60, length), inputs)


def _calls(seed: int) -> list[ForwardBackwardOp]:
    rng = np.random.default_rng(seed)
    three = tuple(_datum(rng, n) for n in (7, 12, 5))  # shares of 2 and 1
    one = (_datum(rng, 9),)  # rank 1's share is empty
    kl = {"kl_beta": 0.1}  # the base's reference logprobs, through the sharded base
    return [
        ForwardBackwardOp(three, "importance_sampling", kl),
        ForwardBackwardOp(one, "importance_sampling", kl),
        ForwardBackwardOp(one, "cross_entropy", {}),
    ]


def _share(op: _Op, rank: int) -> _Op:
    first = -(-len(op.data) // 2)  # rank 0 takes the larger share
    return replace(op, data=op.data[:first] if rank == 0 else op.data[first:])


def _forward_calls() -> list[ForwardLogprobsOp]:
    rng = np.random.default_rng(7)
    three = tuple(_datum(rng, n) for n in (7, 12, 5))
    one = (_datum(rng, 9),)  # rank 1's share is empty
    other = ReferenceWeights("treadle://b/v/3", model_id="b", version=3)
    return [
        ForwardLogprobsOp(three),
        ForwardLogprobsOp(one, temperature=0.7),
        ForwardLogprobsOp(three, reference=True),
        ForwardLogprobsOp(one, reference=True),
        ForwardLogprobsOp(three, reference_weights=other),
        ForwardLogprobsOp(one, reference_weights=other),
    ]


def _check_forward_logprobs(
    rank: int, mine: list[TrainingModel], twins: list[TrainingModel], bases: ShardedBases
) -> None:
    for op in _forward_calls():
        reference = None
        if op.reference_weights is not None:  # model b's adapter, rank 0's broadcast
            reference = WeightSnapshot(None, 3, twins[1].params, twins[1].adapter)
        got = collectives.forward_logprobs(
            mine[0],
            _share(op, rank),
            bases,
            None if reference is None or rank != 0 else mine[1].adapter,
        )
        assert not isinstance(got, Exception), got
        gathered: list[object] = [None, None]
        dist.all_gather_object(gathered, got)
        merged = collectives.merge_results([g for g in gathered if g is not None])  # type: ignore[misc]
        want = trainer.forward_logprobs(twins[0], op, reference)
        assert len(merged.logprobs) == len(op.data)
        for lp_got, lp_want in zip(merged.logprobs, want.logprobs, strict=True):
            np.testing.assert_allclose(lp_got, lp_want, rtol=0, atol=TOLERANCE)
    # the two adapters differ: the reference read b's, not a's
    assert not np.allclose(
        trainer.forward_logprobs(twins[0], _forward_calls()[0]).logprobs[0],
        trainer.forward_logprobs(twins[1], _forward_calls()[0]).logprobs[0],
    )


def _rank(rank: int, model_dir: Path, keep: bool) -> None:
    base = BaseModelRegistry({"tiny": model_dir}).get("tiny", torch.float64)
    whole_base = {n: t.clone() for n, t in base.params.named_tensors()}
    # the twins read a base of their own: rank 0 may drop the shared one
    twin_base = BaseModelRegistry({"tiny": model_dir}).get("tiny", torch.float64)
    twins = [TrainingModel(spec, twin_base) for spec in SPECS]
    bases = ShardedBases(KeepWhole() if keep and rank == 0 else ShardsOnly())
    mine: list[TrainingModel] = []
    for spec in SPECS:
        model = TrainingModel(spec, base, base_params=bases.params_of(base))
        collectives.made(model, bases)
        mine.append(model)

    # one sharded base for both models: DTensors, this rank's rows, frozen
    sharding = mine[0].sharding
    assert isinstance(sharding, fsdp.FsdpShards) and sharding.frozen
    assert mine[1].sharding is sharding
    held = 0
    for name, p in sharding.params().named_tensors():
        assert isinstance(p, DTensor) and not p.requires_grad, name
        rows = torch.chunk(whole_base[name], 2, dim=0)[rank]
        torch.testing.assert_close(p.to_local(), rows, rtol=0, atol=0)
        held += p.to_local().numel()
    total = sum(t.numel() for t in whole_base.values())
    assert total / 2 - 64 * 8 <= held <= total / 2 + 64 * 8  # at most a row more a tensor
    # rank 0 keeps the whole base when its sampler reads it; rank 1 only its shards
    kept = keep and rank == 0
    assert base.loaded == kept
    assert all(isinstance(t, DTensor) for _, t in mine[1].params.named_tensors()) == (not kept)

    for r in range(ROUNDS if keep else 1):
        for i in range(len(SPECS)):  # the two tenants' models alternate on one base
            for op in _calls(seed=10 * r + i):
                got = collectives.forward_backward(mine[i], _share(op, rank), bases)
                want = trainer.forward_backward(twins[i], op)
                assert not isinstance(got, Exception), got
                mine_loss = 0.0 if got is None else got.metrics["loss:sum"]
                loss = torch.tensor(mine_loss, dtype=torch.float64)
                dist.all_reduce(loss)  # losses are sums: the ranks' add up to the call's
                assert math.isclose(float(loss), want.metrics["loss:sum"], rel_tol=TOLERANCE)
        for model, twin in zip(mine, twins, strict=True):
            collectives.sum_gradients(model)
            got_step, want_step = model.optim_step(ADAM), twin.optim_step(ADAM)
            for key, value in want_step.metrics.items():
                assert math.isclose(got_step.metrics[key], value, rel_tol=TOLERANCE), key

    _check_forward_logprobs(rank, mine, twins, bases)
    assert base.loaded == kept  # no read loaded the whole base again

    for model, twin in zip(mine, twins, strict=True):
        opt, opt_twin = model.optimizer, twin.optimizer
        assert opt.params.keys() == opt_twin.params.keys()
        for state, state_twin in (
            (opt.params, opt_twin.params),
            (opt.exp_avg, opt_twin.exp_avg),
            (opt.exp_avg_sq, opt_twin.exp_avg_sq),
        ):
            for name, t in state_twin.items():
                torch.testing.assert_close(state[name].detach(), t.detach(), rtol=0, atol=TOLERANCE)
    # the frozen base did not move (rank 0's whole copy and the shards alike)
    for name, p in sharding.params().named_tensors():
        rows = torch.chunk(whole_base[name], 2, dim=0)[rank]
        torch.testing.assert_close(p.to_local(), rows, rtol=0, atol=0)
    if kept:
        for name, t in base.params.named_tensors():
            torch.testing.assert_close(t, whole_base[name], rtol=0, atol=0)


@pytest.mark.parametrize("keep", [True, False], ids=["rank0-keeps-base", "rank0-drops-base"])
def test_lora_on_a_sharded_base_on_two_ranks_equals_one(tmp_path: Path, keep: bool) -> None:
    model_dir = build_tiny_model(tmp_path / "tiny", "tiny", 0)
    on_two_ranks(_rank, model_dir, keep)
