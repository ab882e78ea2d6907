"""Target logprobs and the entropy of whole logits from one softmax.

A training call needs, per position, ``log_softmax(logits / T)`` at the target
(with its gradient) and, for the ``entropy:mean`` metric, the entropy
``-sum(p * log p)`` (no gradient). Computed apart, as autograd would, they cost
a logsumexp, its backward's ``exp``, a one-hot gradient of the gather, their
sum, and for the entropy a second ``log_softmax``, an ``exp`` and a product:
about a dozen passes over the ``[N, V]`` logits (a 110M model's 32k vocabulary
at 1,024 positions is 131 MB a pass). Here: one logsumexp, one subtraction
(the log-softmax), one ``exp`` (the softmax ``p``, kept for the backward), the
entropy as a dot product per position, and a backward of ``-p * g`` plus the
target's ``+g``, written into one new tensor: what plain torch's
``cross_entropy`` spends, plus the entropy's dot product and the logsumexp
that makes the target's logprob the same to the bit as the sampler's and
``forward_logprobs``' (``llama.target_logprobs``).

The numbers are those of ``llama.target_logprobs`` and of the entropy computed
the plain way, within floating-point rounding
(tests/unit/trainer/test_softmax_logprobs.py checks float64 values and gradients).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


class _TargetLogprobsEntropy(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, logits_N_V: Tensor, targets_N: Tensor, temperature: float, with_entropy: bool
    ) -> tuple[Tensor, Tensor]:
        scaled = logits_N_V / temperature if temperature != 1.0 else logits_N_V
        # the target's logprob exactly as ``llama.target_logprobs`` computes it (the
        # sampler's and forward_logprobs' formula), so the three agree to the bit
        # and an on-policy ratio is exactly 1
        lse_N = torch.logsumexp(scaled, dim=-1)
        lp_N = scaled.gather(-1, targets_N[:, None]).squeeze(-1) - lse_N
        logp = scaled - lse_N[:, None]
        del scaled
        if with_entropy:  # -sum(p * log p), a dot product per position: no [N, V] product
            p = logp.exp()
            ent_N = -torch.bmm(p[:, None, :], logp[:, :, None]).view(-1)
        else:  # the log-softmax is not needed after the softmax: no second [N, V] tensor
            p = logp.exp_()
            ent_N = lp_N.new_zeros(0)
        ctx.save_for_backward(p, targets_N)
        ctx.temperature = temperature
        ctx.mark_non_differentiable(ent_N)
        return lp_N, ent_N

    @staticmethod
    def backward(ctx: Any, g_lp_N: Tensor, _g_ent: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        p, targets_N = ctx.saved_tensors
        g = g_lp_N[:, None]
        # d lp / d logits = (onehot(target) - softmax) / T, times the upstream gradient
        grad = torch.mul(p, g.neg()).scatter_add_(-1, targets_N[:, None], g)
        if ctx.temperature != 1.0:
            grad.div_(ctx.temperature)
        return grad, None, None, None


def target_logprobs_and_entropy(
    logits_B_T_V: Tensor, targets_B_T: Tensor, temperature: float, *, with_entropy: bool
) -> tuple[Tensor, Tensor | None]:
    """``log_softmax(logits / T)`` at ``targets``, ``[B, T]`` (with grad), and, if
    asked, the entropy of ``softmax(logits / T)``, ``[B, T]`` (no grad); logits
    below float32 are computed in float32."""
    logits = logits_B_T_V
    if logits.dtype not in (torch.float32, torch.float64):
        logits = logits.float()
    *lead, V = logits.shape
    lp_N, ent_N = _TargetLogprobsEntropy.apply(
        logits.reshape(-1, V), targets_B_T.reshape(-1), temperature, with_entropy
    )
    return lp_N.view(*lead), (ent_N.view(*lead) if with_entropy else None)
