"""A training call's target logprobs and entropy from one softmax: the same values,
entropy and gradients as computed the plain way, in no more passes over the
``[N, V]`` logits than torch's own ``cross_entropy`` plus the entropy's two."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from treadle.workers.model.llama import target_logprobs
from treadle.workers.trainer import trainer

B, T, V = 3, 5, 40


def _inputs(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(B, T, V, generator=gen, dtype=dtype) * 3
    targets = torch.randint(0, V, (B, T), generator=gen)
    upstream = torch.randn(B, T, generator=gen, dtype=dtype)
    return logits, targets, upstream


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_logprobs_entropy_and_gradient_equal_the_plain_way(
    temperature: float, dtype: torch.dtype
) -> None:
    logits, targets, upstream = _inputs(dtype)
    tol = 1e-12 if dtype == torch.float64 else 1e-5

    x = logits.clone().requires_grad_(True)
    lp, ent = trainer.logprobs_from_logits(x, targets, temperature, with_entropy=True)
    (lp * upstream).sum().backward()

    ref_x = logits.clone().requires_grad_(True)
    ref = target_logprobs(ref_x, targets, temperature)
    logp = torch.log_softmax(logits / temperature, dim=-1)
    ref_ent = -(logp.exp() * logp).sum(-1)
    (ref * upstream).sum().backward()

    assert ent is not None and not ent.requires_grad
    torch.testing.assert_close(lp, ref, rtol=tol, atol=tol)
    torch.testing.assert_close(ent, ref_ent, rtol=tol, atol=tol)
    torch.testing.assert_close(x.grad, ref_x.grad, rtol=tol, atol=tol)


def test_without_entropy_and_without_grad() -> None:
    logits, targets, _ = _inputs(torch.float64)
    lp, ent = trainer.logprobs_from_logits(logits, targets, 0.7, with_entropy=False)
    assert ent is None
    torch.testing.assert_close(lp, target_logprobs(logits, targets, 0.7), rtol=0, atol=1e-12)
    x = logits.clone().requires_grad_(True)
    lp, ent = trainer.logprobs_from_logits(x, targets, 0.7, with_entropy=False)
    assert ent is None and lp.requires_grad


_VIEWS = {"view", "unsqueeze", "squeeze", "detach", "expand", "alias", "_unsafe_view", "t"}


class _FullPasses(TorchDispatchMode):
    """The ops that read or write a whole ``[N, V]`` tensor (views excluded)."""

    def __init__(self, numel: int) -> None:
        super().__init__()
        self.numel, self.ops = numel, []  # type: ignore[var-annotated]

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        touched = tree_leaves((args, kwargs, out))
        if func.__name__.split(".")[0] not in _VIEWS and any(
            isinstance(t, torch.Tensor) and t.numel() == self.numel for t in touched
        ):
            self.ops.append(func.__name__)
        return out


def test_no_more_passes_over_the_logits_than_torch_cross_entropy_and_the_entropy() -> None:
    logits, targets, upstream = _inputs(torch.float32)

    x = logits.clone().requires_grad_(True)
    with _FullPasses(B * T * V) as ours:
        lp, _ = trainer.logprobs_from_logits(x, targets, 0.7, with_entropy=True)
        (lp * upstream).sum().backward()

    y = logits.clone().requires_grad_(True)
    with _FullPasses(B * T * V) as plain:
        nll = torch.nn.functional.cross_entropy(
            (y / 0.7).flatten(0, 1), targets.flatten(), reduction="none"
        )
        (-nll * upstream.flatten()).sum().backward()

    # the entropy's own: the softmax (kept for the backward) and a dot product; and
    # the logsumexp that makes the target's logprob the sampler's to the bit
    assert len(ours.ops) <= len(plain.ops) + 3, (ours.ops, plain.ops)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_training_logprobs_equal_the_samplers_formula_to_the_bit(temperature: float) -> None:
    # forward_backward's logprobs, forward_logprobs' and the sampler's are one formula
    # (llama.target_logprobs): an on-policy importance ratio is exactly 1
    for shape in [(B, T, V), (1, 5, V), (3, 1, V)]:
        torch.manual_seed(sum(shape))
        logits = torch.randn(*shape) * 4
        targets = torch.randint(0, V, shape[:2])
        x = logits.clone().requires_grad_(True)
        lp, _ = trainer.logprobs_from_logits(x, targets, temperature, with_entropy=True)
        assert torch.equal(lp.detach(), target_logprobs(logits, targets, temperature)), shape
