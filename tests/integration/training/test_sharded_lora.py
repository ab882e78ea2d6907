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

Then each model saves its state and reads it back as ``reference_weights``, and
is exported merged (its base read one whole tensor at a time): the files equal
the one rank's. With ``--sampler vllm`` (which loads its own copy of the base)
rank 0 keeps no whole base at all: its LoRA models read the base's shards, the
whole reads gather them a tensor at a time, and the answers are the same.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.tensor import DTensor

from tests.conftest import vllm_skip_reason
from treadle.common.engine.domain import (
    AdamConfig,
    DatumData,
    ForwardBackwardOp,
    ForwardLogprobsOp,
    ModelSpec,
    OptimStepOp,
    ReferenceWeights,
    SaveStateOp,
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


def _calls(seed: int, other: str, state: Path) -> list[object]:
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
        SaveStateOp("s", str(state)),
        ForwardLogprobsOp(three, reference_weights=ReferenceWeights("s", directory=str(state))),
    ]


def _run(
    model_dir: Path, ranks: int, out: Path, sampler: str = "torch"
) -> tuple[dict[str, list[object]], bool]:
    config = EngineConfig(base_models={"m": model_dir}, ranks=ranks, threads=1, sampler=sampler)
    engine = build_engine(config).start()
    try:
        for spec in SPECS:
            engine.create_model(spec).result(timeout=120)
        calls = {
            spec.model_id: _calls(seed=i, other=SPECS[1 - i].model_id, state=out / spec.model_id)
            for i, spec in enumerate(SPECS)
        }
        results: dict[str, list[object]] = {spec.model_id: [] for spec in SPECS}
        for seq in range(1, len(calls["a"]) + 1):  # the two tenants' calls alternate
            for spec in SPECS:
                op = calls[spec.model_id][seq - 1]
                outcome = engine.submit(spec.model_id, seq, op, f"{spec.model_id}{seq}")  # type: ignore[arg-type]
                results[spec.model_id].append(outcome.result(timeout=120))
        for spec in SPECS:
            merged = out / "merged" / spec.model_id
            engine.export_weights(spec.model_id, merged, merged=True).result(timeout=120)
        a, b = engine.models["a"], engine.models["b"]
        shared = a.sharding is not None and a.sharding is b.sharding and a.sharding.frozen
        # rank 0 keeps a whole base only for a sampler that reads it (the torch one)
        whole_base = sampler == "torch"
        assert engine.bases.loaded("m", torch.float64) == whole_base
        assert isinstance(a.params.embed_tokens, DTensor) == (ranks > 1 and not whole_base)
        return results, shared
    finally:
        engine.stop()


@pytest.mark.parametrize("sampler", ["torch", "vllm"])
@pytest.mark.parametrize("arch", ["llama", "tied"])
def test_two_tenants_lora_on_one_sharded_base_equal_one_rank(
    tmp_path: Path, arch: str, sampler: str
) -> None:
    if sampler == "vllm" and (reason := vllm_skip_reason()) is not None:
        pytest.skip(reason)
    overrides = {"tie_word_embeddings": True} if arch == "tied" else {}
    model_dir = build_tiny_model(tmp_path / arch, "tiny", 0, overrides=overrides)
    two, shared = _run(model_dir, 2, tmp_path / "two", sampler)
    one, _ = _run(model_dir, 1, tmp_path / "one")
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
    # the merged exports: the same files (the head adapted: a tied model's comes untied)
    for model_id in ("a", "b"):
        got = load_file(tmp_path / "two" / "merged" / model_id / "model.safetensors")
        want = load_file(tmp_path / "one" / "merged" / model_id / "model.safetensors")
        assert got.keys() == want.keys() and "lm_head.weight" in want
        for name, t in want.items():
            torch.testing.assert_close(got[name], t, rtol=0, atol=TOLERANCE)
        config = "config.json"
        assert (tmp_path / "two" / "merged" / model_id / config).read_text() == (
            tmp_path / "one" / "merged" / model_id / config
        ).read_text()
    # the saved state read back as the reference: the model's own logprobs then
    np.testing.assert_allclose(
        two["a"][-1].logprobs[0],  # type: ignore[attr-defined]
        two["a"][8].logprobs[0],  # type: ignore[attr-defined]
        rtol=0,
        atol=TOLERANCE,
    )
