"""GSPO against a hand-written torch reference of tinker's documented GSPO-token objective.

The reference follows the documented steps literally, one datum at a time:
the sequence log-ratio is the mean token log-ratio over the tokens that
``sequence_ratio_mask`` marks; every token's ratio is
``exp(seq_log_ratio + logp - sg(logp))``; then PPO's clipped surrogate.
"""

from __future__ import annotations

import pytest
import torch

from treadle.workers.trainer.losses import LOSSES, LossBatch, compute_loss

F64 = torch.float64


def reference_gspo(
    logp_per_datum: list[torch.Tensor],
    behaviour: list[torch.Tensor],
    adv: list[torch.Tensor],
    ratio_mask: list[torch.Tensor],
    weights: list[torch.Tensor],
    low: float,
    high: float,
) -> torch.Tensor:
    total = torch.zeros((), dtype=F64)
    for lp, q, a, m, w in zip(logp_per_datum, behaviour, adv, ratio_mask, weights, strict=True):
        in_ratio = m != 0
        log_ratio = (lp.detach() - q)[in_ratio].mean()
        ratio = torch.exp(log_ratio + lp - lp.detach())
        clipped_ratio = torch.clamp(ratio, low, high)
        per_token = -torch.minimum(ratio * a, clipped_ratio * a)
        total = total + (w * per_token).sum()
    return total


def _case(seed: int) -> dict[str, list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = [4, 6, 3]
    out: dict[str, list[torch.Tensor]] = {k: [] for k in ("logp", "q", "adv", "mask", "w")}
    for n in lengths:
        logp = -torch.rand(n, generator=gen, dtype=F64) * 2
        out["logp"].append(logp)
        out["q"].append(logp - 0.05 * torch.randn(n, generator=gen, dtype=F64))
        out["adv"].append(torch.randn(n, generator=gen, dtype=F64))
        mask = (torch.rand(n, generator=gen) > 0.3).to(F64)
        mask[0] = 1.0
        out["mask"].append(mask)
        out["w"].append(torch.ones(n, dtype=F64))
    return out


@pytest.mark.parametrize(("low", "high"), [(0.9997, 1.0004), (0.8, 1.2), (0.98, 1.01)])
@pytest.mark.parametrize("with_mask", [True, False])
def test_gspo_matches_the_documented_formula(low: float, high: float, with_mask: bool) -> None:
    case = _case(seed=3)
    # Reference: per-datum tensors with their own leaves.
    ref_leaves = [lp.clone().requires_grad_(True) for lp in case["logp"]]
    masks = case["mask"] if with_mask else case["w"]
    expected = reference_gspo(ref_leaves, case["q"], case["adv"], masks, case["w"], low, high)
    expected.backward()
    expected_grad = torch.cat([leaf.grad for leaf in ref_leaves])  # type: ignore[misc]

    # Registry: one flattened batch with datum indices.
    logp = torch.cat(case["logp"]).clone().requires_grad_(True)
    datum = torch.cat([torch.full((len(x),), i) for i, x in enumerate(case["logp"])])
    inputs = {
        "logprobs": torch.cat(case["q"]),
        "advantages": torch.cat(case["adv"]),
        "weights": torch.cat(case["w"]),
    }
    if with_mask:
        inputs["sequence_ratio_mask"] = torch.cat(case["mask"])
    config = {"clip_low_threshold": low, "clip_high_threshold": high}
    result = compute_loss("gspo", LossBatch(logp, inputs, None, datum), config)
    result.loss.backward()
    assert float(result.loss) == pytest.approx(float(expected), rel=1e-12, abs=1e-12)
    assert torch.allclose(logp.grad, expected_grad, rtol=1e-10, atol=1e-12)  # type: ignore[arg-type]
    assert result.metrics["loss:sum"] == pytest.approx(float(expected))


def test_gspo_ratio_is_per_sequence_and_clips_whole_sequences() -> None:
    """Two datums: one on-policy (ratio 1, trains), one far off (every token clipped, no gradient)."""
    logp = torch.tensor([-1.0, -1.0, -1.0, -1.0], dtype=F64, requires_grad=True)
    behaviour = torch.tensor([-1.0, -1.0, -2.0, -2.0], dtype=F64)  # datum 1: ratio e^1 per token
    inputs = {"logprobs": behaviour, "advantages": torch.ones(4, dtype=F64)}
    datum = torch.tensor([0, 0, 1, 1])
    res = compute_loss("gspo", LossBatch(logp, inputs, None, datum), {})
    res.loss.backward()
    # datum 0: -1 per token with gradient -1; datum 1: clipped at 1.0004, gradient 0.
    assert float(res.loss) == pytest.approx(-2.0 - 2 * 1.0004)
    assert logp.grad.tolist() == pytest.approx([-1.0, -1.0, 0.0, 0.0])  # type: ignore[union-attr]
    assert res.metrics["clip_frac:mean"] == pytest.approx(0.5)


def test_gspo_splits_by_datum_like_one_call() -> None:
    """Losses are sums: the datums in two calls add up to the same loss as in one."""
    case = _case(seed=7)
    datum = torch.cat([torch.full((len(x),), i) for i, x in enumerate(case["logp"])])
    flat = {
        "logprobs": torch.cat(case["q"]),
        "advantages": torch.cat(case["adv"]),
    }
    config = {"clip_low_threshold": 0.98, "clip_high_threshold": 1.01}
    whole = compute_loss("gspo", LossBatch(torch.cat(case["logp"]), flat, None, datum), config)
    parts = 0.0
    for i, lp in enumerate(case["logp"]):
        sub = {"logprobs": case["q"][i], "advantages": case["adv"][i]}
        parts += float(compute_loss("gspo", LossBatch(lp, sub, None, None), config).loss)
    assert float(whole.loss) == pytest.approx(parts, rel=1e-12)


def test_gspo_defaults_and_inputs() -> None:
    spec = LOSSES["gspo"]
    assert spec.config_defaults["clip_low_threshold"] == 0.9997
    assert spec.config_defaults["clip_high_threshold"] == 1.0004
    assert "sequence_ratio_mask" in spec.optional_inputs
    assert {"logprobs", "advantages"} <= spec.required_inputs
