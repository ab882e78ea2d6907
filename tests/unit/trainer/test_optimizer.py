"""workers.optimizer.AdamW: the documented formula, torch.optim.AdamW, clipping, metrics,
and its state round trip. float64 throughout, so agreement is to rounding."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from treadle.common.engine.domain import AdamConfig
from treadle.workers.trainer.optimizer import AdamW

SHAPES = {"a": (3, 4), "b": (5,), "c": (2, 2, 2)}


def _params(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        n: torch.randn(s, generator=gen, dtype=torch.float64).requires_grad_(True)
        for n, s in SHAPES.items()
    }


def _grads(steps: int, seed: int = 1, scale: float = 1.0) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [
        {n: scale * torch.randn(s, generator=gen, dtype=torch.float64) for n, s in SHAPES.items()}
        for _ in range(steps)
    ]


class HandAdamW:
    """The formula in optimizer.py's docstring, in numpy."""

    def __init__(self, params: dict[str, torch.Tensor]) -> None:
        self.p = {n: t.detach().numpy().copy() for n, t in params.items()}
        self.m = {n: np.zeros_like(v) for n, v in self.p.items()}
        self.v = {n: np.zeros_like(v) for n, v in self.p.items()}
        self.t = 0

    def step(self, grads: dict[str, torch.Tensor], cfg: AdamConfig) -> float:
        g = {n: t.numpy().copy() for n, t in grads.items()}
        norm = math.sqrt(sum(float((x**2).sum()) for x in g.values()))
        if cfg.grad_clip_norm > 0:
            scale = min(1.0, cfg.grad_clip_norm / (norm + 1e-6))
            g = {n: x * scale for n, x in g.items()}
        self.t += 1
        for n in self.p:
            self.m[n] = cfg.beta1 * self.m[n] + (1 - cfg.beta1) * g[n]
            self.v[n] = cfg.beta2 * self.v[n] + (1 - cfg.beta2) * g[n] ** 2
            m_hat = self.m[n] / (1 - cfg.beta1**self.t)
            v_hat = self.v[n] / (1 - cfg.beta2**self.t)
            self.p[n] = (
                self.p[n]
                - cfg.learning_rate * m_hat / (np.sqrt(v_hat) + cfg.eps)
                - cfg.learning_rate * cfg.weight_decay * self.p[n]
            )
        return norm


def _step(opt: AdamW, grads: dict[str, torch.Tensor], cfg: AdamConfig) -> dict[str, float]:
    for n, p in opt.params.items():
        p.grad = grads[n].clone()
    return opt.step(cfg)


def _assert_close(params: dict[str, torch.Tensor], ref: dict[str, np.ndarray], tol: float) -> None:
    for n, p in params.items():
        np.testing.assert_allclose(p.detach().numpy(), ref[n], rtol=tol, atol=tol)


CONFIGS = [  # hyper-parameters arrive with every step: a schedule lives on the client
    AdamConfig(learning_rate=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0),
    AdamConfig(learning_rate=5e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1),
    AdamConfig(learning_rate=2e-2, beta1=0.8, beta2=0.99, eps=1e-12, weight_decay=0.01),
    AdamConfig(learning_rate=1e-3, beta1=0.9, beta2=0.999, eps=1e-6, weight_decay=0.0),
    AdamConfig(learning_rate=0.0, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.5),
]


def test_matches_the_documented_formula_with_changing_hyper_parameters() -> None:
    params = _params()
    opt, hand = AdamW(params), HandAdamW(params)
    for grads, cfg in zip(_grads(len(CONFIGS)), CONFIGS, strict=True):
        metrics = _step(opt, grads, cfg)
        hand.step(grads, cfg)
        _assert_close(params, hand.p, 1e-12)
        assert metrics["step:value"] == hand.t
        assert metrics["learning_rate:value"] == cfg.learning_rate
    for n in SHAPES:
        np.testing.assert_allclose(opt.exp_avg[n].numpy(), hand.m[n], rtol=1e-12, atol=1e-15)
        np.testing.assert_allclose(opt.exp_avg_sq[n].numpy(), hand.v[n], rtol=1e-12, atol=1e-15)
    assert opt.step_count == len(CONFIGS)


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("clip", [0.0, 0.5])
def test_matches_torch_adamw(weight_decay: float, clip: float) -> None:
    cfg = AdamConfig(
        learning_rate=1e-2,
        beta1=0.9,
        beta2=0.95,
        eps=1e-8,
        weight_decay=weight_decay,
        grad_clip_norm=clip,
    )
    ours, theirs = _params(), _params()
    opt = AdamW(ours)
    ref = torch.optim.AdamW(
        list(theirs.values()),
        lr=cfg.learning_rate,
        betas=(cfg.beta1, cfg.beta2),
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
        foreach=False,
    )
    for grads in _grads(6, scale=3.0):
        metrics = _step(opt, grads, cfg)
        for n, p in theirs.items():
            p.grad = grads[n].clone()
        norm = torch.nn.utils.clip_grad_norm_(
            list(theirs.values()), clip if clip > 0 else float("inf")
        )
        ref.step()
        ref.zero_grad()
        assert metrics["grad_norm:value"] == pytest.approx(float(norm), rel=1e-12)
        for n in SHAPES:
            torch.testing.assert_close(ours[n].detach(), theirs[n].detach(), rtol=1e-11, atol=1e-13)


def test_clipping_scales_the_gradient_and_reports_the_pre_clip_norm() -> None:
    cfg = AdamConfig(learning_rate=1e-2, eps=1e-8, grad_clip_norm=1.0)
    params = _params()
    opt, hand = AdamW(params), HandAdamW(params)
    grads = _grads(3, scale=10.0)
    for g in grads:
        norm = math.sqrt(sum(float((t**2).sum()) for t in g.values()))
        assert norm > 1.0  # clipping applies
        metrics = _step(opt, g, cfg)
        assert hand.step(g, cfg) == pytest.approx(norm, rel=1e-12)
        assert metrics["grad_norm:value"] == pytest.approx(norm, rel=1e-12)  # pre-clip
        _assert_close(params, hand.p, 1e-12)
    # Adam is nearly scale invariant, so check the clipped moment itself
    first = grads[0]
    scale = 1.0 / (math.sqrt(sum(float((x**2).sum()) for x in first.values())) + 1e-6)
    fresh = AdamW(_params())
    _step(fresh, first, cfg)
    for n in SHAPES:
        torch.testing.assert_close(
            fresh.exp_avg[n], (1.0 - 0.9) * scale * first[n], rtol=1e-12, atol=0
        )


def test_clipping_leaves_small_gradients_alone() -> None:
    grads = _grads(1, scale=1e-3)[0]
    norm = math.sqrt(sum(float((t**2).sum()) for t in grads.values()))
    clipped, plain = AdamW(_params()), AdamW(_params())
    m1 = _step(clipped, grads, AdamConfig(learning_rate=1e-2, eps=1e-8, grad_clip_norm=1.0))
    m2 = _step(plain, grads, AdamConfig(learning_rate=1e-2, eps=1e-8))
    assert m1["grad_norm:value"] == m2["grad_norm:value"] == pytest.approx(norm, rel=1e-12)
    for n in SHAPES:
        assert torch.equal(clipped.params[n], plain.params[n])
        torch.testing.assert_close(clipped.exp_avg[n], (1.0 - 0.9) * grads[n], rtol=1e-15, atol=0)


def test_update_norm_metric_and_gradients_are_consumed() -> None:
    params = _params()
    before = {n: p.detach().clone() for n, p in params.items()}
    opt = AdamW(params)
    metrics = _step(opt, _grads(1)[0], AdamConfig(learning_rate=1e-2, weight_decay=0.1))
    moved = math.sqrt(sum(float(((params[n].detach() - before[n]) ** 2).sum()) for n in SHAPES))
    assert metrics["update_norm:value"] == pytest.approx(moved, rel=1e-9)
    assert all(p.grad is None for p in params.values())  # zeroed for the next accumulation
    assert opt.grad_norm() == 0.0


def test_state_round_trip_continues_identically() -> None:
    cfg = AdamConfig(learning_rate=1e-2, eps=1e-8, weight_decay=0.01)
    grads = _grads(5)
    a = AdamW(_params())
    for g in grads[:3]:
        _step(a, g, cfg)
    state = {n: t.clone() for n, t in a.state_tensors().items()}
    assert set(state) == {f"{k}.{n}" for k in ("exp_avg", "exp_avg_sq") for n in SHAPES}
    b = AdamW({n: p.detach().clone().requires_grad_(True) for n, p in a.params.items()})
    b.load_state_tensors(state, a.step_count)
    for g in grads[3:]:
        ma, mb = _step(a, g, cfg), _step(b, g, cfg)
        assert ma == mb
    for n in SHAPES:
        assert torch.equal(a.params[n], b.params[n])
    # without the state (moments and step count) the same steps land elsewhere
    c = AdamW({n: p.detach().clone().requires_grad_(True) for n, p in b.params.items()})
    _step(c, grads[0], cfg)
    _step(b, grads[0], cfg)
    assert not torch.equal(c.params["a"], b.params["a"])


def test_fused_update_matches_the_formula_step_for_step_across_chunks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Random float64 tensors, several steps with weight decay and active clipping, the
    tensors split over several fused calls: weights, both moments, the pre-clip
    gradient norm and the realised update norm equal the hand formula at every step."""
    import treadle.workers.trainer.optimizer as optimizer

    monkeypatch.setattr(optimizer, "_CHUNK_BYTES", 200)  # several chunks of these tensors
    shapes = {"w": (17, 9), "b": (9,), "e": (31, 4), "n": (3, 3, 3)}
    gen = torch.Generator().manual_seed(7)
    params = {
        n: torch.randn(s, generator=gen, dtype=torch.float64).requires_grad_(True)
        for n, s in shapes.items()
    }
    assert len(optimizer._chunks(list(params.values()))) > 1
    opt, hand = AdamW(params), HandAdamW(params)
    cfgs = [
        AdamConfig(
            learning_rate=3e-2,
            beta1=0.9,
            beta2=0.95,
            eps=1e-8,
            weight_decay=0.1,
            grad_clip_norm=2.0,
        ),
        AdamConfig(
            learning_rate=1e-2,
            beta1=0.85,
            beta2=0.99,
            eps=1e-10,
            weight_decay=0.05,
            grad_clip_norm=2.0,
        ),
    ] * 3
    for cfg in cfgs:
        grads = {
            n: 5.0 * torch.randn(s, generator=gen, dtype=torch.float64) for n, s in shapes.items()
        }
        before = {n: hand.p[n].copy() for n in shapes}
        norm = math.sqrt(sum(float((g**2).sum()) for g in grads.values()))
        assert norm > cfg.grad_clip_norm  # clipping applies at every step
        for n, p in params.items():
            p.grad = grads[n].clone()
        metrics = opt.step(cfg)
        assert hand.step(grads, cfg) == pytest.approx(metrics["grad_norm:value"], rel=1e-12)
        moved = math.sqrt(sum(float(((hand.p[n] - before[n]) ** 2).sum()) for n in shapes))
        assert metrics["update_norm:value"] == pytest.approx(moved, rel=1e-9)
        for n in shapes:
            np.testing.assert_allclose(
                params[n].detach().numpy(), hand.p[n], rtol=1e-12, atol=1e-14
            )
            np.testing.assert_allclose(opt.exp_avg[n].numpy(), hand.m[n], rtol=1e-12, atol=1e-15)
            np.testing.assert_allclose(opt.exp_avg_sq[n].numpy(), hand.v[n], rtol=1e-12, atol=1e-15)
            assert params[n].grad is None


def test_a_step_bumps_the_weights_version_counters() -> None:
    """Caches keyed on ``tensor._version`` (the sampler's packed weights) see the update,
    as they did when the update was an in-place ``add_``."""
    params = _params()
    before = {n: p._version for n, p in params.items()}
    _step(AdamW(params), _grads(1)[0], AdamConfig(learning_rate=1e-2))
    assert all(p._version > before[n] for n, p in params.items())
