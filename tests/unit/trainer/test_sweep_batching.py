"""One tenant's many models (a sweep) share the base model's passes: their
training calls run in one batched pass with the results of each call alone
(<= 1e-5), models on different bases never share one, the engine counts what
ran batched and alone, and the sampler decodes every adapter's rows together."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.unit.engine_ops import random_datum
from treadle.common.engine.domain import (
    AdamConfig,
    ForwardBackwardOp,
    ForwardLogprobsOp,
    ForwardResult,
    ModelSpec,
    OptimStepOp,
    OrderedOp,
    SampleOp,
    SampleResult,
    SamplerTarget,
    SamplingConfig,
)
from treadle.workers.engine.base_models import BaseModelRegistry
from treadle.workers.engine.loop import Engine, EngineConfig
from treadle.workers.model.tiny import build_tiny_model
from treadle.workers.sampler import forward as sampler_mod
from treadle.workers.sampler.backend import SampleJob
from treadle.workers.sampler.torch_sampler import TorchSampler
from treadle.workers.trainer import batching
from treadle.workers.trainer.trainer import TrainingModel

torch.set_num_threads(1)
TOL = 1e-5
TENANT = "researcher"


@pytest.fixture
def passes(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[list[str]]]:
    """The model ids of every batched pass the engine runs."""
    seen: list[list[str]] = []
    real = batching.run_batch  # what a one-rank engine's batched pass runs

    def spy(calls: Any, check: Any) -> None:
        seen.append([c.model.spec.model_id for c in calls])
        real(calls, check)

    monkeypatch.setattr(batching, "run_batch", spy)
    yield seen


def _sweep(
    bases: dict[str, Path], models: list[tuple[str, str, int]], batched: bool
) -> tuple[Engine, list[Any]]:
    """One tenant's models (id, base, rank), each: a warm-up step (so adapters
    differ), then forward_backward, optim_step, forward_logprobs; every call
    is queued before the engine starts, so the scheduler sees them together."""
    engine = Engine(EngineConfig(bases, batch_across_models=batched))
    for i, (mid, base, rank) in enumerate(models):
        engine.create_model(ModelSpec(mid, TENANT, base, rank, 8.0, i, "float32"))
    rng = np.random.default_rng(3)
    futures = []
    for mid, _, _ in models:
        plan: list[OrderedOp] = [
            ForwardBackwardOp((random_datum(rng, 9),), "cross_entropy", {}),
            OptimStepOp(AdamConfig(learning_rate=0.05)),
            ForwardBackwardOp((random_datum(rng, 7), random_datum(rng, 12)), "ppo", {}),
            OptimStepOp(AdamConfig(learning_rate=0.05)),
            ForwardLogprobsOp((random_datum(rng, 10),)),
        ]
        futures += [engine.submit(mid, s, op, f"{mid}-{s}") for s, op in enumerate(plan, 1)]
    engine.start()
    try:
        return engine, [f.result(timeout=120) for f in futures]
    finally:
        engine.stop()


def _assert_same(a: list[Any], b: list[Any]) -> None:
    for x, y in zip(a, b, strict=True):
        if isinstance(y, ForwardResult):
            assert isinstance(x, ForwardResult)
            for p, q in zip(x.logprobs, y.logprobs, strict=True):
                np.testing.assert_allclose(p, q, atol=TOL, rtol=0)
            for k in y.metrics:
                assert x.metrics[k] == pytest.approx(y.metrics[k], abs=TOL, rel=TOL), k
        else:
            assert x.step == y.step


def test_one_tenants_models_share_a_pass(tiny_model_dir: Path, passes: list[list[str]]) -> None:
    models = [(f"run{i}", "tiny", (8, 16)[i % 2]) for i in range(4)]
    engine, batched = _sweep({"tiny": tiny_model_dir}, models, batched=True)
    # each phase of the four runs in one pass: 3 forward phases, one call per model
    assert [sorted(p) for p in passes] == [[m for m, _, _ in models]] * 3
    (stats,) = engine.pass_metrics()
    assert (stats.base_model, stats.dtype) == ("tiny", "float32")
    assert (stats.passes, stats.batched_passes, stats.calls_batched) == (3, 3, 12)
    assert stats.calls_alone == 0 and stats.tokens_alone == 0
    assert stats.calls_per_batched_pass == 4.0 and stats.max_calls_per_pass == 4
    assert stats.tokens_batched == 4 * (9 + 19 + 10)
    passes.clear()
    engine, alone = _sweep({"tiny": tiny_model_dir}, models, batched=False)
    assert not passes
    (stats,) = engine.pass_metrics()
    assert (stats.passes, stats.batched_passes, stats.calls_alone) == (12, 0, 12)
    assert stats.tokens_alone == 4 * (9 + 19 + 10)
    _assert_same(batched, alone)


def test_models_on_different_bases_never_share_a_pass(
    tiny_model_dir: Path, tmp_path: Path, passes: list[list[str]]
) -> None:
    other = build_tiny_model(tmp_path / "other", preset="tiny", seed=1)
    bases = {"tiny": tiny_model_dir, "other": other}
    models = [("a0", "tiny", 4), ("b0", "other", 4), ("a1", "tiny", 8), ("b1", "other", 8)]
    engine, _ = _sweep(bases, models, batched=True)
    assert sorted(sorted(p) for p in passes) == [["a0", "a1"]] * 3 + [["b0", "b1"]] * 3
    stats = {s.base_model: s for s in engine.pass_metrics()}
    assert stats["tiny"].calls_batched == stats["other"].calls_batched == 6


# ---- sampling ------------------------------------------------------------------------------


def test_one_tenants_adapters_decode_in_one_batch(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Nothing per tenant or per model splits the decode: 4 adapters' rows of one
    tenant run in one forward a step, and each request samples what it samples alone."""
    base = BaseModelRegistry({"tiny": tiny_model_dir}).get("tiny", torch.float32)
    snapshots = []
    for i in range(4):
        model = TrainingModel(
            ModelSpec(f"m{i}", TENANT, "tiny", 4 + 4 * i, 8.0, i, "float32"), base
        )
        g = torch.Generator().manual_seed(i)
        with torch.no_grad():
            for t in model.adapter.parameters():  # type: ignore[union-attr]
                t.add_(0.1 * torch.randn(t.shape, generator=g))
        snapshots.append(model.snapshot())
    op = SampleOp(
        prompt=np.array([5, 6, 7, 8], dtype=np.int64),
        num_samples=3,
        params=SamplingConfig(max_tokens=6, seed=7, ignore_eos=True),
    )

    def run(snaps: list[Any]) -> tuple[list[SampleResult], list[int]]:
        widths: list[int] = []
        real = sampler_mod.forward_hidden

        def spy(cfg: Any, params: Any, tokens: torch.Tensor, *args: Any, **kw: Any) -> Any:
            if tokens.shape[1] == 1:  # a decode step
                widths.append(tokens.shape[0])
            return real(cfg, params, tokens, *args, **kw)

        monkeypatch.setattr(sampler_mod, "forward_hidden", spy)
        sampler = TorchSampler(base, num_slots=16, max_len=32)
        futures: list[Future[SampleResult]] = []
        for snap in snaps:
            fut: Future[SampleResult] = Future()
            pinned = SamplerTarget(base.name, snap.model_id, snap.version, TENANT)
            sampler.submit(SampleJob(sampler.base, op, snap, pinned), fut)
            futures.append(fut)
        while sampler.has_work():
            sampler.step()
        monkeypatch.setattr(sampler_mod, "forward_hidden", real)
        return [f.result(0) for f in futures], widths

    together, widths = run(snapshots)
    assert max(widths) >= 4 * 3  # every adapter's rows in one decode forward
    for snap, seqs in zip(snapshots, together, strict=True):
        (alone,), _ = run([snap])
        for x, y in zip(seqs.sequences, alone.sequences, strict=True):
            assert list(x.tokens) == list(y.tokens)
            np.testing.assert_allclose(x.logprobs, y.logprobs, atol=TOL, rtol=0)


def test_mixed_ranks_take_the_segment_path_and_equal_each_adapter(tiny_model_dir: Path) -> None:
    """A sweep mixes ranks (8 and 16): its calls' equal row segments still take the
    segment path (smaller ranks padded with zeros), with each adapter's own result."""
    from treadle.workers.model.lora import LoraRows

    base = BaseModelRegistry({"tiny": tiny_model_dir}).get("tiny", torch.float32)
    adapters = []
    for i, rank in enumerate((8, 16, 8)):
        model = TrainingModel(ModelSpec(f"m{i}", TENANT, "tiny", rank, 8.0, i, "float32"), base)
        assert model.adapter is not None
        with torch.no_grad():
            for t in model.adapter.parameters():
                t.add_(0.1 * torch.randn(t.shape, generator=torch.Generator().manual_seed(i)))
        adapters.append(model.adapter)
    ids = [1, 1, 0, 0, 2, 2]
    rows = LoraRows(adapters, torch.tensor(ids))
    assert rows.segments == [1, 0, 2]
    layer, target = 0, next(iter(adapters[0].a[0]))
    x = torch.randn(len(ids), 3, base.cfg.hidden_size)
    out_dim = adapters[0].b[0][target].shape[0]
    y = torch.randn(len(ids), 3, out_dim)
    got = rows.apply(layer, target, x, y.clone())
    want = torch.cat(
        [
            adapters[k].apply(layer, target, x[i : i + 1], y[i : i + 1].clone())
            for i, k in enumerate(ids)
        ]
    )
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    got.sum().backward()
    assert all(a.a[layer][target].grad is not None for a in adapters)
