"""Three tenants' LoRA calls batched in one pass on a worker of 2 ranks (the base
sharded with FSDP2, ``workers.trainer.sharded_batching``) equal the same calls on
a one-rank worker, through the engine a worker runs (``build_engine``; the 2-rank
engine spawns a second process on gloo).

Every call is submitted before the engine starts, so the scheduler's rounds hold
several tenants' calls up to each model's barrier, and the engine runs them as
batched passes (``batch_across_models``, the default) on both workers. The calls:
``forward_backward`` with a KL penalty (the base's logprobs filled in by the
pass), of one datum (rank 1's share is empty), ``forward_logprobs`` of a model
and of the base, a call refused for a bad token in its second datum and one for
a bad loss setting (each fails alone, with one rank's message), optimizer steps,
then ``forward_logprobs`` under the stepped adapters. Losses, metrics, logprobs,
errors and step metrics equal the one-rank worker's, and so do the adapters and
Adam moments rank 0 holds after the steps (float64). The passes were batched:
the engine's pass counter (``GetServerInfo``'s ``training_pass_metrics``) counts
batched passes of 3 calls or more, and on 2 ranks those ran through the sharded
base (every call's share on each rank in one pass).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.unit.engine_ops import random_datum
from treadle.common.engine.domain import (
    AdamConfig,
    DatumData,
    ForwardBackwardOp,
    ForwardLogprobsOp,
    ModelSpec,
    OptimStepOp,
    OrderedOp,
)
from treadle.errors import InvalidArgumentError
from treadle.workers.engine.config import EngineConfig
from treadle.workers.group.launch import build_engine
from treadle.workers.model.tiny import build_tiny_model
from treadle.workers.trainer import sharded_batching

pytestmark = pytest.mark.slow

TOLERANCE = 1e-10
SPECS = [
    ModelSpec("a", "tenant-a", "m", 4, 0.0, 1, "float64"),
    ModelSpec("b", "tenant-b", "m", 2, 8.0, 2, "float64"),
    ModelSpec("c", "tenant-c", "m", 4, 0.0, 3, "float64", train_attn=False),
]


def _plan() -> list[tuple[str, OrderedOp]]:
    rng = np.random.default_rng(5)

    def data(*lengths: int) -> tuple[DatumData, ...]:
        return tuple(random_datum(rng, n) for n in lengths)

    bad = data(6, 8)
    bad[1].tokens[3] = 10_000  # outside the vocabulary, in rank 1's share
    adam = OptimStepOp(AdamConfig(learning_rate=2e-2, weight_decay=0.01, grad_clip_norm=1.0))
    kl = {"kl_beta": 0.1}
    return [
        ("a", ForwardBackwardOp(data(7, 12, 5), "importance_sampling", kl)),
        ("a", ForwardBackwardOp(data(9), "cross_entropy", {})),  # rank 1: none
        ("a", adam),
        ("a", ForwardLogprobsOp(data(8, 4))),  # after the step: the new adapter
        ("b", ForwardBackwardOp(data(6, 10), "ppo", kl, temperature=0.9)),
        ("b", ForwardLogprobsOp(data(11), reference=True)),  # the base
        ("b", ForwardBackwardOp(bad, "cross_entropy", {})),  # refused: data[1]
        ("b", adam),
        ("b", ForwardLogprobsOp(data(5, 7, 9))),
        ("c", ForwardLogprobsOp(data(4, 13, 6), temperature=1.2)),
        ("c", ForwardBackwardOp(data(5), "cross_entropy", {"nonsense": 1.0})),  # refused
        ("c", ForwardBackwardOp(data(9, 3), "importance_sampling", {})),
        ("c", adam),
        ("c", ForwardLogprobsOp(data(10, 2))),
    ]


def _run(
    model_dir: Path, ranks: int, monkeypatch: pytest.MonkeyPatch
) -> tuple[list[Any], dict[str, dict[str, torch.Tensor]], list[int], list[int]]:
    """Outcomes in plan order, each model's adapter and moments after the steps, the
    calls of every batched pass the engine counted, and those of every pass run
    through the sharded base (this process is rank 0)."""
    sharded: list[int] = []
    real = sharded_batching.run_shares

    def spy(calls: Any, **kwargs: Any) -> None:
        sharded.append(len(calls))
        real(calls, **kwargs)

    monkeypatch.setattr(sharded_batching, "run_shares", spy)
    engine = build_engine(EngineConfig(base_models={"m": model_dir}, ranks=ranks, threads=1))
    try:
        created = [engine.create_model(spec) for spec in SPECS]
        seq = {spec.model_id: 0 for spec in SPECS}
        futures = []
        for model_id, op in _plan():  # all queued before the engine's first round
            seq[model_id] += 1
            futures.append(engine.submit(model_id, seq[model_id], op, f"{model_id}{seq[model_id]}"))
        engine.start()
        for fut in created:
            fut.result(timeout=120)
        outcomes = []
        for fut in futures:
            err = fut.exception(timeout=120)
            outcomes.append(err if err is not None else fut.result())
        state = {}
        for spec in SPECS:
            opt = engine.models[spec.model_id].optimizer
            state[spec.model_id] = {
                **{f"w {n}": t.detach().clone() for n, t in opt.params.items()},
                **{f"m {n}": t.clone() for n, t in opt.exp_avg.items()},
                **{f"v {n}": t.clone() for n, t in opt.exp_avg_sq.items()},
            }
        batched = [s.max_calls_per_pass for s in engine.pass_metrics() if s.batched_passes]
    finally:
        engine.stop()
        monkeypatch.undo()
    return outcomes, state, batched, sharded


def test_three_tenants_batched_on_two_ranks_equal_one_rank(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model_dir = build_tiny_model(tmp_path / "tiny", "tiny", 0)
    two, state_two, batched_two, sharded_two = _run(model_dir, 2, monkeypatch)
    one, state_one, batched_one, sharded_one = _run(model_dir, 1, monkeypatch)

    # batched on both; on 2 ranks through the sharded base, several calls a pass
    assert batched_one and max(batched_one) >= 3
    assert batched_two and max(batched_two) >= 3
    assert sharded_two and max(sharded_two) >= 3 and not sharded_one

    for (model_id, op), got, want in zip(_plan(), two, one, strict=True):
        what = f"{model_id} {op.kind}"
        if isinstance(want, Exception):
            assert type(got) is type(want) and str(got) == str(want), what
            continue
        assert not isinstance(got, Exception), (what, got)
        metrics_got, metrics_want = getattr(got, "metrics", {}), getattr(want, "metrics", {})
        assert metrics_got.keys() == metrics_want.keys(), what
        for key, value in metrics_want.items():
            if key == "compute_s":
                continue
            np.testing.assert_allclose(
                metrics_got[key], value, rtol=TOLERANCE, err_msg=f"{what} {key}"
            )
        for lp_got, lp_want in zip(
            getattr(got, "logprobs", ()), getattr(want, "logprobs", ()), strict=True
        ):
            np.testing.assert_allclose(lp_got, lp_want, rtol=0, atol=TOLERANCE, err_msg=what)
    # the refusals: alone, and named as one rank names them
    assert isinstance(one[6], InvalidArgumentError) and "data[1].model_input" in str(one[6])
    assert isinstance(one[10], InvalidArgumentError) and "nonsense" in str(one[10])

    for model_id, tensors in state_one.items():
        assert state_two[model_id].keys() == tensors.keys()
        for name, t in tensors.items():
            torch.testing.assert_close(
                state_two[model_id][name], t, rtol=0, atol=TOLERANCE, msg=f"{model_id} {name}"
            )
