"""A shared prefix computed once (``workers.model.shared_prefix``) against the plain
forward: the same hidden states and the same gradients, in float64 to rounding.

GRPO's batches are the case: G completions of each prompt, shuffled into
minibatches. The plain ``forward_hidden`` over the padded rows is the reference.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from treadle.common.engine.model_config import ModelConfig
from treadle.workers.model import shared_prefix
from treadle.workers.model.llama import LlamaParams, forward_hidden, param_shapes
from treadle.workers.model.lora import LoraAdapter

BASE = ModelConfig(
    arch="qwen3",  # q/k norms
    vocab_size=40,
    hidden_size=32,
    intermediate_size=48,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,  # grouped-query attention
    head_dim=8,
    attention_bias=True,
)
CONFIGS = {
    "qwen3-gqa-bias": BASE,
    "llama": dataclasses.replace(BASE, arch="llama", num_kv_heads=4, attention_bias=False),
}


def _params(cfg: ModelConfig, seed: int = 0) -> LlamaParams:
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in param_shapes(cfg).items():
        scale = 0.2 if name.endswith("norm.weight") else 0.3
        base = 1.0 if name.endswith("norm.weight") else 0.0
        tensors[name] = (base + scale * torch.randn(shape, generator=gen)).double()
    return LlamaParams.from_state_dict(cfg, tensors)


def _grpo_rows(seed: int, prompts: int = 6, group: int = 4, keep: int | None = None) -> list:
    """``group`` completions (1-5 tokens) of each of ``prompts`` prompts (3-8 tokens),
    shuffled, the first ``keep`` kept (a minibatch)."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(prompts):
        prompt = rng.integers(1, 40, size=int(rng.integers(3, 9)))
        for _ in range(group):
            rows.append(np.concatenate((prompt, rng.integers(1, 40, size=int(rng.integers(1, 6))))))
    order = rng.permutation(len(rows))[:keep]
    return [rows[i] for i in order]


def _padded(rows: list) -> tuple[torch.Tensor, torch.Tensor]:
    T = max(r.size for r in rows)
    tokens = np.zeros((len(rows), T), dtype=np.int64)
    for b, r in enumerate(rows):
        tokens[b, : r.size] = r
    valid = np.arange(T)[None] < np.array([r.size for r in rows])[:, None]
    return torch.from_numpy(tokens), torch.from_numpy(valid)


def _loss(hidden_B_T_H: torch.Tensor, valid_B_T: torch.Tensor) -> torch.Tensor:
    weights = torch.linspace(-1, 2, hidden_B_T_H.shape[-1], dtype=hidden_B_T_H.dtype)
    return (torch.sin(hidden_B_T_H[valid_B_T]) * weights).sum()


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("with_lora", [False, True])
def test_hidden_states_and_gradients_equal_the_plain_forward(name: str, with_lora: bool) -> None:
    cfg = CONFIGS[name]
    params = _params(cfg).requires_grad_()
    lora = None
    if with_lora:
        lora = LoraAdapter(cfg, 4, 8.0, seed=2, dtype=torch.float64)
        for layer in lora.b:  # nonzero B, as after training
            for b in layer.values():
                b.data.normal_(0, 0.3, generator=torch.Generator().manual_seed(5))
    trained = lora.parameters() if lora is not None else params.parameters()
    rows = _grpo_rows(seed=1, keep=17)
    layout = shared_prefix.plan(rows)
    assert layout is not None and layout.prefix_len_G.size < len(rows)
    tokens, valid = _padded(rows)

    plain = forward_hidden(cfg, params, tokens, lora=lora)
    shared = shared_prefix.forward_hidden_shared(cfg, params, layout, lora=lora)
    torch.testing.assert_close(shared[valid], plain[valid], rtol=0, atol=1e-12)
    g_plain = torch.autograd.grad(_loss(plain, valid), trained, allow_unused=True)
    g_shared = torch.autograd.grad(_loss(shared, valid), trained, allow_unused=True)
    assert sum(g is not None for g in g_plain) >= len(trained) - 2  # all but the head's
    for a, b in zip(g_shared, g_plain, strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-11)


def test_a_prefix_feeds_the_gradient_of_every_row_that_shares_it() -> None:
    """Three rows share a prompt: the embedding gradient of a prompt token is the sum
    of three rows' contributions, as the plain forward's three copies give."""
    cfg = CONFIGS["llama"]
    params = _params(cfg, seed=3).requires_grad_()
    prompt = np.array([5, 6, 7, 8, 9])
    rows = [np.concatenate((prompt, [t])) for t in (11, 12, 13)] + [np.array([20, 21, 22])]
    layout = shared_prefix.plan(rows)
    assert layout is not None
    assert sorted(layout.prefix_len_G.tolist()) == [2, 5]  # the prompt; the lone row's own
    tokens, valid = _padded(rows)
    (g_plain,) = torch.autograd.grad(
        _loss(forward_hidden(cfg, params, tokens), valid), params.embed_tokens
    )
    (g_shared,) = torch.autograd.grad(
        _loss(shared_prefix.forward_hidden_shared(cfg, params, layout), valid), params.embed_tokens
    )
    assert float(g_plain[5].abs().sum()) > 0
    torch.testing.assert_close(g_shared, g_plain, rtol=1e-10, atol=1e-12)


def test_plan_groups_completions_of_a_prompt_and_keeps_a_token_per_row() -> None:
    rows = _grpo_rows(seed=4, prompts=5, group=8)
    layout = shared_prefix.plan(rows)
    assert layout is not None
    assert layout.prefix_len_G.size == 5  # one group per prompt
    for b, row in enumerate(rows):
        g = layout.group_B[b]
        p = int(layout.prefix_len_G[g])
        assert row.size - p >= 1  # a token of its own
        np.testing.assert_array_equal(layout.prefix_tokens_G_P[g, :p], row[:p])
        np.testing.assert_array_equal(layout.suffix_tokens_B_S[b, : row.size - p], row[p:])
    assert layout.positions < 0.75 * len(rows) * max(r.size for r in rows)


def test_a_row_that_is_another_rows_prefix_keeps_its_last_token() -> None:
    """Rows equal to the shared prefix, or shorter, still end in the suffix stream, and
    the hidden states stay equal."""
    base = np.arange(1, 13)
    rows = [base, base, np.append(base, 7), np.append(base, [7, 8]), np.append(base, 9), base[:6]]
    layout = shared_prefix.plan(rows)
    assert layout is not None
    for b, row in enumerate(rows):
        assert row.size - layout.prefix_len_G[layout.group_B[b]] >= 1
    cfg = CONFIGS["llama"]
    params = _params(cfg, seed=4)
    tokens, valid = _padded(rows)
    with torch.no_grad():
        plain = forward_hidden(cfg, params, tokens)
        shared = shared_prefix.forward_hidden_shared(cfg, params, layout)
    torch.testing.assert_close(shared[valid], plain[valid], rtol=0, atol=1e-12)


@pytest.mark.parametrize(
    "rows",
    [
        [np.arange(10), np.arange(10, 20), np.arange(20, 30)],  # nothing shared
        [np.array([1, 2, 3, 4])],  # one row
        [np.array([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]), np.array([1, 9])],  # a short share
    ],
)
def test_plan_declines_where_sharing_would_not_pay(rows: list) -> None:
    assert shared_prefix.plan(rows) is None


def test_float32_agrees_to_rounding() -> None:
    cfg = CONFIGS["qwen3-gqa-bias"]
    params = _params(cfg)
    params32 = LlamaParams.from_state_dict(
        cfg, {k: v.float() for k, v in params.state_dict().items()}
    )
    rows = _grpo_rows(seed=6, prompts=8, group=8, keep=32)
    layout = shared_prefix.plan(rows)
    assert layout is not None
    tokens, valid = _padded(rows)
    with torch.no_grad():
        plain = forward_hidden(cfg, params32, tokens)
        shared = shared_prefix.forward_hidden_shared(cfg, params32, layout)
    torch.testing.assert_close(shared[valid], plain[valid], rtol=1e-5, atol=1e-5)


def test_long_rows_stay_on_the_plain_forward() -> None:
    """The suffix stream's explicit mask grows as rows x suffix x (prefix + suffix):
    beyond ``MAX_MASK_BYTES`` the plan declines, however much the rows share."""
    rng = np.random.default_rng(7)
    prompt = rng.integers(1, 40, size=600)
    rows = [np.concatenate((prompt, rng.integers(1, 40, size=400))) for _ in range(64)]
    assert shared_prefix.MAX_MASK_BYTES < 64 * 401 * 1001 * 4
    assert shared_prefix.plan(rows) is None
    assert shared_prefix.plan(rows[:8]) is not None  # the same rows, fewer of them
