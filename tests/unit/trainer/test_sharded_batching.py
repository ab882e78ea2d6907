"""A batched pass of several tenants' LoRA calls on a base sharded over 2 ranks
(``workers.trainer.sharded_batching``, issue 36) equals the same batch on one rank.

Two real processes on gloo. Each holds three LoRA models of three tenants on one
base sharded with FSDP2, and the same models whole (the one-rank twins). Each
round, every rank runs its shares of a batch of calls (``run_shares``: each
call's datums split as rank 0 splits them), and the twins run the whole calls in
one one-rank batched pass (``batching.run_batch``); then every model steps, its
adapter's gradients summed over the ranks. The rounds hold: KL penalties whose
reference logprobs the pass fills in, calls of one datum (rank 1's share is
empty: it runs a token in their place), ``forward_logprobs`` of a model and of
the base, two calls of one model, models adapting different modules, a call
whose loss fails on rank 1 only (left out of the sum on both ranks: its model
gets no gradient from it, the others are unaffected), and a round with no
``forward_logprobs`` and no KL (no pass without gradients). Merged results
(logprobs, metrics), step metrics, adapters and Adam moments equal the twins';
the FSDP root runs once per pass (one with gradients, one without), whatever
the number of calls. float64: agreement to rounding.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

from tests.unit.engine_ops import random_datum
from tests.unit.trainer.two_ranks import on_two_ranks
from treadle.common.engine.domain import (
    AdamConfig,
    DatumData,
    ForwardBackwardOp,
    ForwardLogprobsOp,
    ForwardResult,
    ModelSpec,
)
from treadle.errors import InvalidArgumentError
from treadle.workers.engine.base_models import BaseModelRegistry
from treadle.workers.group import collectives
from treadle.workers.model.tiny import build_tiny_model
from treadle.workers.trainer import batching, fsdp, sharded_batching, trainer
from treadle.workers.trainer.batching import BatchCall
from treadle.workers.trainer.sharded_base import ShardedBases
from treadle.workers.trainer.trainer import TrainingModel

pytestmark = pytest.mark.slow

ADAM = AdamConfig(learning_rate=1e-2, weight_decay=0.1, grad_clip_norm=0.5)
SPECS = [
    ModelSpec("a", "tenant-a", "tiny", 4, 0.0, 1, "float64"),
    ModelSpec("b", "tenant-b", "tiny", 2, 0.0, 2, "float64", train_attn=False),
    ModelSpec("c", "tenant-c", "tiny", 4, 8.0, 3, "float64", train_mlp=False),
]
TOLERANCE = 1e-10
FAILS_ON_RANK_1 = "injected: this share's loss fails"


def _rounds() -> list[list[tuple[int, Any]]]:
    """Each round's batch: (model index, call)."""
    rng = np.random.default_rng(7)

    def data(*lengths: int) -> tuple[DatumData, ...]:
        return tuple(random_datum(rng, n) for n in lengths)

    kl = {"kl_beta": 0.1}
    return [
        [
            (0, ForwardBackwardOp(data(7, 12, 5), "importance_sampling", kl)),
            (1, ForwardBackwardOp(data(9), "cross_entropy", {})),  # rank 1: none
            (2, ForwardLogprobsOp(data(6, 11), temperature=0.8)),
            (0, ForwardLogprobsOp(data(8), reference=True)),  # the base, rank 1: none
            (2, ForwardBackwardOp(data(10, 4), "ppo", kl, temperature=1.3)),
            (1, ForwardBackwardOp(data(3, 5, 7, 2), "importance_sampling", {})),
        ],
        [
            (1, ForwardBackwardOp(data(6, 9), "ppo", kl)),
            (2, ForwardBackwardOp(data(8, 7, 3), "cross_entropy", {})),  # fails on rank 1
            (0, ForwardBackwardOp(data(11), "importance_sampling", kl)),
            (2, ForwardLogprobsOp(data(5, 9, 4))),
        ],
        [  # one datum each: rank 1 runs a token for every call; no pass without gradients
            (0, ForwardBackwardOp(data(9), "cross_entropy", {})),
            (1, ForwardBackwardOp(data(4), "cross_entropy", {})),
            (2, ForwardBackwardOp(data(12), "importance_sampling", {})),
        ],
    ]


def _share(op: Any, rank: int) -> Any:
    first = -(-len(op.data) // 2)  # rank 0 takes the larger share
    return replace(op, data=op.data[:first] if rank == 0 else op.data[first:])


def _needs_no_grad_pass(batch: list[tuple[int, Any]]) -> bool:
    return any(
        isinstance(op, ForwardLogprobsOp) or op.loss_config.get("kl_beta", 0.0) > 0
        for _, op in batch
    )


def _merged(calls: list[BatchCall]) -> list[Any]:
    """Every rank's outcomes of each call, as rank 0 merges them (``GroupPeers``)."""
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, [call.outcome for call in calls])
    out = []
    for i in range(len(calls)):
        outcomes = [per_rank[i] for per_rank in gathered]
        errors = [o for o in outcomes if isinstance(o, Exception)]
        out.append(errors[0] if errors else collectives.merge_results(outcomes))
    return out


def _assert_result(got: ForwardResult, want: ForwardResult, what: str) -> None:
    assert got.metrics.keys() == want.metrics.keys(), what
    for key, value in want.metrics.items():
        assert math.isclose(got.metrics[key], value, rel_tol=TOLERANCE, abs_tol=1e-12), (what, key)
    assert len(got.logprobs) == len(want.logprobs), what
    for lp, lp_want in zip(got.logprobs, want.logprobs, strict=True):
        np.testing.assert_allclose(lp, lp_want, rtol=0, atol=TOLERANCE, err_msg=what)


def _rank(rank: int, model_dir: Path) -> None:
    base = BaseModelRegistry({"tiny": model_dir}).get("tiny", torch.float64)
    twins = [TrainingModel(spec, base) for spec in SPECS]
    bases = ShardedBases()
    mine: list[TrainingModel] = []
    for spec in SPECS:
        model = TrainingModel(spec, base, base_params=bases.params_of(base))
        collectives.made(model, bases)
        mine.append(model)
    sharding = mine[0].sharding
    assert isinstance(sharding, fsdp.FsdpShards) and all(m.sharding is sharding for m in mine)
    passes: list[bool] = []  # each FSDP root forward: with gradients or not
    sharding.root.register_forward_pre_hook(lambda *_: passes.append(torch.is_grad_enabled()))

    real_finish = trainer.finish_forward_backward

    def fails_on_rank_1(model: TrainingModel, *args: Any) -> Any:
        if rank == 1 and model.spec.model_id == "c":
            raise InvalidArgumentError(FAILS_ON_RANK_1)
        return real_finish(model, *args)

    for r, batch in enumerate(_rounds()):
        failing = r == 1  # model c's ForwardBackward fails on rank 1's share
        calls = [BatchCall(mine[i], _share(op, rank)) for i, op in batch]
        passes.clear()
        if failing:
            trainer.finish_forward_backward = fails_on_rank_1  # type: ignore[assignment]
        try:
            sharded_batching.run_shares(calls, no_grad_pass=_needs_no_grad_pass(batch))
        finally:
            trainer.finish_forward_backward = real_finish  # type: ignore[assignment]
        assert passes == ([False, True] if _needs_no_grad_pass(batch) else [True])
        got = _merged(calls)

        # the twins: the same batch on one rank, the failing call left out
        twin_calls = [
            BatchCall(twins[i], op)
            for i, op in batch
            if not (failing and SPECS[i].model_id == "c" and isinstance(op, ForwardBackwardOp))
        ]
        batching.run_batch(twin_calls, lambda op: None)
        wanted = iter(twin_calls)
        for (i, op), outcome in zip(batch, got, strict=True):
            what = f"round {r}: {SPECS[i].model_id} {op.kind}"
            if failing and SPECS[i].model_id == "c" and isinstance(op, ForwardBackwardOp):
                assert isinstance(outcome, InvalidArgumentError), what
                assert FAILS_ON_RANK_1 in str(outcome)
                continue
            want = next(wanted).outcome
            assert isinstance(want, ForwardResult) and isinstance(outcome, ForwardResult), what
            _assert_result(outcome, want, what)

        for model, twin in zip(mine, twins, strict=True):
            collectives.sum_gradients(model)
            if failing and model.spec.model_id == "c":  # no gradient from its failed call
                assert all(float(p.grad.abs().max()) == 0.0 for p in model.trainable.values())
            got_step, want_step = model.optim_step(ADAM), twin.optim_step(ADAM)
            for key, value in want_step.metrics.items():
                assert math.isclose(got_step.metrics[key], value, rel_tol=TOLERANCE), (
                    r,
                    key,
                    model.spec.model_id,
                    got_step.metrics[key],
                    value,
                )

    for model, twin in zip(mine, twins, strict=True):
        opt, opt_twin = model.optimizer, twin.optimizer
        for state, state_twin in (
            (opt.params, opt_twin.params),
            (opt.exp_avg, opt_twin.exp_avg),
            (opt.exp_avg_sq, opt_twin.exp_avg_sq),
        ):
            assert state.keys() == state_twin.keys()
            for name, t in state_twin.items():
                torch.testing.assert_close(state[name].detach(), t.detach(), rtol=0, atol=TOLERANCE)


def test_a_batch_on_two_ranks_equals_it_on_one(tmp_path: Path) -> None:
    model_dir = build_tiny_model(tmp_path / "tiny", "tiny", 0)
    on_two_ranks(_rank, model_dir)
