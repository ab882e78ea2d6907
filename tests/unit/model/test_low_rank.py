"""``low_rank_add``: the LoRA update and its hand-written backward equal autograd's
own ``y + scale * (x @ A.T) @ B.T`` (float64, so only rounding order differs)."""

from __future__ import annotations

import pytest
import torch

from treadle.workers.model.low_rank import low_rank_add

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
