"""LoRA adapters: init, PEFT names, merging, per-row multi-LoRA, gradients.

Runs on a config built in memory with random weights: no files, no transformers.
"""

from __future__ import annotations

import math

import pytest
import torch

from treadle.errors import InvalidArgumentError
from treadle.workers.model import (
    KVCache,
    LlamaParams,
    LoraAdapter,
    LoraRows,
    ModelConfig,
    forward_hidden,
    lm_logits,
)
from treadle.workers.model.llama import param_shapes
from treadle.workers.model.lora import TARGETS, targets_for

torch.set_num_threads(2)
TOL = 1e-5
CFG = ModelConfig(
    arch="qwen2",  # q/k/v biases: LoRA must add on top of them
    vocab_size=48,
    hidden_size=64,
    intermediate_size=96,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    attention_bias=True,
)


@pytest.fixture(scope="module")
def base() -> LlamaParams:
    gen = torch.Generator().manual_seed(0)
    tensors = {}
    for name, shape in param_shapes(CFG).items():
        if name.endswith("norm.weight"):
            tensors[name] = 1.0 + 0.2 * torch.randn(shape, generator=gen)
        else:
            tensors[name] = 0.15 * torch.randn(shape, generator=gen)
    return LlamaParams.from_state_dict(CFG, tensors)


def _trained(seed: int, rank: int = 4, alpha: float = 8.0, **kw) -> LoraAdapter:
    """An adapter with nonzero B, as after some training."""
    adapter = LoraAdapter(CFG, rank, alpha, seed=seed, requires_grad=False, **kw)
    gen = torch.Generator().manual_seed(1000 + seed)
    for layer in adapter.b:
        for b in layer.values():
            b.copy_(0.3 * torch.randn(b.shape, generator=gen))
    return adapter


def _logits(params: LlamaParams, tokens_B_T: torch.Tensor, **kw) -> torch.Tensor:
    """Logits with ``kw["lora"]`` (if any) in the layers and on the output head."""
    with torch.no_grad():
        hidden = forward_hidden(CFG, params, tokens_B_T, **kw)
        return lm_logits(CFG, params, hidden, lora=kw.get("lora"))


def _tokens(B: int, T: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, CFG.vocab_size, (B, T), generator=torch.Generator().manual_seed(seed))


def test_fresh_adapter_equals_base_exactly(base: LlamaParams) -> None:
    tokens_B_T = _tokens(2, 9)
    adapter = LoraAdapter(CFG, rank=8, alpha=16, seed=3)
    assert torch.equal(_logits(base, tokens_B_T, lora=adapter), _logits(base, tokens_B_T))


def test_init_is_deterministic_and_peft_like() -> None:
    a1, a2, other = (
        LoraAdapter(CFG, 4, 8, seed=7),
        LoraAdapter(CFG, 4, 8, seed=7),
        LoraAdapter(CFG, 4, 8, seed=8),
    )
    assert all(torch.equal(x, y) for x, y in zip(a1.parameters(), a2.parameters(), strict=True))
    assert not torch.equal(a1.a[0]["q_proj"], other.a[0]["q_proj"])
    assert a1.scale == 2.0
    down_A = a1.a[1]["down_proj"]
    assert down_A.shape == (4, CFG.intermediate_size)
    assert down_A.abs().max() <= 1 / math.sqrt(CFG.intermediate_size)  # kaiming_uniform(a=sqrt(5))
    assert all(not b.any() for layer in a1.b for b in layer.values())
    assert all(t.requires_grad for t in a1.parameters())


def test_adapter_equals_merged_weights(base: LlamaParams) -> None:
    tokens_B_T = _tokens(3, 11)
    adapter = _trained(seed=1)
    merged = LlamaParams.from_state_dict(CFG, adapter.merge_into(base))
    with_adapter = _logits(base, tokens_B_T, lora=adapter)
    assert (with_adapter - _logits(merged, tokens_B_T)).abs().max().item() <= TOL
    assert (with_adapter - _logits(base, tokens_B_T)).abs().max().item() > 1e-2


def test_merge_only_touches_targets(base: LlamaParams) -> None:
    adapter = _trained(seed=2, targets=("q_proj", "down_proj"))
    merged = adapter.merge_into(base)
    assert merged["model.layers.0.self_attn.k_proj.weight"] is base.layers[0].k_proj
    assert not torch.equal(merged["model.layers.0.self_attn.q_proj.weight"], base.layers[0].q_proj)
    assert adapter.peft_config()["target_modules"] == ["q_proj", "down_proj"]


def test_peft_names_round_trip() -> None:
    adapter = _trained(seed=3)
    named = dict(adapter.named_tensors())
    assert len(named) == 2 * (len(TARGETS) - 1) * CFG.num_layers + 2  # + the head's A and B
    assert named["base_model.model.lm_head.lora_B.weight"].shape == (CFG.vocab_size, 4)
    assert (
        named["base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight"]
        is adapter.a[1]["q_proj"]
    )
    assert named["base_model.model.model.layers.0.mlp.down_proj.lora_B.weight"].shape == (64, 4)
    again = LoraAdapter.from_named_tensors(CFG, named, alpha=adapter.alpha)
    assert again.rank == 4 and again.scale == adapter.scale and again.targets == TARGETS
    assert all(
        torch.equal(x, y) for x, y in zip(again.parameters(), adapter.parameters(), strict=True)
    )
    with_default = {k.replace("lora_A.", "lora_A.default."): v for k, v in named.items()}
    assert LoraAdapter.from_named_tensors(CFG, with_default, alpha=8).rank == 4
    clone = adapter.clone()
    assert all(
        not x.requires_grad and x is not y
        for x, y in zip(clone.parameters(), adapter.parameters(), strict=True)
    )


def test_bad_lora_tensors_are_invalid_argument() -> None:
    named = dict(_trained(seed=4).named_tensors())
    with pytest.raises(InvalidArgumentError, match="unexpected name"):
        LoraAdapter.from_named_tensors(
            CFG, named | {"lm_head.lora_A.weight": torch.zeros(1)}, alpha=8
        )
    missing = dict(named)
    del missing["base_model.model.model.layers.1.mlp.up_proj.lora_B.weight"]
    with pytest.raises(InvalidArgumentError, match="missing"):
        LoraAdapter.from_named_tensors(CFG, missing, alpha=8)
    wrong = named | {
        "base_model.model.model.layers.0.self_attn.k_proj.lora_B.weight": torch.zeros(5, 4)
    }
    with pytest.raises(InvalidArgumentError, match="shape"):
        LoraAdapter.from_named_tensors(CFG, wrong, alpha=8)
    with pytest.raises(InvalidArgumentError, match="rank"):
        LoraAdapter(CFG, 0, 8)
    with pytest.raises(InvalidArgumentError, match="targets"):
        LoraAdapter(CFG, 4, 8, targets=("embed_tokens",))


def test_lora_rows_equal_each_row_alone(base: LlamaParams) -> None:
    tokens_B_T = _tokens(5, 10, seed=5)
    adapters = [
        _trained(seed=10),
        _trained(seed=11, rank=2, alpha=4.0, targets=("v_proj", "up_proj")),
    ]
    row_adapter_B = torch.tensor([1, -1, 0, 1, 0])
    got = _logits(base, tokens_B_T, lora=LoraRows(adapters, row_adapter_B))
    for b, adapter_id in enumerate(row_adapter_B.tolist()):
        lora = adapters[adapter_id] if adapter_id >= 0 else None
        alone = _logits(base, tokens_B_T[b : b + 1], lora=lora)
        assert (got[b] - alone[0]).abs().max().item() <= TOL


def test_lora_rows_with_one_adapter_is_the_fast_path(base: LlamaParams) -> None:
    tokens_B_T = _tokens(3, 6, seed=6)
    adapter = _trained(seed=12)
    rows = LoraRows([adapter], torch.zeros(3, dtype=torch.long))
    assert rows.groups == [(adapter, None)]
    assert torch.equal(
        _logits(base, tokens_B_T, lora=rows), _logits(base, tokens_B_T, lora=adapter)
    )
    none = LoraRows([adapter], torch.full((3,), -1))
    assert torch.equal(_logits(base, tokens_B_T, lora=none), _logits(base, tokens_B_T))
    with pytest.raises(InvalidArgumentError, match="row_adapter_B"):
        LoraRows([adapter], torch.tensor([0, 1]))


def test_lora_rows_through_the_kv_cache(base: LlamaParams) -> None:
    adapters = [_trained(seed=13), _trained(seed=14)]
    row_adapter_B = torch.tensor([0, -1, 1])
    tokens_B_T = _tokens(3, 9, seed=7)
    full = _logits(base, tokens_B_T, lora=LoraRows(adapters, row_adapter_B))
    cache = KVCache(CFG, num_slots=3, max_len=16)
    slots_B = torch.tensor([2, 0, 1])
    _logits(
        base,
        tokens_B_T[:, :5],
        lora=LoraRows(adapters, row_adapter_B),
        cache=cache,
        slots_B=slots_B,
    )
    for t in range(5, 9):
        step = _logits(
            base,
            tokens_B_T[:, t : t + 1],
            positions_B_T=torch.full((3, 1), t),
            lora=LoraRows(adapters, row_adapter_B),
            cache=cache,
            slots_B=slots_B,
        )
        assert (step[:, 0] - full[:, t]).abs().max().item() <= TOL


def test_gradients_reach_only_the_adapters(base: LlamaParams) -> None:
    assert not any(t.requires_grad for t in base.parameters())
    adapters = [LoraAdapter(CFG, 4, 8, seed=20), _trained(seed=21).requires_grad_()]
    tokens_B_T = _tokens(3, 7, seed=8)
    for lora in (adapters[0], LoraRows(adapters, torch.tensor([0, -1, 1]))):
        hidden = forward_hidden(CFG, base, tokens_B_T, lora=lora)
        logits = lm_logits(CFG, base, hidden, lora=lora)
        logits.logsumexp(-1).sum().backward()
    for adapter in adapters:
        assert all(t.grad is not None for t in adapter.parameters())
        # B starts at zero, so B's gradient is the informative one.
        assert all(layer[t].grad.abs().sum() > 0 for layer in adapter.b for t in layer)
    assert all(t.grad is None for t in base.parameters())


def test_targets_follow_tinkers_flags(base: LlamaParams) -> None:
    assert targets_for(train_attn=True, train_mlp=True, train_unembed=True) == TARGETS
    assert targets_for(train_attn=False, train_mlp=True, train_unembed=False) == (
        "gate_proj",
        "up_proj",
        "down_proj",
    )
    with pytest.raises(InvalidArgumentError, match="train_attn, train_mlp, train_unembed"):
        targets_for(train_attn=False, train_mlp=False, train_unembed=False)
    head_only = _trained(seed=30, targets=("lm_head",))
    assert [n for n, _ in head_only.named_tensors()] == [
        "base_model.model.lm_head.lora_A.weight",
        "base_model.model.lm_head.lora_B.weight",
    ]
    assert head_only.peft_config()["target_modules"] == ["lm_head"]
    tokens_B_T = _tokens(2, 5, seed=9)
    hidden = forward_hidden(CFG, base, tokens_B_T)
    with torch.no_grad():
        expect = lm_logits(CFG, base, hidden) + head_only.scale * (
            hidden @ head_only.a[-1]["lm_head"].T @ head_only.b[-1]["lm_head"].T
        )
        got = lm_logits(CFG, base, hidden, lora=head_only)
        assert (got - expect).abs().max().item() <= TOL
        # [B, H] rows (the sampler's last position) take the head adapter too
        rows = lm_logits(
            CFG, base, hidden[:, -1], lora=LoraRows([head_only], torch.tensor([0, -1]))
        )
    assert (rows[0] - got[0, -1]).abs().max().item() <= TOL
    assert (rows[1] - lm_logits(CFG, base, hidden[1, -1])).abs().max().item() <= TOL
    merged = head_only.merge_into(base)
    assert not torch.equal(merged["lm_head.weight"], base.lm_head_weight)


def test_head_adapter_of_a_tied_model_merges_untied(tmp_path) -> None:
    """The head's update goes into its own ``lm_head.weight``: the embedding (which
    the input side reads) must stay as it was, so the merged model is untied."""
    from dataclasses import replace

    from treadle.workers.model.loading import load_checkpoint, save_params

    cfg = replace(CFG, tie_word_embeddings=True)
    gen = torch.Generator().manual_seed(5)
    shapes = param_shapes(cfg)
    assert "lm_head.weight" not in shapes
    tied = LlamaParams.from_state_dict(
        cfg, {n: 0.15 * torch.randn(s, generator=gen) for n, s in shapes.items()}
    )
    adapter = LoraAdapter(cfg, 4, 8.0, seed=6, requires_grad=False)
    for layer in adapter.b:
        for b in layer.values():
            b.copy_(0.3 * torch.randn(b.shape, generator=gen))
    merged = adapter.merge_into(tied)
    assert merged["model.embed_tokens.weight"] is tied.embed_tokens
    untied = replace(cfg, tie_word_embeddings=False)  # as export_merged writes it
    save_params(LlamaParams.from_state_dict(untied, merged), untied, tmp_path)
    cfg_back, params_back = load_checkpoint(tmp_path)
    assert not cfg_back.tie_word_embeddings
    tokens_B_T = _tokens(2, 7, seed=10)
    with torch.no_grad():
        want = lm_logits(
            cfg, tied, forward_hidden(cfg, tied, tokens_B_T, lora=adapter), lora=adapter
        )
        got = lm_logits(cfg_back, params_back, forward_hidden(cfg_back, params_back, tokens_B_T))
    assert (got - want).abs().max().item() <= TOL
