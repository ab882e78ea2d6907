"""The loss registry: every objective ``ForwardBackward`` can run, as pure functions.

Why a registry of pure functions: the trainer stays one loop (forward, call the
registered function, backward) and each objective can be unit-tested on tiny
tensors without a model. The engine flattens a batch's next-token targets into
one vector of N tokens (the tinker alignment: position t of a datum's
``loss_fn_inputs`` refers to the target predicted from ``model_input[..t]``),
computes the current policy's log-prob of each target at the request
temperature, and calls :func:`compute_loss`.

Contracts kept here (DESIGN.md):

* **Losses are sums.** Every loss is ``Σ_t w_t · ℓ_t`` with no hidden
  denominator, so several ``ForwardBackward`` calls before one ``OptimStep``
  add up to the same gradient as one call. Normalisation (token mean, GRPO's
  sequence mean, Dr.GRPO's constant) is the client's job: ``treadle.rl``
  scales ``weights``.
* **Masking.** Tokens with ``w_t == 0`` (prompt targets) contribute nothing and
  are left out of every ``:mean``/``:min``/``:max`` metric. Log-ratios are
  zeroed on those tokens *before* ``exp`` so that a garbage value there (the
  behaviour log-prob of a prompt token is 0 by convention) can never produce
  ``0 · inf = nan``.
* **Names follow tinker**: ``clip_low_threshold``/``clip_high_threshold`` are
  ratio thresholds; defaults match the tinker docs and cookbook (PPO 0.8/1.2,
  CISPO 0.0/4.0).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

import torch

from treadle.errors import InvalidArgumentError

#: loss_fn_inputs the engine consumes itself before calling a loss.
ENGINE_INPUTS = frozenset({"target_tokens"})


@dataclass(frozen=True)
class LossBatch:
    """One flattened batch: N next-token targets.

    ``logprobs_N`` is the current policy's log-prob of each target (requires
    grad); ``inputs`` holds the float ``loss_fn_inputs`` flattened to N
    (``weights``, ``logprobs`` = behaviour/sampler log-probs, ``advantages``,
    ``ref_logprobs``, ``proximal_logprobs``); ``entropy_N`` is optional and
    only feeds the ``entropy:mean`` metric.
    """

    logprobs_N: torch.Tensor
    inputs: Mapping[str, torch.Tensor]
    entropy_N: torch.Tensor | None = None


@dataclass(frozen=True)
class LossResult:
    """``loss`` is the scalar SUM over tokens; its ``backward()`` is what the engine accumulates."""

    loss: torch.Tensor
    metrics: dict[str, float]


LossFn = Callable[[LossBatch, Mapping[str, float]], LossResult]


@dataclass(frozen=True)
class LossSpec:
    """A registered loss: its function, the inputs it reads and its config keys."""

    name: str
    fn: LossFn
    required_inputs: frozenset[str]
    optional_inputs: frozenset[str]
    config_defaults: Mapping[str, float]

    @property
    def known_inputs(self) -> frozenset[str]:
        return self.required_inputs | self.optional_inputs


# --------------------------------------------------------------------------- helpers


def _weights_and_mask(batch: LossBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token weights (default 1) and the mask of tokens that carry loss.

    The mask is ``w != 0`` rather than ``w > 0`` so that cross_entropy with the
    signed weights of ``forward_backward_custom`` (``-dLoss/dlogprob``) still
    counts every token it trains on.
    """
    logp = batch.logprobs_N
    w = batch.inputs.get("weights")
    if w is None:
        w = torch.ones_like(logp, requires_grad=False)
    return w, w != 0


def _masked_diff(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``a - b`` on masked tokens, 0 elsewhere (so ``exp`` of it is 1 there, never inf)."""
    return torch.where(mask, a - b, torch.zeros_like(a))


def _k3(log_ratio: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL: ``exp(x) - x - 1`` with ``x = log(p_other / p_sample)``.

    Non-negative, unbiased for KL(sample ‖ other) under samples from the
    sampling distribution, and low-variance; 0 where ``x == 0``.
    """
    return torch.exp(log_ratio) - log_ratio - 1.0


def _masked_stats(
    values: torch.Tensor, mask: torch.Tensor, name: str, *, extremes: bool = False
) -> dict[str, float]:
    """``name:mean`` (and ``:min``/``:max``) over masked tokens; empty when no token counts.

    Means are plain token means over the mask, not weighted: the weights carry
    the client's normalisation, which would otherwise leak into diagnostics.
    """
    selected = values.detach()[mask]
    if selected.numel() == 0:
        return {}
    out = {f"{name}:mean": float(selected.double().mean())}
    if extremes:
        out[f"{name}:min"] = float(selected.min())
        out[f"{name}:max"] = float(selected.max())
    return out


def _base_metrics(loss: torch.Tensor, batch: LossBatch, mask: torch.Tensor) -> dict[str, float]:
    metrics = {"loss:sum": float(loss.detach()), "ntokens:sum": float(mask.sum())}
    if batch.entropy_N is not None:
        metrics.update(_masked_stats(batch.entropy_N, mask, "entropy"))
    return metrics


# --------------------------------------------------------------------------- losses


def cross_entropy(batch: LossBatch, config: Mapping[str, float]) -> LossResult:
    """Supervised NLL: ``Σ -w · logp``."""
    w, mask = _weights_and_mask(batch)
    logp = torch.where(mask, batch.logprobs_N, torch.zeros_like(batch.logprobs_N))
    loss = -(w * logp).sum()
    return LossResult(loss, _base_metrics(loss, batch, mask))


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
    per_token, ratio, clipped, extra = surrogate(logp, inputs, mask, config)

    metrics: dict[str, float] = {}
    kl_beta = config.get("kl_beta", 0.0)
    ref = inputs.get("ref_logprobs")
    if ref is not None:
        # log(pi_ref / pi_theta) on tokens sampled from pi_theta: k3 estimates KL(pi_theta || pi_ref).
        kl_ref = _k3(_masked_diff(ref, logp, mask))
        if kl_beta > 0:
            per_token = per_token + kl_beta * kl_ref
        metrics.update(_masked_stats(kl_ref, mask, "kl_ref"))
    elif kl_beta > 0:
        raise InvalidArgumentError(
            "loss_fn_inputs.ref_logprobs: required when loss_fn_config.kl_beta > 0 "
            "(the engine fills it with the base model's log-probs when the client does not)"
        )

    loss = (w * per_token).sum()
    metrics.update(_base_metrics(loss, batch, mask))
    with torch.no_grad():
        metrics.update(_masked_stats(ratio, mask, "ratio", extremes=True))
        if clipped is not None:
            metrics.update(_masked_stats(clipped.to(logp.dtype), mask, "clip_frac"))
        # Drift of the current policy from the data's (behaviour) policy, k3 of KL(behaviour || current).
        data_log_ratio = _masked_diff(logp, inputs["logprobs"], mask)
        metrics.update(_masked_stats(_k3(data_log_ratio), mask, "approx_kl"))
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


# --------------------------------------------------------------------------- registry

_POLICY_REQUIRED = frozenset({"target_tokens", "logprobs", "advantages"})
_POLICY_OPTIONAL = frozenset({"weights", "ref_logprobs"})
_DECOUPLED = frozenset({"proximal_logprobs"})

LOSSES: Mapping[str, LossSpec] = MappingProxyType(
    {
        "cross_entropy": LossSpec(
            "cross_entropy",
            cross_entropy,
            required_inputs=frozenset({"target_tokens", "weights"}),
            optional_inputs=frozenset(),
            config_defaults=MappingProxyType({}),
        ),
        "importance_sampling": LossSpec(
            "importance_sampling",
            importance_sampling,
            required_inputs=_POLICY_REQUIRED,
            optional_inputs=_POLICY_OPTIONAL,
            config_defaults=MappingProxyType({"kl_beta": 0.0, "ratio_cap": 0.0}),
        ),
        "ppo": LossSpec(
            "ppo",
            ppo,
            required_inputs=_POLICY_REQUIRED,
            optional_inputs=_POLICY_OPTIONAL | _DECOUPLED,
            config_defaults=MappingProxyType(
                {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2, "kl_beta": 0.0}
            ),
        ),
        "cispo": LossSpec(
            "cispo",
            cispo,
            required_inputs=_POLICY_REQUIRED,
            optional_inputs=_POLICY_OPTIONAL | _DECOUPLED,
            config_defaults=MappingProxyType(
                {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0, "kl_beta": 0.0}
            ),
        ),
        "dro": LossSpec(
            "dro",
            dro,
            required_inputs=_POLICY_REQUIRED,
            optional_inputs=_POLICY_OPTIONAL,
            config_defaults=MappingProxyType({"beta": 0.05, "kl_beta": 0.0}),
        ),
    }
)

#: Every input name some loss reads; anything else is a typo and is rejected.
KNOWN_INPUTS = frozenset().union(*(spec.known_inputs for spec in LOSSES.values()))

#: Range rules for config values: key -> (predicate, what it must be).
_CONFIG_RULES: Mapping[str, tuple[Callable[[float], bool], str]] = {
    "clip_low_threshold": (lambda v: v >= 0, ">= 0"),
    "clip_high_threshold": (lambda v: v > 0, "> 0"),
    "kl_beta": (lambda v: v >= 0, ">= 0"),
    "ratio_cap": (lambda v: v >= 0, ">= 0 (0 disables the cap)"),
    "beta": (lambda v: v >= 0, ">= 0"),
}


def _spec(name: str) -> LossSpec:
    spec = LOSSES.get(name)
    if spec is None:
        raise InvalidArgumentError(
            f"loss_fn: unknown loss {name!r}; expected one of {sorted(LOSSES)}"
        )
    return spec


def _resolve_config(spec: LossSpec, config: Mapping[str, float] | None) -> dict[str, float]:
    resolved = dict(spec.config_defaults)
    for key, value in (config or {}).items():
        field = f"loss_fn_config.{key}"
        if key not in spec.config_defaults:
            accepted = sorted(spec.config_defaults) or "none"
            raise InvalidArgumentError(
                f"{field}: not a config key of loss {spec.name!r} (accepted: {accepted})"
            )
        try:
            number = float(value)
        except (TypeError, ValueError) as exc:
            raise InvalidArgumentError(f"{field}: expected a number, got {value!r}") from exc
        if not math.isfinite(number):
            raise InvalidArgumentError(f"{field}: must be finite, got {number}")
        rule, expectation = _CONFIG_RULES[key]
        if not rule(number):
            raise InvalidArgumentError(f"{field}: must be {expectation}, got {number}")
        resolved[key] = number
    _check_ratio_thresholds(resolved)
    return resolved


def _g(x: float) -> str:
    return f"{x:.6g}"


def _trl_hint(low: float, high: float) -> str:
    """What TRL's epsilons would be as treadle's ratio thresholds, for the values given."""
    if low == high:
        return (
            f"TRL's epsilon={_g(low)} is clip_low_threshold={_g(1 - low)}, "
            f"clip_high_threshold={_g(1 + low)}"
        )
    return (
        f"TRL's epsilon={_g(low)}, epsilon_high={_g(high)} is "
        f"clip_low_threshold={_g(1 - low)}, clip_high_threshold={_g(1 + high)}"
    )


def _check_ratio_thresholds(resolved: Mapping[str, float]) -> None:
    """Refuse ratio thresholds no one means: an interval that leaves out ratio 1.

    ``clip_low_threshold``/``clip_high_threshold`` are ratio thresholds (tinker's
    names), where TRL and the papers write ε: ``clip(r, 1-ε, 1+ε_high)``. Typing
    TRL's ε as a threshold (``0.2``/``0.2``) clips every token, including the
    on-policy ones at ratio 1, so nothing learns and nothing fails: refused here,
    with the translation. A ``ratio_cap`` below 1 likewise caps every on-policy token.
    """
    cap = resolved.get("ratio_cap", 0.0)
    if 0 < cap < 1:
        raise InvalidArgumentError(
            f"loss_fn_config.ratio_cap: {_g(cap)} is below ratio 1, so it caps every on-policy "
            "token; it is a ratio threshold: use 0 (off) or a cap above 1, e.g. 2.0"
        )
    if "clip_low_threshold" not in resolved:
        return
    low, high = resolved["clip_low_threshold"], resolved["clip_high_threshold"]
    interval = f"[{_g(low)}, {_g(high)}]"
    if high < 1:
        raise InvalidArgumentError(
            f"loss_fn_config.clip_high_threshold: {_g(high)} is below 1, so the clip interval "
            f"{interval} (clip_low_threshold, clip_high_threshold) excludes ratio 1 and clips "
            f"every token. These are ratio thresholds, clip(r, 1-epsilon, 1+epsilon_high), not "
            f"TRL's epsilons: {_trl_hint(low, high)}"
        )
    if low > high:
        raise InvalidArgumentError(
            f"loss_fn_config.clip_low_threshold: {_g(low)} exceeds clip_high_threshold "
            f"{_g(high)}; both are ratio thresholds around 1, e.g. 0.8/1.2 (TRL's epsilon=0.2)"
        )
    if low > 1:
        raise InvalidArgumentError(
            f"loss_fn_config.clip_low_threshold: {_g(low)} is above 1, so the clip interval "
            f"{interval} excludes ratio 1 and clips every token; the lower ratio threshold is "
            f"1 - epsilon, e.g. TRL's epsilon=0.2 is clip_low_threshold=0.8"
        )


def _check_input_names(spec: LossSpec, input_keys: Iterable[str]) -> None:
    keys = set(input_keys)
    unknown = sorted(keys - KNOWN_INPUTS)
    if unknown:
        raise InvalidArgumentError(
            f"loss_fn_inputs.{unknown[0]}: unknown input (inputs of {spec.name!r}: "
            f"required {sorted(spec.required_inputs)}, optional {sorted(spec.optional_inputs)})"
        )
    missing = sorted(spec.required_inputs - keys)
    if missing:
        raise InvalidArgumentError(f"loss_fn_inputs.{missing[0]}: required by loss {spec.name!r}")


def validate_loss_request(
    name: str, input_keys: Iterable[str], config: Mapping[str, float] | None
) -> dict[str, float]:
    """Check a request before any work is done; return the config with defaults filled in.

    ``input_keys`` are the datum's ``loss_fn_inputs`` keys (``target_tokens``
    included). Inputs another loss reads (e.g. ``advantages`` sent to
    ``cross_entropy``) are ignored; names no loss reads are rejected as typos.
    """
    spec = _spec(name)
    resolved = _resolve_config(spec, config)
    _check_input_names(spec, input_keys)
    return resolved


def needs_reference(
    name: str, config: Mapping[str, float] | None, input_keys: Iterable[str] = ()
) -> bool:
    """Whether the engine must compute ``ref_logprobs`` (a forward with the adapter off).

    True when the loss has a KL penalty (``kl_beta > 0``) and ``input_keys``
    does not already hold client-supplied ``ref_logprobs``.
    """
    resolved = _resolve_config(_spec(name), config)
    return resolved.get("kl_beta", 0.0) > 0 and "ref_logprobs" not in set(input_keys)


def _check_tensors(batch: LossBatch) -> None:
    logp = batch.logprobs_N
    if logp.ndim != 1:
        raise InvalidArgumentError(
            f"logprobs_N: expected a 1-D tensor, got shape {tuple(logp.shape)}"
        )
    for key, value in batch.inputs.items():
        if value.shape != logp.shape:
            raise InvalidArgumentError(
                f"loss_fn_inputs.{key}: length {tuple(value.shape)} does not match the {logp.shape[0]} target tokens"
            )
        if not bool(torch.isfinite(value).all()):
            raise InvalidArgumentError(f"loss_fn_inputs.{key}: contains NaN or inf")


def compute_loss(
    name: str, batch: LossBatch, config: Mapping[str, float] | None = None
) -> LossResult:
    """Validate, then run the registered loss. Errors name the offending field."""
    spec = _spec(name)
    resolved = _resolve_config(spec, config)
    _check_input_names(spec, set(batch.inputs) | ENGINE_INPUTS)
    # Only the inputs this loss reads are checked and passed on.
    inputs = {
        k: v for k, v in batch.inputs.items() if k in spec.known_inputs and k not in ENGINE_INPUTS
    }
    used = LossBatch(batch.logprobs_N, inputs, batch.entropy_N)
    _check_tensors(used)
    return spec.fn(used, resolved)
