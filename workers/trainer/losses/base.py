"""The types every loss shares and the masking/metric helpers they are built from.

Why a registry of pure functions: see :mod:`treadle.workers.trainer.losses`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

#: loss_fn_inputs the engine consumes itself before calling a loss.
ENGINE_INPUTS = frozenset({"target_tokens"})


@dataclass(frozen=True)
class LossBatch:
    """One flattened batch: N next-token targets.

    ``logprobs_N`` is the current policy's log-prob of each target (requires
    grad); ``inputs`` holds the float ``loss_fn_inputs`` flattened to N
    (``weights``, ``logprobs`` = behaviour/sampler log-probs, ``advantages``,
    ``ref_logprobs``, ``proximal_logprobs``); ``entropy_N`` is optional and
    only feeds the ``entropy:mean`` metric. ``datum_N`` is the index of the
    datum each token belongs to, for the losses that work per sequence (GSPO);
    ``None`` means the whole batch is one sequence.
    """

    logprobs_N: torch.Tensor
    inputs: Mapping[str, torch.Tensor]
    entropy_N: torch.Tensor | None = None
    datum_N: torch.Tensor | None = None


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


def _counted(batch: LossBatch, mask: torch.Tensor) -> torch.Tensor:
    """The tokens per-token metrics (ratio, approx_kl, clip_frac, entropy, ...)
    describe: the loss's tokens (``mask``), and, when the batch has no
    ``weights`` but has ``advantages``, only those with a non-zero advantage.

    The tinker SDK's policy losses send no weights: a datum's prompt positions
    carry advantage 0 and a placeholder sampler logprob of 0, add nothing to the
    surrogate, and would pull ``ratio:mean`` far below the completion's ratio
    if they were counted (docs/losses.md, "Which tokens a metric counts").
    """
    advantages = batch.inputs.get("advantages")
    if "weights" in batch.inputs or advantages is None:
        return mask
    return mask & (advantages != 0)


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


def _base_metrics(
    loss: torch.Tensor, batch: LossBatch, mask: torch.Tensor, counted: torch.Tensor | None = None
) -> dict[str, float]:
    """``loss:sum``, ``ntokens:sum`` (the tokens the loss sums over: ``mask``) and
    the entropy's mean over the ``counted`` tokens (default: ``mask``)."""
    metrics = {"loss:sum": float(loss.detach()), "ntokens:sum": float(mask.sum())}
    if batch.entropy_N is not None:
        metrics.update(
            _masked_stats(batch.entropy_N, mask if counted is None else counted, "entropy")
        )
    return metrics


# --------------------------------------------------------------------------- losses


def cross_entropy(batch: LossBatch, config: Mapping[str, float]) -> LossResult:
    """Supervised NLL: ``Σ -w · logp``."""
    w, mask = _weights_and_mask(batch)
    logp = torch.where(mask, batch.logprobs_N, torch.zeros_like(batch.logprobs_N))
    loss = -(w * logp).sum()
    return LossResult(loss, _base_metrics(loss, batch, mask))
