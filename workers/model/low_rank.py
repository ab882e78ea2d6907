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

``low_rank_add`` takes 3-D tensors: ``N`` independent problems (the adapters of a
multi-tenant batch, one equal segment of rows each). ``low_rank_add_rows`` takes
the batch as it is and each adapter's rows (a range or an index), for batches
whose adapters hold unequal or scattered rows; its products keep the same
orientations. In both, an adapter's products read its own rows only, forward and
backward: a NaN or inf in one tenant's adapter or rows stays in that tenant's
rows and gradients.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeAlias

import torch
import torch.nn.functional as F
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


#: Which rows of a batch one adapter's update goes to: a contiguous range (a training
#: call's rows) or an index (rows scattered through the batch: a sampler's).
RowSelection: TypeAlias = slice | Tensor


def low_rank_add_rows(
    y_B_T_O: Tensor,
    x_B_T_I: Tensor,
    parts: Sequence[tuple[RowSelection, Tensor, Tensor, float]],
) -> Tensor:
    """``y[rows] += scale * x[rows] @ A.T @ B.T`` for each ``(rows, A, B, scale)`` of
    ``parts`` (disjoint rows; rows in no part keep ``y``), in place.

    Each adapter's products take its own rows only, forward and backward: no value of
    another part's rows (a NaN, an inf) enters its update or its gradients, and its
    own values reach no other row. The backward assembles ``x``'s gradient in one
    tensor, each part writing its own rows (autograd's slicing and ``index_select``
    would each allocate a zero gradient the size of ``x`` and add them all up)."""
    tensors = [t for _, a, b, _ in parts for t in (a, b)]
    rows = [r for r, _, _, _ in parts]
    scales = [s for _, _, _, s in parts]
    if torch.is_grad_enabled() and any(t.requires_grad for t in (y_B_T_O, x_B_T_I, *tensors)):
        out: Tensor = _LowRankRows.apply(y_B_T_O, x_B_T_I, rows, scales, *tensors)
        return out
    _rows_forward(y_B_T_O, x_B_T_I, rows, scales, tensors)
    return y_B_T_O


def _select(t: Tensor, rows: RowSelection) -> Tensor:
    """``t``'s rows, as ``[rows * T, last]`` (a view for a range of a contiguous ``t``)."""
    sel = t[rows] if isinstance(rows, slice) else t.index_select(0, rows)
    return sel.reshape(-1, t.shape[-1])


def _rows_forward(
    y: Tensor, x: Tensor, rows: list[RowSelection], scales: list[float], ab: list[Tensor]
) -> list[Tensor]:
    """Adds each part's update into ``y``; each part's ``hT`` (``[r, rows * T]``)."""
    hTs = []
    out_dim = y.shape[-1]
    for k, (sel, scale) in enumerate(zip(rows, scales, strict=True)):
        a, b = ab[2 * k], ab[2 * k + 1]
        if isinstance(sel, slice):
            hT = a @ _select(x, sel).t()  # rank-outer: the fast orientation
            y_rows = y[sel]
            if y_rows.is_contiguous():
                y_rows.view(-1, out_dim).addmm_(hT.t(), b.t(), alpha=scale)
            else:
                y_rows.add_(torch.mm(hT.t(), b.t()).view(y_rows.shape), alpha=scale)
        else:
            h = F.linear(x.index_select(0, sel), a)  # a sampler's few rows: plain products
            y.index_add_(0, sel, F.linear(h, b), alpha=scale)
            hT = h.reshape(-1, a.shape[0]).t()
        hTs.append(hT)
    return hTs


class _LowRankRows(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        y: Tensor,
        x: Tensor,
        rows: list[RowSelection],
        scales: list[float],
        *ab: Tensor,
    ) -> Tensor:
        hTs = _rows_forward(y, x, rows, scales, list(ab))
        ctx.mark_dirty(y)
        ctx.save_for_backward(x, *ab, *hTs)
        ctx.rows, ctx.scales = rows, scales
        return y

    @staticmethod
    def backward(ctx: Any, go: Tensor) -> tuple[Tensor | None, ...]:
        saved = ctx.saved_tensors
        n = len(ctx.rows)
        x, ab, hTs = saved[0], saved[1 : 1 + 2 * n], saved[1 + 2 * n :]
        need = ctx.needs_input_grad
        gx = torch.zeros_like(x) if need[1] else None
        grads: list[Tensor | None] = []
        for k, (sel, scale) in enumerate(zip(ctx.rows, ctx.scales, strict=True)):
            a, b, hT = ab[2 * k], ab[2 * k + 1], hTs[k]
            go_M_O = _select(go, sel)
            ghT = torch.mm(b.t(), go_M_O.t()).mul_(scale)  # [r, M]
            grads.append(torch.mm(ghT, _select(x, sel)) if need[4 + 2 * k] else None)
            grads.append(
                torch.mm(hT, go_M_O).mul_(scale).t().contiguous() if need[5 + 2 * k] else None
            )
            if gx is not None:
                gx_rows = torch.mm(ghT.t(), a).view(-1, *x.shape[1:])
                if isinstance(sel, slice):
                    gx[sel] = gx_rows
                else:
                    gx.index_add_(0, sel, gx_rows)
        return (go if need[0] else None, gx, None, None, *grads)
