"""The policy-gradient family: importance sampling, PPO, CISPO, DRO, GSPO.

Each is a surrogate (per-token loss, the ratio it uses, the tokens it clipped)
in one shared frame that adds the optional k3 KL-to-reference penalty and the
diagnostics (``ratio``, ``clip_frac``, ``approx_kl``, ``kl_ref``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from treadle.errors import InvalidArgumentError
from treadle.workers.trainer.losses.base import (
    LossBatch,
    LossResult,
    _base_metrics,
    _counted,
    _k3,
    _masked_diff,
    _masked_stats,
    _weights_and_mask,
)

#: What a surrogate returns: per-token loss, the ratio it uses (for metrics), the
#: tokens it clipped (None when it has no clip), and extra metrics.
_SurrogateOut = tuple[torch.Tensor, torch.Tensor, "torch.Tensor | None", dict[str, float]]
_Surrogate = Callable[
    [torch.Tensor, Mapping[str, torch.Tensor], torch.Tensor, Mapping[str, float]], _SurrogateOut
]


def _policy_loss(
    batch: LossBatch, config: Mapping[str, float], surrogate: _Surrogate
) -> LossResult:
    """Shared frame of every policy loss: surrogate + optional k3 KL-to-reference + diagnostics."""
    logp = batch.logprobs_N
    inputs = batch.inputs
    w, mask = _weights_and_mask(batch)
    counted = _counted(batch, mask)  # the tokens the diagnostics describe
    per_token, ratio, clipped, extra = surrogate(logp, inputs, mask, config)

    metrics: dict[str, float] = {}
    kl_beta = config.get("kl_beta", 0.0)
    ref = inputs.get("ref_logprobs")
    if ref is not None:
        # log(pi_ref / pi_theta) on tokens sampled from pi_theta: k3 estimates KL(pi_theta || pi_ref).
        kl_ref = _k3(_masked_diff(ref, logp, mask))
        if kl_beta > 0:
            per_token = per_token + kl_beta * kl_ref
        # a term of the loss itself: over the tokens the loss sums (as ntokens:sum)
        metrics.update(_masked_stats(kl_ref, mask, "kl_ref"))
    elif kl_beta > 0:
        raise InvalidArgumentError(
            "loss_fn_inputs.ref_logprobs: required when loss_fn_config.kl_beta > 0 "
            "(the engine fills it with the base model's log-probs when the client does not)"
        )

    loss = (w * per_token).sum()
    metrics.update(_base_metrics(loss, batch, mask, counted))
    with torch.no_grad():
        metrics.update(_masked_stats(ratio, counted, "ratio", extremes=True))
        if clipped is not None:
            metrics.update(_masked_stats(clipped.to(logp.dtype), counted, "clip_frac"))
        # Drift of the current policy from the data's (behaviour) policy, k3 of KL(behaviour || current).
        data_log_ratio = _masked_diff(logp, inputs["logprobs"], mask)
        metrics.update(_masked_stats(_k3(data_log_ratio), counted, "approx_kl"))
    metrics.update(extra)
    return LossResult(loss, metrics)


def _trust_region_ratio(
    logp: torch.Tensor, inputs: Mapping[str, torch.Tensor], mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, float]]:
    """The ratio PPO/CISPO clip, and AReaL's decoupled behaviour weight when ``proximal_logprobs`` is given.

    Decoupled PPO (Fu et al., AReaL, 2025): with stale samples the trust region
    should be centred on a recent *proximal* policy, not on the (possibly many
    steps old) behaviour policy. The clipped ratio becomes
    ``exp(logp - proximal)`` and the surrogate is reweighted by the behaviour
    importance weight ``sg(exp(proximal - behaviour))``. When
    ``proximal == behaviour`` the weight is 1 and this is plain PPO.
    """
    behaviour = inputs["logprobs"]
    proximal = inputs.get("proximal_logprobs")
    if proximal is None:
        return torch.exp(_masked_diff(logp, behaviour, mask)), None, {}
    ratio = torch.exp(_masked_diff(logp, proximal, mask))
    behaviour_weight = torch.exp(_masked_diff(proximal, behaviour, mask)).detach()
    return ratio, behaviour_weight, _masked_stats(behaviour_weight, mask, "behav_weight")


def _is_surrogate(
    logp: torch.Tensor,
    inputs: Mapping[str, torch.Tensor],
    mask: torch.Tensor,
    config: Mapping[str, float],
) -> _SurrogateOut:
    adv = inputs["advantages"]
    ratio = torch.exp(_masked_diff(logp, inputs["logprobs"], mask))
    cap = config["ratio_cap"]
    if cap <= 0:
        return -ratio * adv, ratio, None, {}
    # Truncated IS: the forward value is -min(r, cap)·A and the gradient is
    # -min(r, cap)·A·∇logp. Below the cap both equal the uncapped loss; above it
    # the token keeps a gradient whose coefficient is capped (it is never zeroed,
    # unlike a PPO clip). exp(logp - sg(logp)) is 1 with gradient ∇logp.
    coef = ratio.detach().clamp(max=cap)
    score = torch.exp(torch.where(mask, logp - logp.detach(), torch.zeros_like(logp)))
    return -coef * adv * score, ratio, ratio.detach() > cap, {}


def _ppo_surrogate(
    logp: torch.Tensor,
    inputs: Mapping[str, torch.Tensor],
    mask: torch.Tensor,
    config: Mapping[str, float],
) -> _SurrogateOut:
    adv = inputs["advantages"]
    low, high = config["clip_low_threshold"], config["clip_high_threshold"]
    ratio, behaviour_weight, extra = _trust_region_ratio(logp, inputs, mask)
    per_token = -torch.minimum(ratio * adv, ratio.clamp(low, high) * adv)
    if behaviour_weight is not None:
        per_token = behaviour_weight * per_token
    clipped = (ratio.detach() < low) | (ratio.detach() > high)
    return per_token, ratio, clipped, extra


def _cispo_surrogate(
    logp: torch.Tensor,
    inputs: Mapping[str, torch.Tensor],
    mask: torch.Tensor,
    config: Mapping[str, float],
) -> _SurrogateOut:
    adv = inputs["advantages"]
    low, high = config["clip_low_threshold"], config["clip_high_threshold"]
    ratio, behaviour_weight, extra = _trust_region_ratio(logp, inputs, mask)
    coef = ratio.detach().clamp(low, high)
    if behaviour_weight is not None:
        coef = behaviour_weight * coef
    logp_masked = torch.where(mask, logp, torch.zeros_like(logp))
    clipped = (ratio.detach() < low) | (ratio.detach() > high)
    return -coef * adv * logp_masked, ratio, clipped, extra


def _dro_surrogate(
    logp: torch.Tensor,
    inputs: Mapping[str, torch.Tensor],
    mask: torch.Tensor,
    config: Mapping[str, float],
) -> _SurrogateOut:
    adv = inputs["advantages"]
    log_ratio = _masked_diff(logp, inputs["logprobs"], mask)
    logp_masked = torch.where(mask, logp, torch.zeros_like(logp))
    per_token = -(logp_masked * adv - 0.5 * config["beta"] * log_ratio.square())
    return per_token, torch.exp(log_ratio), None, {}


def _sequence_mean(
    values: torch.Tensor, mask: torch.Tensor, datum_N: torch.Tensor | None
) -> torch.Tensor:
    """Each token gets the mean of ``values`` over the masked tokens of its own datum (0 if none)."""
    if datum_N is None:
        datum_N = torch.zeros_like(values, dtype=torch.long)
    n_seq = int(datum_N.max()) + 1 if datum_N.numel() else 0
    picked = torch.where(mask, values, torch.zeros_like(values))
    sums = torch.zeros(n_seq, dtype=values.dtype, device=values.device).index_add(
        0, datum_N, picked
    )
    counts = torch.zeros(n_seq, dtype=values.dtype, device=values.device).index_add(
        0, datum_N, mask.to(values.dtype)
    )
    return (sums / counts.clamp(min=1))[datum_N]


def _gspo_surrogate(datum_N: torch.Tensor | None) -> _Surrogate:
    """GSPO-token (Zheng et al. 2025, tinker's form): every token carries its sequence's ratio.

    The sequence ratio ``s = exp(mean_{t in M} (logp_t - logprobs_t))`` is the
    geometric mean of the token ratios over the tokens ``M`` that
    ``sequence_ratio_mask`` marks (default: the tokens with a non-zero weight;
    with no weights, those with a non-zero advantage, so the prompt positions the
    tinker SDK sends with a placeholder sampler logprob stay out of it).
    Token t's ratio has ``s``'s value and the gradient of its own log-prob:
    ``s_t = sg(s) · exp(logp_t - sg(logp_t))``; then PPO's clipped surrogate
    on ``s_t``. Clipping is therefore decided per sequence.
    """

    def surrogate(
        logp: torch.Tensor,
        inputs: Mapping[str, torch.Tensor],
        mask: torch.Tensor,
        config: Mapping[str, float],
    ) -> _SurrogateOut:
        adv = inputs["advantages"]
        low, high = config["clip_low_threshold"], config["clip_high_threshold"]
        ratio_mask = inputs.get("sequence_ratio_mask")
        if ratio_mask is not None:
            in_ratio = ratio_mask != 0
        elif "weights" in inputs:
            in_ratio = mask
        else:
            in_ratio = mask & (adv != 0)
        token_log_ratio = _masked_diff(logp.detach(), inputs["logprobs"], in_ratio)
        seq_log_ratio = _sequence_mean(token_log_ratio, in_ratio, datum_N)
        own_grad = torch.where(mask, logp - logp.detach(), torch.zeros_like(logp))
        ratio = torch.exp(seq_log_ratio + own_grad)
        per_token = -torch.minimum(ratio * adv, ratio.clamp(low, high) * adv)
        clipped = (ratio.detach() < low) | (ratio.detach() > high)
        return per_token, ratio, clipped, {}

    return surrogate


def importance_sampling(batch: LossBatch, config: Mapping[str, float]) -> LossResult:
    """REINFORCE with an importance ratio: ``Σ w · -(r·A)``, ``r = exp(logp - logprobs)``; optional truncation."""
    return _policy_loss(batch, config, _is_surrogate)


def ppo(batch: LossBatch, config: Mapping[str, float]) -> LossResult:
    """Clipped surrogate: ``Σ w · -min(r·A, clip(r, low, high)·A)``."""
    return _policy_loss(batch, config, _ppo_surrogate)


def cispo(batch: LossBatch, config: Mapping[str, float]) -> LossResult:
    """CISPO (MiniMax-M1): ``Σ w · -sg(clip(r, low, high))·A·logp``; clipping bounds, never zeroes, a token's gradient."""
    return _policy_loss(batch, config, _cispo_surrogate)


def dro(batch: LossBatch, config: Mapping[str, float]) -> LossResult:
    """DRO (Richemond et al. 2024), tinker's form: ``Σ w · -(logp·A - β/2·(logp - logprobs)²)``."""
    return _policy_loss(batch, config, _dro_surrogate)


def gspo(batch: LossBatch, config: Mapping[str, float]) -> LossResult:
    """GSPO-token: ``Σ w · -min(s_t·A, clip(s_t, low, high)·A)`` with the sequence ratio ``s_t``."""
    return _policy_loss(batch, config, _gspo_surrogate(batch.datum_N))
