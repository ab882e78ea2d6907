"""The registry: loss name -> function, inputs and config defaults; request validation."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from types import MappingProxyType

import torch

from treadle.common.engine.losses import CONTRACTS, KNOWN_INPUTS, unserved_loss
from treadle.errors import InvalidArgumentError
from treadle.workers.trainer.losses.base import (
    ENGINE_INPUTS,
    LossBatch,
    LossFn,
    LossResult,
    LossSpec,
    cross_entropy,
)
from treadle.workers.trainer.losses.policy import cispo, dro, gspo, importance_sampling, ppo

# --------------------------------------------------------------------------- registry

#: loss name -> the function that computes it (the contract: ``common.engine.losses``)
_FUNCTIONS: Mapping[str, LossFn] = {
    "cross_entropy": cross_entropy,
    "importance_sampling": importance_sampling,
    "ppo": ppo,
    "cispo": cispo,
    "dro": dro,
    "gspo": gspo,
}

LOSSES: Mapping[str, LossSpec] = MappingProxyType(
    {
        name: LossSpec(
            name,
            _FUNCTIONS[name],
            required_inputs=c.required_inputs,
            optional_inputs=c.optional_inputs,
            config_defaults=c.config_defaults,
        )
        for name, c in CONTRACTS.items()
    }
)


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
        raise unserved_loss(name)
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
    used = LossBatch(batch.logprobs_N, inputs, batch.entropy_N, batch.datum_N)
    _check_tensors(used)
    return spec.fn(used, resolved)
