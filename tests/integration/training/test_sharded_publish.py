"""``sync_weights`` of a full fine-tune sharded over 2 ranks (issue 36) publishes the
versions a one-rank worker publishes, each built on rank 0 as its tensors are
gathered one at a time (``Peers.published``): with the torch sampler a copy in
memory, with ``--sampler vllm`` a file vLLM's weight reload reads (no tensor of it
held by the process). Version 0 and a base sampler read no weights on rank 0
with vLLM (vLLM loads the base from its checkpoint). Through the engine a worker
runs (``build_engine``); the 2-rank engine spawns a second process on gloo.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from treadle.common.engine.domain import (
    AdamConfig,
    DatumData,
    ForwardBackwardOp,
    ModelSpec,
    OptimStepOp,
    SamplerTarget,
    SyncWeightsOp,
)
from treadle.workers.engine.config import EngineConfig
from treadle.workers.group.launch import build_engine
from treadle.workers.model.published import WeightsFile
from treadle.workers.model.tiny import build_tiny_model
from treadle.workers.vllm.pool import engine_kind

pytestmark = pytest.mark.slow

TOLERANCE = 1e-10
Versions = dict[int, dict[str, np.ndarray]]


def _calls() -> list[object]:
    rng = np.random.default_rng(0)
    data = tuple(
        DatumData(
            rng.integers(3, 60, n), {"target_tokens": rng.integers(3, 60, n), "weights": np.ones(n)}
        )
        for n in (7, 12, 5)
    )
    step = [
        ForwardBackwardOp(data, "cross_entropy", {}),
        OptimStepOp(AdamConfig(learning_rate=1e-2)),
        SyncWeightsOp(),
    ]
    return [SyncWeightsOp(), *step, *step]  # versions 0, 1, 2


def _run(model_dir: Path, ranks: int, sampler: str) -> Versions:
    config = EngineConfig(base_models={"m": model_dir}, ranks=ranks, threads=1, sampler=sampler)
    engine = build_engine(config).start()
    try:
        engine.create_model(ModelSpec("full", "t", "m", 0, 0.0, 1, "float64")).result(timeout=120)
        for seq, op in enumerate(_calls(), start=1):
            engine.submit("full", seq, op, f"c{seq}").result(timeout=120)  # type: ignore[arg-type]
        assert engine.versions.versions("full") == [0, 1, 2]
        base = engine.bases.get("m", torch.float64)
        for target in (SamplerTarget("m", "full", 0), SamplerTarget("m", None, None)):
            assert engine.check_sampler_target(target).result(timeout=60) == 0
        v0 = engine.versions.get("full", 0)
        assert v0.on_base(base)
        if sampler == "vllm":  # the base's weights: never read (vLLM loads its own)
            assert engine_kind(v0, base, gpu=False) == "base"
            assert not base.loaded
        out: Versions = {}
        for version in (1, 2):
            snap = engine.versions.get("full", version)
            assert isinstance(snap.weights, WeightsFile) == (sampler == "vllm")
            assert engine_kind(snap, base, gpu=False) == "full:full"
            out[version] = {n: t.numpy().copy() for n, t in snap.params.named_tensors()}
        assert engine.models["full"].sharding is not None or ranks == 1
        return out
    finally:
        engine.stop()


@pytest.mark.parametrize("sampler", ["torch", "vllm"])
def test_two_sharded_ranks_publish_the_one_rank_versions(tmp_path: Path, sampler: str) -> None:
    model_dir = build_tiny_model(tmp_path / "m", "tiny", 0, "llama")
    two = _run(model_dir, 2, sampler)
    one = _run(model_dir, 1, "torch")
    for version, tensors in one.items():
        assert two[version].keys() == tensors.keys()
        for name, want in tensors.items():
            np.testing.assert_allclose(two[version][name], want, rtol=0, atol=TOLERANCE)
    assert not all(np.array_equal(one[1][n], one[2][n]) for n in one[1])  # they moved
