"""The LoRA update ``y + scale * x @ A.T @ B.T``, its products oriented for a CPU GEMM.

A LoRA product has one thin side: the rank ``r`` (8 or 16) against hidden
sizes in the hundreds or thousands. CPU GEMM libraries (MKL, oneDNN) run a
product whose *output* is tall and thin (``[M, r]``, ``[out, r]``) several
times slower than the same product transposed (``[r, M]``, ``[r, out]``):
on a 2-core AMD EPYC, one thread, ``[4, 32, 256] @ [4, 256, 8]`` took 39 µs
and its transpose ``[4, 8, 256] @ [4, 256, 32]`` 12 µs; the gradient of
``B`` (``go.T @ h``, ``[256, 32] @ [32, 8]`` per segment) 44 µs against 11 µs
for ``h.T @ go``. Autograd's own backward of these products (``bmm``,
``F.linear``) takes the slow orientations. So the update is one autograd function whose forward keeps
``h`` transposed (``hT = A @ x.T``, ``[r, M]``) and whose backward computes
every product with ``r`` as its row count:

* ``d hT = B.T @ go.T`` (scaled), ``[r, M]``;
* ``d B = (hT @ go).T`` (scaled), ``[out, r]``;
* ``d A = d hT @ x``, ``[r, in]``;
* ``d x = d hT.T @ A``, ``[M, in]``;
* ``d y = go``.

Measured on that machine for one projection of four adapters' segments of
32 rows, forward and backward together: 274-406 µs with autograd's products,
224-331 µs here; in the "5m" model's batched ``forward_backward`` of four
tenants (one thread, the same process alternating both forms) 2.8-4.9% less
time a round. One adapter on its own rows keeps two plain ``F.linear``: there
the backward's Python overhead ate the gain (no faster in the same test).
Each product computes the same sums as autograd's, in an order that can
differ in the last bits.

Every tensor is 3-D: ``N`` independent problems (the adapters of a
multi-tenant batch, one segment of rows each).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


def low_rank_add(
    y_N_S_O: Tensor, x_N_S_I: Tensor, a_N_R_I: Tensor, b_N_O_R: Tensor, scale: float | Tensor
) -> Tensor:
    """``y + scale * x @ A.T @ B.T`` per problem; ``scale`` a float or ``[N, 1, 1]``.

    Under no-grad (the sampler) the forward runs as is; otherwise through
    ``_LowRank``, whose backward takes the fast orientations."""
    if torch.is_grad_enabled() and any(
        t.requires_grad for t in (y_N_S_O, x_N_S_I, a_N_R_I, b_N_O_R)
    ):
        out: Tensor = _LowRank.apply(y_N_S_O, x_N_S_I, a_N_R_I, b_N_O_R, scale)
        return out
    return _forward(y_N_S_O, torch.bmm(a_N_R_I, x_N_S_I.transpose(1, 2)), b_N_O_R, scale)


def _forward(y_N_S_O: Tensor, hT_N_R_S: Tensor, b_N_O_R: Tensor, scale: float | Tensor) -> Tensor:
    if isinstance(scale, Tensor):
        return torch.baddbmm(y_N_S_O, (hT_N_R_S * scale).transpose(1, 2), b_N_O_R.transpose(1, 2))
    return torch.baddbmm(y_N_S_O, hT_N_R_S.transpose(1, 2), b_N_O_R.transpose(1, 2), alpha=scale)


class _LowRank(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        y_N_S_O: Tensor,
        x_N_S_I: Tensor,
        a_N_R_I: Tensor,
        b_N_O_R: Tensor,
        scale: float | Tensor,
    ) -> Tensor:
        hT_N_R_S = torch.bmm(a_N_R_I, x_N_S_I.transpose(1, 2))
        ctx.save_for_backward(x_N_S_I, a_N_R_I, b_N_O_R, hT_N_R_S)
        ctx.scale = scale
        return _forward(y_N_S_O, hT_N_R_S, b_N_O_R, scale)

    @staticmethod
    def backward(ctx: Any, go_N_S_O: Tensor) -> tuple[Tensor | None, ...]:
        x_N_S_I, a_N_R_I, b_N_O_R, hT_N_R_S = ctx.saved_tensors
        need_y, need_x, need_a, need_b, _ = ctx.needs_input_grad
        scale = ctx.scale
        ga = gx = gb = None
        if need_x or need_a:
            ghT_N_R_S = torch.bmm(b_N_O_R.transpose(1, 2), go_N_S_O.transpose(1, 2)).mul_(scale)
            if need_a:
                ga = torch.bmm(ghT_N_R_S, x_N_S_I)
            if need_x:
                gx = torch.bmm(ghT_N_R_S.transpose(1, 2), a_N_R_I)
        if need_b:
            gb = torch.bmm(hT_N_R_S, go_N_S_O).mul_(scale).transpose(1, 2).contiguous()
        return (go_N_S_O if need_y else None), gx, ga, gb, None
