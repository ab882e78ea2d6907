"""A slot's next occupant never reads what its last one left: the torch sampler's KV
cache cells beyond a row's written extent hold zeros, in the main cache and in the
staging cache.

A step reads every row's slot up to the batch's longest position and masks the rest
with an additive -inf; NaN + -inf is NaN and 0 x NaN is NaN, so a NaN left behind by a
diverged tenant (every adapter weight NaN) made the next tenant in that slot sample
NaN logprobs and garbage tokens whenever a longer row shared its step. Checked for a
main slot (decode) and a staging slot (a padded prefill batch).
"""

from __future__ import annotations

from concurrent.futures import Future

import numpy as np
import torch

from treadle.common.engine.domain import (
    ModelSpec,
    SampleOp,
    SampleResult,
    SamplerTarget,
    SamplingConfig,
)
from treadle.errors import InternalError
from treadle.workers.engine.base_models import BaseModel
from treadle.workers.engine.versions import WeightSnapshot
from treadle.workers.sampler.backend import SampleJob
from treadle.workers.sampler.state import SamplerLimits
from treadle.workers.sampler.torch_sampler import TorchSampler
from treadle.workers.trainer.trainer import TrainingModel


def _snapshot(base: BaseModel, i: int, *, nan: bool = False) -> WeightSnapshot:
    """Tenant i's LoRA version (B non-zero, seeded); ``nan``: every weight NaN."""
    spec = ModelSpec(f"m{i}", f"t{i}", "tiny", 4, 8.0, i, "float32")
    model = TrainingModel(spec, base)
    g = torch.Generator().manual_seed(100 + i)
    with torch.no_grad():
        for t in model.adapter.parameters():  # type: ignore[union-attr]
            t.add_(0.05 * torch.randn(t.shape, generator=g, dtype=t.dtype))
            if nan:
                t.fill_(float("nan"))
    return model.snapshot()


def _op(prompt_len: int, max_tokens: int, seed: int) -> SampleOp:
    prompt = np.random.default_rng(seed).integers(3, 60, prompt_len).astype(np.int64)
    params = SamplingConfig(max_tokens=max_tokens, seed=7, ignore_eos=True)
    return SampleOp(prompt=prompt, num_samples=1, params=params)


def _submit(sampler: TorchSampler, snap: WeightSnapshot, op: SampleOp) -> Future[SampleResult]:
    fut: Future[SampleResult] = Future()
    target = SamplerTarget(sampler.base.name, snap.model_id, snap.version, snap.model_id or "")
    sampler.submit(SampleJob(sampler.base, op, snap, target), fut)
    return fut


def _run_out(sampler: TorchSampler, fut: Future[SampleResult]) -> None:
    while not fut.done():
        sampler.step()


def _same(got: SampleResult, want: SampleResult, atol: float = 0.0) -> None:
    (x,), (y,) = got.sequences, want.sequences
    assert np.isfinite(x.logprobs).all(), x.logprobs
    assert list(x.tokens) == list(y.tokens)
    np.testing.assert_allclose(x.logprobs, y.logprobs, atol=atol, rtol=0)


def test_a_main_slot_after_a_nan_tenant_decodes_as_a_fresh_one(base: BaseModel) -> None:
    """Two main slots: a long row in one; a NaN tenant's 20-token request, then a clean
    tenant's 4-token one, in the other, the long row keeping the step's key length
    past the clean row's position."""
    clean, long_, nan = _snapshot(base, 0), _snapshot(base, 2), _snapshot(base, 1, nan=True)

    def run(after_nan: bool) -> tuple[SampleResult, SampleResult]:
        sampler = TorchSampler(base, num_slots=2, max_len=64)
        long_fut = _submit(sampler, long_, _op(24, 20, seed=1))
        if after_nan:
            nan_fut = _submit(sampler, nan, _op(20, 3, seed=2))
            _run_out(sampler, nan_fut)
            assert np.isnan(nan_fut.result().sequences[0].logprobs[1:]).all()
            assert sampler.running[0].request.tenant == long_.model_id
        fut = _submit(sampler, clean, _op(4, 6, seed=3))
        while sampler.has_work():
            sampler.step()
        return fut.result(), long_fut.result()

    (got, got_long), (want, want_long) = run(after_nan=True), run(after_nan=False)
    _same(got, want)
    _same(got_long, want_long, atol=1e-5)  # it shared steps with the NaN row: other shapes


def test_a_staging_slot_after_a_nan_tenant_prefills_as_a_fresh_one(base: BaseModel) -> None:
    """Two staging slots: a NaN tenant prefills a 20-token prompt into one; then a clean
    tenant's 12-token prompt takes that slot, prefilled in one padded batch beside a
    24-token prompt (the batch reads every slot up to 24 positions)."""
    clean, long_, nan = _snapshot(base, 0), _snapshot(base, 2), _snapshot(base, 1, nan=True)
    short_op = _op(12, 4, seed=3)
    limits = SamplerLimits(num_slots=4, max_len=64, prefill_slots=2)

    def run(after_nan: bool) -> SampleResult:
        sampler = TorchSampler(base, limits=limits)
        if after_nan:
            nan_fut = _submit(sampler, nan, _op(20, 1, seed=2))
            _run_out(sampler, nan_fut)
            assert np.isnan(nan_fut.result().sequences[0].logprobs).all()
            (nan_slot,) = [i for i, s in enumerate(sampler.prefix.staged) if s.tokens.size == 20]
        _submit(sampler, long_, _op(24, 4, seed=1))
        fut = _submit(sampler, clean, short_op)
        sampler.step()  # both prompts in one prefill forward (12 + 24 tokens, padded to 48)
        assert len(sampler.running) == 2 and not sampler.prefilling
        if after_nan:  # the clean prompt took the slot the NaN prompt had filled
            assert sampler.prefix.staged[nan_slot].tokens.size == 12
        while sampler.has_work():
            sampler.step()
        return fut.result()

    _same(run(after_nan=True), run(after_nan=False))


def test_slots_freed_by_a_failed_step_are_as_fresh_ones(base: BaseModel) -> None:
    """A step fails (``fail_all``) while a NaN tenant's row decodes: the requests that
    come next sample what they sample in a new sampler."""
    clean, long_, nan = _snapshot(base, 0), _snapshot(base, 2), _snapshot(base, 1, nan=True)

    def run(after_failure: bool) -> SampleResult:
        sampler = TorchSampler(base, num_slots=2, max_len=64)
        if after_failure:
            _submit(sampler, long_, _op(24, 20, seed=1))
            _submit(sampler, nan, _op(20, 10, seed=2))
            for _ in range(4):
                sampler.step()
            assert [r.position for r in sampler.running] == [28, 24]
            sampler.fail_all(InternalError("a failed step"))
        _submit(sampler, long_, _op(24, 20, seed=4))  # a new prompt: no prefix reused
        fut = _submit(sampler, clean, _op(4, 6, seed=3))
        sampler.step()
        assert [r.request.tenant for r in sampler.running] == [long_.model_id, clean.model_id]
        while sampler.has_work():
            sampler.step()
        return fut.result()

    _same(run(after_failure=True), run(after_failure=False))
