"""Prepacked weights (the sampler's fp32 CPU fast path): the same numbers as
``F.linear``, never used while recording gradients or after the weight changed,
and a sampler that decodes through them (padding its batch to the packed width)
returns what one without them returns."""

from __future__ import annotations

from concurrent.futures import Future
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from treadle.common.engine.domain import SampleOp, SampleResult, SamplingConfig
from treadle.workers.engine.base_models import BaseModel, BaseModelRegistry
from treadle.workers.engine.versions import WeightSnapshot
from treadle.workers.model import prepack
from treadle.workers.sampler.backend import SampleJob
from treadle.workers.sampler.torch_sampler import SamplerLimits, TorchSampler

METHODS = prepack.methods()
pytestmark = pytest.mark.skipif(not METHODS, reason="this torch has neither MKL nor oneDNN")


def _entry(w: torch.Tensor) -> object:
    return getattr(w, "_treadle_packed", None)


@pytest.mark.parametrize("method", METHODS)
def test_packed_linear_matches_and_falls_back(base: BaseModel, method: str) -> None:
    params = base.params.clone()
    assert prepack.available(params)
    assert prepack.prepack(params, 8, method) == method
    assert prepack.packed_rows(params) == 8
    w = params.layers[0].gate_proj
    x = torch.randn(8, 1, w.shape[1])
    fewer = torch.randn(3, w.shape[1])  # oneDNN's copy serves them, MKL's does not
    more = torch.randn(9, w.shape[1])  # more rows (a prefill): the plain product
    packed_calls: list[int] = []
    real = prepack._packed_product

    def spy(*args: object) -> torch.Tensor:
        packed_calls.append(1)
        return real(*args)  # type: ignore[arg-type]

    prepack._packed_product = spy  # type: ignore[assignment]
    try:
        with torch.no_grad():
            # outside decoding() (the trainer's forward_logprobs): always the plain product
            for rows in (x, fewer, more):
                assert torch.equal(prepack.linear(rows, w), F.linear(rows, w))
            assert packed_calls == []
            with prepack.decoding():
                packed = prepack.linear(x, w)
                assert packed.shape == (8, 1, w.shape[0]) and len(packed_calls) == 1
                torch.testing.assert_close(packed, F.linear(x, w), rtol=1e-5, atol=1e-5)
                b = torch.randn(w.shape[0])
                torch.testing.assert_close(prepack.linear(x, w, b), F.linear(x, w, b))
                packed_calls.clear()
                torch.testing.assert_close(prepack.linear(fewer, w), F.linear(fewer, w))
                assert len(packed_calls) == (method == "onednn")
                assert torch.equal(prepack.linear(more, w), F.linear(more, w))
                assert len(packed_calls) == (method == "onednn")
        with prepack.decoding():
            # recording gradients: the plain op, so gradients flow
            xg = x.clone().requires_grad_(True)
            prepack.linear(xg, w).sum().backward()
            assert xg.grad is not None
            # a weight changed in place is never multiplied with its stale packed copy
            with torch.no_grad():
                w.add_(1.0)
                assert torch.equal(prepack.linear(x, w), F.linear(x, w))
    finally:
        prepack._packed_product = real  # type: ignore[assignment]
    assert prepack.packed_rows(params) == 8  # the head is unchanged
    prepack.unpack(params)
    assert _entry(w) is None and prepack.packed_rows(params) is None


def _sample(
    base: BaseModel, snap: WeightSnapshot, *, on: bool, packs: bool | None = None
) -> list[SampleResult]:
    limits = SamplerLimits(num_slots=8, max_len=64, prepack=on)
    sampler = TorchSampler(base, limits=limits)
    rng = np.random.default_rng(0)
    futures: list[Future[SampleResult]] = []
    for i in range(5):  # 5 x 2 rows > 8 slots: rows join and leave, batches of 4..8 rows
        fut: Future[SampleResult] = Future()
        params = SamplingConfig(max_tokens=int(rng.integers(3, 20)), seed=i, temperature=0.9)
        prompt = rng.integers(3, 90, size=int(rng.integers(2, 12)))
        sampler.submit(SampleJob(sampler.base, SampleOp(prompt, 2, params), snap), fut)
        futures.append(fut)
    while sampler.has_work():
        sampler.step()
    assert (sampler.packing.packed > 0) == (on if packs is None else packs)
    return [f.result() for f in futures]


@pytest.mark.parametrize("method", [*METHODS, "plain"])
def test_sampler_with_prepacked_weights_samples_the_same(
    base: BaseModel, method: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(prepack, "method_for", lambda params, rows: method)
    monkeypatch.setattr(prepack, "min_rows", lambda params, rows: 1)
    monkeypatch.setattr(prepack, "pack_after", lambda params, rows: 0)
    snap = WeightSnapshot(None, 0, base.params.clone(), None)
    plain = _sample(base, snap, on=False)
    packed = _sample(base, snap, on=True, packs=method != "plain")
    entry = _entry(snap.params.lm_head_weight)
    assert (entry[2] if entry else "plain") == method  # type: ignore[index]
    for a, b in zip(plain, packed, strict=True):
        for x, y in zip(a.sequences, b.sequences, strict=True):
            np.testing.assert_array_equal(x.tokens, y.tokens)
            np.testing.assert_allclose(x.logprobs, y.logprobs, atol=1e-5)


def test_the_method_is_measured_once_per_shapes_and_rows(
    base: BaseModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    timed: list[str] = []
    real = prepack._time_method

    def spy(
        method: str, weights: list[torch.Tensor], rows: int, counts: list[int] | None = None
    ) -> float:
        timed.append(method)
        return real(method, weights, rows, counts, repeat=3)

    monkeypatch.setattr(prepack, "_time_method", spy)
    monkeypatch.setattr(prepack, "_chosen", {})
    first = prepack.method_for(base.params, 5)
    fewest = prepack.min_rows(base.params, 5)
    n = len(timed)
    assert prepack.method_for(base.params.clone(), 5) == first  # same shapes: remembered
    assert prepack.min_rows(base.params.clone(), 5) == fewest
    assert len(timed) == n
    assert timed[:3] == ["plain", *METHODS]
    assert first in ("plain", *METHODS)
    # oneDNN's crossover: (oneDNN, plain) at 2 rows, then at 1 while oneDNN wins
    assert timed[3:] in ([], ["onednn", "plain"], ["onednn", "plain"] * 2)
    assert fewest == 5 if first != "onednn" else fewest in (5, 2, 1)


@pytest.mark.skipif("onednn" not in METHODS, reason="this torch build has no oneDNN")
def test_onednn_batches_below_the_crossover_run_plain(
    base: BaseModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Below ``min_rows`` the sampler neither packs nor multiplies with packed copies."""
    monkeypatch.setattr(prepack, "method_for", lambda params, rows: "onednn")
    monkeypatch.setattr(prepack, "min_rows", lambda params, rows: 10**6)
    monkeypatch.setattr(prepack, "pack_after", lambda params, rows: 0)
    snap = WeightSnapshot(None, 0, base.params.clone(), None)
    plain = _sample(base, snap, on=False)
    below = _sample(base, snap, on=True, packs=False)
    assert _entry(snap.params.lm_head_weight) is None
    for a, b in zip(plain, below, strict=True):
        for x, y in zip(a.sequences, b.sequences, strict=True):
            np.testing.assert_array_equal(x.tokens, y.tokens)
            np.testing.assert_array_equal(x.logprobs, y.logprobs)


@pytest.mark.parametrize("after", [3, 10**6])
def test_weights_are_packed_once_they_have_lasted_pack_after_steps(
    base: BaseModel, after: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ski rental: weights are packed on their ``pack_after``-th decode step, not
    before (short-lived weights never pay for packing)."""
    monkeypatch.setattr(prepack, "method_for", lambda params, rows: METHODS[0])
    monkeypatch.setattr(prepack, "min_rows", lambda params, rows: 1)
    monkeypatch.setattr(prepack, "pack_after", lambda params, rows: after)
    snap = WeightSnapshot(None, 0, base.params.clone(), None)
    sampler = TorchSampler(base, limits=SamplerLimits(num_slots=2, max_len=64))
    op = SampleOp(np.arange(3, 9), 2, SamplingConfig(max_tokens=12, seed=1, ignore_eos=True))
    fut: Future[SampleResult] = Future()
    sampler.submit(SampleJob(sampler.base, op, snap), fut)
    packed_at = []
    while sampler.has_work():
        sampler.step()
        packed_at.append(_entry(snap.params.lm_head_weight) is not None)
    fut.result()
    if after > 100:
        assert not any(packed_at)
    else:  # the first step prefills and decodes once; decode step k is step k
        assert packed_at.index(True) == after - 1
        assert all(packed_at[after - 1 :])


@pytest.mark.skipif(
    "onednn" not in prepack.methods(torch.bfloat16),
    reason="no oneDNN bf16 kernels for this CPU (AVX512-BF16 or AMX)",
)
def test_bf16_weights_pack_with_onednn_and_sample_the_same(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bf16 weights have oneDNN's copy only (MKL's packed sgemm is fp32), and a
    sampler decoding through it samples what the plain bf16 product samples."""
    bf16 = BaseModelRegistry({"tiny": tiny_model_dir}).get("tiny", torch.bfloat16)
    assert prepack.available(bf16.params)
    assert prepack.methods(torch.bfloat16) == ["onednn"]
    assert prepack.method_for(bf16.params, 8) in ("plain", "onednn")  # measured in bf16
    w = bf16.params.layers[0].up_proj
    params = bf16.params.clone()
    assert prepack.prepack(params, 8, "onednn") == "onednn"
    x = torch.randn(5, w.shape[1]).to(torch.bfloat16)
    with torch.no_grad(), prepack.decoding():
        packed = prepack.linear(x, params.layers[0].up_proj)
    assert packed.dtype == torch.bfloat16
    torch.testing.assert_close(packed, F.linear(x, w), rtol=1e-2, atol=1e-2)

    monkeypatch.setattr(prepack, "method_for", lambda params, rows: "onednn")
    monkeypatch.setattr(prepack, "min_rows", lambda params, rows: 1)
    monkeypatch.setattr(prepack, "pack_after", lambda params, rows: 0)
    snap = WeightSnapshot(None, 0, bf16.params.clone(), None)
    plain = _sample(bf16, snap, on=False)
    on = _sample(bf16, snap, on=True, packs=True)
    entry = _entry(snap.params.lm_head_weight)
    assert entry is not None and entry[2] == "onednn"  # type: ignore[index]
    for a, b in zip(plain, on, strict=True):
        for s, t in zip(a.sequences, b.sequences, strict=True):
            np.testing.assert_array_equal(s.tokens, t.tokens)
            np.testing.assert_allclose(s.logprobs, t.logprobs, atol=1e-3)
