"""A full fine-tune sharded with FSDP2 (``workers.trainer.fsdp``) on 2 ranks equals
one rank's pass where the SDK test does not look: tied embeddings (the head's
gradient and the embedding's added in one parameter), q/k norms and q/k/v
biases (qwen3, qwen2), a call of one datum (rank 1 has none and joins FSDP's
all-gathers and reduce-scatters with a zero loss), and a loss with a KL
penalty (the base's reference logprobs filled in on each rank). Losses,
metrics, gradient norms and the logprobs after the steps, float64, through the engine a worker runs
(``build_engine``); the 2-rank engine spawns a second process on gloo.
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
)
from treadle.workers.engine.config import EngineConfig
from treadle.workers.group.launch import build_engine
from treadle.workers.model.tiny import build_tiny_model

pytestmark = pytest.mark.slow

TOLERANCE = 1e-10
MODELS = {
    "tied": ("llama", {"tie_word_embeddings": True}),
    "qwen3": ("qwen3", {}),
    "qwen2": ("qwen2", {}),
}


def _datum(rng: np.random.Generator, length: int, *, policy: bool) -> DatumData:
    inputs = {"target_tokens": rng.integers(3, 60, length), "weights": np.ones(length)}
    if policy:
        inputs |= {"logprobs": -rng.random(length), "advantages": rng.normal(size=length)}
    return DatumData(rng.integers(3, 60, length), inputs)


def _calls() -> list[object]:
    rng = np.random.default_rng(0)
    one = (_datum(rng, 9, policy=False),)  # one datum: rank 1's share is empty
    three = tuple(_datum(rng, n, policy=True) for n in (7, 12, 5))
    adam = OptimStepOp(AdamConfig(learning_rate=1e-2, weight_decay=0.01, grad_clip_norm=1.0))
    kl = {"kl_beta": 0.1}  # the base's logprobs as the reference: filled in by the engine
    return [
        ForwardBackwardOp(one, "cross_entropy", {}),
        adam,
        ForwardBackwardOp(three, "importance_sampling", kl),
        ForwardBackwardOp(one, "cross_entropy", {}),  # a second call adds to the gradient
        adam,
        ForwardLogprobsOp(three + one),
        ForwardLogprobsOp(one, temperature=0.7),  # rank 1 has no datum
        ForwardLogprobsOp(three, reference=True),  # the base, sharded on first use
    ]


def _run(model_dir: Path, ranks: int) -> tuple[list[object], bool]:
    engine = build_engine(
        EngineConfig(base_models={"m": model_dir}, ranks=ranks, threads=1)
    ).start()
    try:
        engine.create_model(ModelSpec("full", "t", "m", 0, 0.0, 1, "float64")).result(timeout=120)
        results = [
            engine.submit("full", seq, op, f"c{seq}").result(timeout=120)  # type: ignore[arg-type]
            for seq, op in enumerate(_calls(), start=1)
        ]
        return results, engine.models["full"].sharding is not None
    finally:
        engine.stop()


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_two_sharded_ranks_equal_one(tmp_path: Path, kind: str) -> None:
    arch, overrides = MODELS[kind]
    model_dir = build_tiny_model(tmp_path / kind, "tiny", 0, arch, overrides=overrides)
    two, sharded = _run(model_dir, 2)
    one, _ = _run(model_dir, 1)
    assert sharded
    for a, b in zip(two, one, strict=True):
        metrics_a, metrics_b = getattr(a, "metrics", {}), getattr(b, "metrics", {})
        assert metrics_a.keys() == metrics_b.keys()
        for key in metrics_b:
            np.testing.assert_allclose(metrics_a[key], metrics_b[key], rtol=TOLERANCE, err_msg=key)
        for lp_a, lp_b in zip(getattr(a, "logprobs", ()), getattr(b, "logprobs", ()), strict=True):
            np.testing.assert_allclose(lp_a, lp_b, rtol=0, atol=TOLERANCE)
    assert one[2].metrics["kl_ref:mean"] > 0  # type: ignore[attr-defined]  # the KL is used
