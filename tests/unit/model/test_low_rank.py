"""``low_rank_add`` and ``low_rank_add_rows``: the LoRA update and its hand-written
backward equal autograd's own ``y + scale * (x @ A.T) @ B.T`` (float64, so only
rounding order differs)."""

from __future__ import annotations

import pytest
import torch

from treadle.workers.model.low_rank import RowSelection, low_rank_add, low_rank_add_rows

N, S, IN, R, OUT = 3, 5, 12, 4, 7


def _inputs(seed: int, need: tuple[bool, bool, bool, bool]) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shapes = [(N, S, OUT), (N, S, IN), (N, R, IN), (N, OUT, R)]
    return [
        torch.randn(shape, generator=gen, dtype=torch.float64).requires_grad_(grad)
        for shape, grad in zip(shapes, need, strict=True)
    ]


def _reference(y, x, a, b, scale):  # type: ignore[no-untyped-def]
    return y + scale * torch.bmm(torch.bmm(x, a.transpose(1, 2)), b.transpose(1, 2))


@pytest.mark.parametrize("per_problem_scale", [False, True])
@pytest.mark.parametrize(
    "need",
    [
        (True, True, True, True),
        (False, False, True, True),  # the first layer: input from the frozen embedding
        (False, True, False, True),
        (True, False, True, False),
    ],
)
def test_forward_and_gradients_equal_autograd(
    per_problem_scale: bool, need: tuple[bool, bool, bool, bool]
) -> None:
    scale: float | torch.Tensor = 2.5
    if per_problem_scale:
        scale = torch.tensor([0.5, 2.0, 3.0], dtype=torch.float64).view(N, 1, 1)
    ours, ref = _inputs(0, need), _inputs(0, need)
    go = torch.randn(N, S, OUT, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    out = low_rank_add(*ours, scale)
    expected = _reference(*ref, scale)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    out.backward(go)
    expected.backward(go)
    for mine, theirs, grad in zip(ours, ref, need, strict=True):
        if not grad:
            assert mine.grad is None
            continue
        assert mine.grad is not None and theirs.grad is not None
        assert mine.grad.shape == theirs.grad.shape and mine.grad.is_contiguous()
        torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-12, atol=1e-12)


def test_no_grad_gives_the_same_values_without_a_graph() -> None:
    ours = _inputs(2, (True, True, True, True))
    with torch.no_grad():
        out = low_rank_add(*ours, 1.5)
    assert out.grad_fn is None
    torch.testing.assert_close(out, _reference(*ours, 1.5).detach(), rtol=1e-12, atol=1e-12)


# ---- low_rank_add_rows: each adapter on its own rows --------------------------------------

B, T = 8, 3
#: rows 0-1 a range (rank 4), rows 3 and 5 an index (rank 2), row 6 a range (rank 4,
#: another scale); rows 2, 4 and 7 in no part (base-only rows keep y)
PARTS: list[tuple[RowSelection, int, float]] = [
    (slice(0, 2), 4, 2.0),
    (torch.tensor([3, 5]), 2, 0.5),
    (slice(6, 7), 4, 3.0),
]


def _rows_inputs(seed: int, x_grad: bool) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    y0 = torch.randn(B, T, OUT, generator=gen, dtype=torch.float64).requires_grad_()
    x = torch.randn(B, T, IN, generator=gen, dtype=torch.float64).requires_grad_(x_grad)
    ab = []
    for _, rank, _ in PARTS:
        ab.append(torch.randn(rank, IN, generator=gen, dtype=torch.float64).requires_grad_())
        ab.append(torch.randn(OUT, rank, generator=gen, dtype=torch.float64).requires_grad_())
    return y0, x, ab


def _rows_reference(y0, x, ab):  # type: ignore[no-untyped-def]
    out = [y0[b] for b in range(B)]
    for k, (rows, _, scale) in enumerate(PARTS):
        idx = range(B)[rows] if isinstance(rows, slice) else rows.tolist()
        for b in idx:
            out[b] = out[b] + scale * (x[b] @ ab[2 * k].T) @ ab[2 * k + 1].T
    return torch.stack(out)


def _parts(ab: list[torch.Tensor]) -> list[tuple[RowSelection, torch.Tensor, torch.Tensor, float]]:
    return [(rows, ab[2 * k], ab[2 * k + 1], s) for k, (rows, _, s) in enumerate(PARTS)]


@pytest.mark.parametrize("x_grad", [True, False])
def test_rows_forward_and_gradients_equal_autograd(x_grad: bool) -> None:
    y0, x, ab = _rows_inputs(3, x_grad)
    ry0, rx, rab = _rows_inputs(3, x_grad)
    go = torch.randn(B, T, OUT, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    out = low_rank_add_rows(y0 * 1.0, x, _parts(ab))  # y: the output of a base product
    expected = _rows_reference(ry0, rx, rab)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    out.backward(go)
    expected.backward(go)
    for mine, theirs in zip([y0, x, *ab], [ry0, rx, *rab], strict=True):
        if not theirs.requires_grad:
            assert mine.grad is None
            continue
        assert mine.grad is not None and theirs.grad is not None
        assert mine.grad.is_contiguous()
        torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-12, atol=1e-12)


def test_rows_without_grad_and_into_a_strided_y() -> None:
    y0, x, ab = _rows_inputs(5, True)
    expected = _rows_reference(y0, x, ab).detach()
    with torch.no_grad():
        out = low_rank_add_rows(y0.detach().clone(), x, _parts(ab))
        # y a transposed view: its rows are not contiguous
        y_strided = y0.detach().transpose(0, 1).contiguous().transpose(0, 1)
        assert not y_strided[0:2].is_contiguous()
        strided = low_rank_add_rows(y_strided, x, _parts(ab))
    assert out.grad_fn is None
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(strided, expected, rtol=1e-12, atol=1e-12)


def test_a_nan_part_reaches_no_other_row_or_gradient() -> None:
    """Part 1's B is NaN and part 0's rows are infinite: the rows in no part and part
    2's rows, and part 2's gradients, are what they are without them."""
    y0, x, ab = _rows_inputs(6, True)
    clean = low_rank_add_rows(y0 * 1.0, x, _parts(ab))
    clean.sum().backward()
    want = [t.grad.clone() for t in ab[4:]]  # type: ignore[union-attr]
    want_x = x.grad.clone()  # type: ignore[union-attr]
    y0, x, ab = _rows_inputs(6, False)
    with torch.no_grad():
        ab[3].fill_(float("nan"))
        x[0:2] = float("inf")
    x.requires_grad_()
    poisoned = low_rank_add_rows(y0 * 1.0, x, _parts(ab))
    poisoned.sum().backward()
    others = [2, 4, 6, 7]
    torch.testing.assert_close(poisoned[others], clean[others], rtol=0, atol=0)
    for got, expected in zip(ab[4:], want, strict=True):
        torch.testing.assert_close(got.grad, expected, rtol=0, atol=0)
    assert x.grad is not None
    torch.testing.assert_close(x.grad[others], want_x[others], rtol=0, atol=0)
