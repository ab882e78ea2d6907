"""Two tenants' LoRA models on one base sharded with FSDP2 over 2 ranks
(``workers.trainer.sharded_base``) each equal their one-rank twin, through the
engine a worker runs (``build_engine``; the 2-rank engine spawns a second
process on gloo).

The two models (different tenants, ranks and seeds) are trained alternately,
call by call: a call of one datum (rank 1 has none and joins the all-gathers
with a zero loss), one with a KL penalty (the base's reference logprobs filled
in through the sharded base on each rank), a second call adding to the
gradient, steps, then ``forward_logprobs`` of the model, of the base and of the
other tenant's model's published version (``reference_weights``: its adapter on
this model's base), each split across the ranks on the sharded base (a call of
one datum: rank 1 has none). Losses, metrics, gradient norms and logprobs,
float64. On 2 ranks both models train on the one sharded base, not a base each.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from treadle.common.engine.domain import (
    AdamConfig,
    DatumData,
    ForwardBackwardOp,
    ForwardLogprobsOp,
    ModelSpec,
    OptimStepOp,
    ReferenceWeights,
    SyncWeightsOp,
)
from treadle.workers.engine.config import EngineConfig
from treadle.workers.group.launch import build_engine
from treadle.workers.model.tiny import build_tiny_model

pytestmark = pytest.mark.slow

TOLERANCE = 1e-10
SPECS = [
    ModelSpec("a", "tenant-a", "m", 4, 0.0, 1, "float64"),
    ModelSpec("b", "tenant-b", "m", 2, 8.0, 2, "float64"),
]


def _datum(rng: np.random.Generator, length: int, *, policy: bool) -> DatumData:
    inputs = {"target_tokens": rng.integers(3, 60, length), "weights": np.ones(length)}
    if policy:
        inputs |= {"logprobs": -rng.random(length), "advantages": rng.normal(size=length)}
    return DatumData(rng.integers(3, 60, length), inputs)


def _calls(seed: int, other: str) -> list[object]:
    rng = np.random.default_rng(seed)
    one = (_datum(rng, 9, policy=False),)  # one datum: rank 1's share is empty
    three = tuple(_datum(rng, n, policy=True) for n in (7, 12, 5))
    adam = OptimStepOp(AdamConfig(learning_rate=2e-2, weight_decay=0.01, grad_clip_norm=1.0))
    kl = {"kl_beta": 0.1}  # the base's logprobs as the reference: filled in by the engine
    return [
        ForwardBackwardOp(one, "cross_entropy", {}),
        adam,
        ForwardBackwardOp(three, "importance_sampling", kl),
        ForwardBackwardOp(one, "cross_entropy", {}),  # a second call adds to the gradient
        adam,
        ForwardBackwardOp(three, "importance_sampling", kl),
        adam,
        SyncWeightsOp(),  # version 3, the other model's reference below
        ForwardLogprobsOp(three + one),
        ForwardLogprobsOp(three, reference=True),
        ForwardLogprobsOp(one, reference=True),
        ForwardLogprobsOp(
            three, reference_weights=ReferenceWeights("v3", model_id=other, version=3)
        ),
        ForwardLogprobsOp(one, reference_weights=ReferenceWeights("v3", model_id=other, version=3)),
    ]


def _run(model_dir: Path, ranks: int) -> tuple[dict[str, list[object]], bool]:
    engine = build_engine(
        EngineConfig(base_models={"m": model_dir}, ranks=ranks, threads=1)
    ).start()
    try:
        for spec in SPECS:
            engine.create_model(spec).result(timeout=120)
        calls = {
            spec.model_id: _calls(seed=i, other=SPECS[1 - i].model_id)
            for i, spec in enumerate(SPECS)
        }
        results: dict[str, list[object]] = {spec.model_id: [] for spec in SPECS}
        for seq in range(1, len(calls["a"]) + 1):  # the two tenants' calls alternate
            for spec in SPECS:
                op = calls[spec.model_id][seq - 1]
                outcome = engine.submit(spec.model_id, seq, op, f"{spec.model_id}{seq}")  # type: ignore[arg-type]
                results[spec.model_id].append(outcome.result(timeout=120))
        a, b = engine.models["a"], engine.models["b"]
        shared = a.sharding is not None and a.sharding is b.sharding and a.sharding.frozen
        return results, shared
    finally:
        engine.stop()


@pytest.mark.parametrize("arch", ["llama", "tied"])
def test_two_tenants_lora_on_one_sharded_base_equal_one_rank(tmp_path: Path, arch: str) -> None:
    overrides = {"tie_word_embeddings": True} if arch == "tied" else {}
    model_dir = build_tiny_model(tmp_path / arch, "tiny", 0, overrides=overrides)
    two, shared = _run(model_dir, 2)
    one, _ = _run(model_dir, 1)
    assert shared  # one sharded base, both tenants' models on it
    for model_id in ("a", "b"):
        for a, b in zip(two[model_id], one[model_id], strict=True):
            metrics_a, metrics_b = getattr(a, "metrics", {}), getattr(b, "metrics", {})
            assert metrics_a.keys() == metrics_b.keys()
            for key in metrics_b:
                np.testing.assert_allclose(
                    metrics_a[key], metrics_b[key], rtol=TOLERANCE, err_msg=f"{model_id} {key}"
                )
            for lp_a, lp_b in zip(
                getattr(a, "logprobs", ()), getattr(b, "logprobs", ()), strict=True
            ):
                np.testing.assert_allclose(lp_a, lp_b, rtol=0, atol=TOLERANCE)
        assert one[model_id][2].metrics["kl_ref:mean"] > 0  # type: ignore[attr-defined]
    # the two adapters differ: each model is its own, not the other's; a's
    # reference_weights (b's adapter) gives other logprobs than a's own, same datum
    own_a, ref_b = two["a"][8].logprobs[0], two["a"][11].logprobs[0]  # type: ignore[attr-defined]
    assert not np.allclose(own_a, two["b"][8].logprobs[0])  # type: ignore[attr-defined]
    assert not np.allclose(own_a, ref_b)
