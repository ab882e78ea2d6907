"""A base's weights are in memory only when something needs them: a full fine-tune
holds its own weights once (read from the checkpoint, not a clone of a loaded
base), its version 0 and a base sampler read the base only when a sampler reads
their tensors (the torch samplers; vLLM loads the base itself and never does),
and a LoRA model or a reference forward loads the base as before, with the same
numbers."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from treadle.common.engine.domain import (
    AdamConfig,
    DatumData,
    ForwardBackwardOp,
    ForwardLogprobsOp,
    ModelSpec,
    OptimStepOp,
    SamplerTarget,
)
from treadle.workers.engine.base_models import BaseModelRegistry
from treadle.workers.engine.versions import BaseVersion, VersionStore, WeightSnapshot
from treadle.workers.model.loading import load_checkpoint
from treadle.workers.trainer import trainer
from treadle.workers.trainer.trainer import TrainingModel

torch.set_num_threads(1)

FULL = ModelSpec("full", "t", "tiny", 0, 0.0, 0, "float64")
LORA = ModelSpec("lora", "t", "tiny", 4, 8.0, 0, "float64")


def _datum(seed: int = 0) -> DatumData:
    toks = np.random.default_rng(seed).integers(3, 90, size=13)
    return DatumData(toks[:-1], {"target_tokens": toks[1:], "weights": np.ones(12, np.float32)})


def test_a_full_fine_tune_trains_without_loading_the_base(tiny_model_dir: Path) -> None:
    base = BaseModelRegistry({"tiny": tiny_model_dir}).get("tiny", torch.float64)
    assert not base.loaded
    model = TrainingModel(FULL, base)
    _, want = load_checkpoint(tiny_model_dir, dtype=torch.float64)
    for (n, t), (_, w) in zip(model.params.named_tensors(), want.named_tensors(), strict=True):
        assert torch.equal(t.detach(), w), n
    trainer.forward_backward(model, ForwardBackwardOp((_datum(),), "cross_entropy", {}))
    model.optim_step(AdamConfig(learning_rate=1e-2))
    assert isinstance(model.published(), WeightSnapshot)  # a trained version: a copy
    assert not base.loaded  # one copy of the weights in memory, not two

    # A LoRA model needs the base: loaded now, apart from the full fine-tune's weights.
    TrainingModel(LORA, base)
    assert base.loaded
    assert base.params.embed_tokens.data_ptr() != model.params.embed_tokens.data_ptr()
    assert torch.equal(base.params.embed_tokens, want.embed_tokens)
    assert not torch.equal(model.params.embed_tokens.detach(), want.embed_tokens)
    # a full fine-tune made now clones the loaded base instead of reading the file
    again = TrainingModel(FULL, base)
    assert torch.equal(again.params.embed_tokens.detach(), want.embed_tokens)
    assert again.params.embed_tokens.data_ptr() != base.params.embed_tokens.data_ptr()


def test_version_zero_reads_the_base_only_when_a_sampler_reads_it(tiny_model_dir: Path) -> None:
    base = BaseModelRegistry({"tiny": tiny_model_dir}).get("tiny", torch.float64)
    model = TrainingModel(FULL, base)
    store = VersionStore(keep_latest=2)
    v0 = model.published()
    assert isinstance(v0, BaseVersion) and v0.version == 0
    store.publish(v0)
    assert not base.loaded and store.versions("full") == [0]
    snap = store.get("full", None)
    assert snap.version == 0 and snap.on_base(base) and snap.dtype == torch.float64
    assert not base.loaded  # asked for (a sampler of it made, vLLM's rows): nothing read
    assert store.get("full", 0) is snap  # resolved once, kept in its place
    params = snap.params  # a torch sampler reads its tensors: the base loads now, once
    assert base.loaded and base.holds(params) and snap.params is params
    pairs = zip(params.named_tensors(), model.params.named_tensors(), strict=True)
    for (n, t), (_, w) in pairs:
        assert torch.equal(t, w.detach()), n


def test_the_engine_keeps_a_full_fine_tunes_base_out_of_memory(tiny_model_dir: Path) -> None:
    """Created (version 0 published), trained and synced through the engine, a full
    fine-tune never loads the base; its version 0 and a reference forward do, and
    read the base's numbers."""
    from treadle.common.engine.domain import SyncWeightsOp
    from treadle.workers.engine.loop import Engine, EngineConfig

    engine = Engine(
        EngineConfig(base_models={"tiny": tiny_model_dir}, threads=1, default_dtype="float64")
    ).start()
    try:
        engine.create_model(FULL).result(60)
        fb = ForwardBackwardOp((_datum(),), "cross_entropy", {})
        engine.submit("full", 1, fb, "a").result(60)
        engine.submit("full", 2, OptimStepOp(AdamConfig(learning_rate=1e-2)), "b").result(60)
        engine.submit("full", 3, SyncWeightsOp(), "c").result(60)
        base = engine.bases.get("tiny", torch.float64)
        assert not base.loaded
        assert engine.versions.versions("full") == [0, 1]

        assert engine.check_sampler_target(SamplerTarget("tiny", "full", 0)).result(60) == 0
        assert engine.check_sampler_target(SamplerTarget("tiny", None, None)).result(60) == 0
        assert not base.loaded  # version 0 and the base resolved: nothing read yet
        ref_op = ForwardLogprobsOp((_datum(),), reference=True)
        ref = engine.submit("full", 4, ref_op, "d").result(60)
        assert base.loaded  # the reference forward read it
        lora = TrainingModel(LORA, base)  # adapter B = 0: its policy is the base
        want = trainer.forward_logprobs(lora, ForwardLogprobsOp((_datum(),)))
        np.testing.assert_allclose(ref.logprobs[0], want.logprobs[0], rtol=1e-12, atol=1e-12)
        trained = engine.submit("full", 5, ForwardLogprobsOp((_datum(),)), "e").result(60)
        assert not np.allclose(trained.logprobs[0], want.logprobs[0])
    finally:
        engine.stop()
