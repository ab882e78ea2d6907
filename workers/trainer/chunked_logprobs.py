"""Target logprobs through the unembedding in chunks of positions, so the
``[N, V]`` logits (and their gradient) never exist whole.

With long sequences and a large vocabulary the logits dominate a training
step's memory: 4 x 1,024 positions x 32,000 tokens is 524 MB in float32, and
autograd keeps them plus a softmax and a gradient of the same size. Here each
chunk of positions is unembedded, reduced to its target logprob, its
logsumexp and (no grad) its entropy, and dropped; the backward recomputes the
chunk's logits (one more ``[c, H] x [H, V]`` matmul per chunk) and turns them
straight into the gradients of the hidden states and the unembedding.

The numbers are those of ``lm_logits`` + ``target_logprobs`` (+ the trainer's
entropy), reordered by chunk: the same within floating-point rounding
(tests/unit/test_chunked_logprobs.py checks float64 values and gradients).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from treadle.workers.model.prepack import linear

#: the logits of one chunk stay under this (float32 bytes); also the size above
#: which the trainer chunks at all (``trainer.LOGITS_CHUNK_BYTES``)
CHUNK_BYTES = 64 * 2**20


def _chunk_logits(hidden_c_H: Tensor, weight_V_H: Tensor, temperature: float) -> Tensor:
    logits = linear(hidden_c_H, weight_V_H)
    if logits.dtype not in (torch.float32, torch.float64):
        logits = logits.float()
    return logits / temperature if temperature != 1.0 else logits


class _ChunkedTargetLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden_N_H: Tensor,
        weight_V_H: Tensor,
        targets_N: Tensor,
        temperature: float,
        rows: int,
        with_entropy: bool,
    ) -> tuple[Tensor, Tensor]:
        N = hidden_N_H.shape[0]
        out_dtype = torch.float64 if hidden_N_H.dtype == torch.float64 else torch.float32
        lp_N = hidden_N_H.new_empty(N, dtype=out_dtype)
        lse_N = hidden_N_H.new_empty(N, dtype=out_dtype)
        ent_N = hidden_N_H.new_zeros(N if with_entropy else 0, dtype=out_dtype)
        for s in range(0, N, rows):
            e = min(s + rows, N)
            logits = _chunk_logits(hidden_N_H[s:e], weight_V_H, temperature)
            lse = torch.logsumexp(logits, dim=-1)
            lse_N[s:e] = lse
            lp_N[s:e] = logits.gather(-1, targets_N[s:e, None]).squeeze(-1) - lse
            if with_entropy:
                logp = logits.sub_(lse[:, None])
                ent_N[s:e] = -(logp.exp() * logp).sum(-1)
        ctx.save_for_backward(hidden_N_H, weight_V_H, targets_N, lse_N)
        ctx.temperature = temperature
        ctx.rows = rows
        ctx.mark_non_differentiable(ent_N)
        return lp_N, ent_N

    @staticmethod
    def backward(ctx: Any, g_lp_N: Tensor, _g_ent: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        hidden_N_H, weight_V_H, targets_N, lse_N = ctx.saved_tensors
        T, rows = ctx.temperature, ctx.rows
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        g_h = torch.empty_like(hidden_N_H) if want_h else None
        g_w = torch.zeros_like(weight_V_H) if want_w else None
        for s in range(0, hidden_N_H.shape[0], rows):
            e = min(s + rows, hidden_N_H.shape[0])
            h_c = hidden_N_H[s:e]
            g_c = g_lp_N[s:e, None]
            # d lp / d logits = (onehot(target) - softmax) / T, times the upstream gradient
            grad = _chunk_logits(h_c, weight_V_H, T).sub_(lse_N[s:e, None]).exp_()
            grad.mul_(-g_c).scatter_add_(-1, targets_N[s:e, None], g_c)
            if T != 1.0:
                grad.div_(T)
            grad = grad.to(weight_V_H.dtype)
            if g_h is not None:
                torch.mm(grad, weight_V_H, out=g_h[s:e])
            if g_w is not None:
                g_w.addmm_(grad.t(), h_c)
        return g_h, g_w, None, None, None, None


def chunked_target_logprobs(
    hidden_B_T_H: Tensor,
    weight_V_H: Tensor,
    targets_B_T: Tensor,
    temperature: float,
    *,
    with_entropy: bool,
    chunk_bytes: int = CHUNK_BYTES,
) -> tuple[Tensor, Tensor | None]:
    """Target logprobs ``[B, T]`` (with grad) and, if asked, the entropy ``[B, T]``
    (no grad) at ``temperature``, never holding more than ``chunk_bytes`` of logits."""
    B, T, H = hidden_B_T_H.shape
    V = weight_V_H.shape[0]
    rows = max(1, chunk_bytes // (4 * V))
    lp_N, ent_N = _ChunkedTargetLogprobs.apply(
        hidden_B_T_H.reshape(B * T, H),
        weight_V_H,
        targets_B_T.reshape(B * T),
        temperature,
        rows,
        with_entropy,
    )
    return lp_N.view(B, T), (ent_N.view(B, T) if with_entropy else None)
