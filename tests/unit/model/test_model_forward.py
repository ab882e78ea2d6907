"""The engine's forward pass against transformers, and the KV cache against the full forward.

Checkpoints are built by ``build_tiny_model`` and then re-randomised with
large, non-trivial weights (norm weights away from 1, biases nonzero): with
HF's default init (std 0.02, norms = 1) a RoPE or norm bug could hide below
the 1e-5 tolerance.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from treadle.errors import InvalidArgumentError
from treadle.workers.model import (
    KVCache,
    LlamaParams,
    ModelConfig,
    forward_hidden,
    lm_logits,
    load_checkpoint,
    save_params,
    target_logprobs,
)
from treadle.workers.model.llama import rms_norm
from treadle.workers.model.tiny import build_tiny_model

torch.set_num_threads(2)
TOL = 1e-5

LLAMA3_VARIANT = {
    "tie_word_embeddings": True,
    "attention_bias": True,  # q/k/v and o_proj biases
    "rope_parameters": {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 4.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,  # small, so all three bands occur
    },
}
CASES = {
    "llama": ("llama", None),
    "qwen2": ("qwen2", None),
    "qwen3": ("qwen3", None),
    "mistral": ("mistral", None),
    "llama3-tied-bias": ("llama", LLAMA3_VARIANT),
    "qwen3-bias": ("qwen3", {"attention_bias": True}),
}


def _randomized_checkpoint(out: Path, arch: str, overrides: dict | None, seed: int) -> Path:
    build_tiny_model(out, arch=arch, seed=seed, overrides=overrides)
    hf = AutoModelForCausalLM.from_pretrained(out)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.15 * torch.randn(p.shape, generator=gen))
    hf.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpt")
    return {
        name: _randomized_checkpoint(root / name, arch, overrides, seed=i)
        for i, (name, (arch, overrides)) in enumerate(CASES.items())
    }


@pytest.fixture(scope="module")
def llama(checkpoints: dict[str, Path]) -> tuple[ModelConfig, LlamaParams]:
    return load_checkpoint(checkpoints["llama"])


def _logits(
    cfg: ModelConfig,
    params: LlamaParams,
    tokens_B_T: torch.Tensor,
    positions_B_T: torch.Tensor | None = None,
    **kw,
) -> torch.Tensor:
    with torch.no_grad():
        return lm_logits(cfg, params, forward_hidden(cfg, params, tokens_B_T, positions_B_T, **kw))


# ---------------------------------------------------------------------- against transformers


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_forward_matches_transformers(checkpoints: dict[str, Path], case: str, attn: str) -> None:
    cfg, params = load_checkpoint(checkpoints[case])
    hf = AutoModelForCausalLM.from_pretrained(checkpoints[case], attn_implementation=attn).eval()
    torch.manual_seed(0)
    tokens_B_T = torch.randint(0, cfg.vocab_size, (3, 40))
    with torch.no_grad():
        ref = hf(tokens_B_T).logits
    got = _logits(cfg, params, tokens_B_T)
    assert got.dtype == torch.float32
    assert ref.std() > 0.5  # the comparison is not trivially small
    assert (got - ref).abs().max().item() <= TOL


def test_config_flags_follow_the_arch(checkpoints: dict[str, Path]) -> None:
    flags = {name: load_checkpoint(path)[0] for name, path in checkpoints.items()}
    assert flags["qwen2"].attention_bias and not flags["qwen2"].o_proj_bias
    assert flags["qwen3"].qk_norm and not flags["qwen3"].attention_bias
    assert flags["qwen3-bias"].attention_bias and flags["qwen3-bias"].o_proj_bias
    v = flags["llama3-tied-bias"]
    assert v.tie_word_embeddings and v.o_proj_bias and v.rope_scaling is not None
    assert v.rope_scaling.original_max_position_embeddings == 32


def test_num_params_matches_transformers(checkpoints: dict[str, Path]) -> None:
    for path in checkpoints.values():
        cfg, params = load_checkpoint(path)
        hf = AutoModelForCausalLM.from_pretrained(path)
        assert cfg.num_params() == hf.num_parameters()
        assert cfg.num_params() == sum(t.numel() for t in params.parameters())


def test_right_padding_does_not_change_earlier_positions(llama) -> None:
    cfg, params = llama
    torch.manual_seed(1)
    tokens_B_T = torch.randint(3, cfg.vocab_size, (2, 12))
    full = _logits(cfg, params, tokens_B_T)
    short = _logits(cfg, params, tokens_B_T[1:, :7])
    assert (full[1, :7] - short[0]).abs().max().item() <= TOL


def test_dtypes_of_logits(llama) -> None:
    cfg, params = llama
    tokens_B_T = torch.tensor([[1, 5, 9]])
    assert _logits(cfg, params.to(torch.float64), tokens_B_T).dtype == torch.float64
    assert _logits(cfg, params.to(torch.bfloat16), tokens_B_T).dtype == torch.float32


# ---------------------------------------------------------------------- logprobs


def test_target_logprobs_is_log_softmax_at_temperature() -> None:
    torch.manual_seed(2)
    logits_B_T_V = 3 * torch.randn(2, 5, 11)
    targets_B_T = torch.randint(0, 11, (2, 5))
    for temp in (1.0, 0.7, 1.3):
        ref = torch.log_softmax(logits_B_T_V / temp, -1).gather(-1, targets_B_T[..., None])[..., 0]
        got = target_logprobs(logits_B_T_V, targets_B_T, temperature=temp)
        assert (got - ref).abs().max().item() <= 1e-6
    assert target_logprobs(logits_B_T_V.bfloat16(), targets_B_T).dtype == torch.float32
    with pytest.raises(InvalidArgumentError, match="temperature"):
        target_logprobs(logits_B_T_V, targets_B_T, temperature=0.0)


# ---------------------------------------------------------------------- KV cache


def test_prefill_then_decode_equals_full_forward(llama) -> None:
    cfg, params = llama
    torch.manual_seed(3)
    prompt, steps = 6, 5
    tokens_B_T = torch.randint(3, cfg.vocab_size, (2, prompt + steps))
    full = _logits(cfg, params, tokens_B_T)
    cache = KVCache(cfg, num_slots=4, max_len=32)
    slots_B = torch.tensor([3, 1])
    got = _logits(cfg, params, tokens_B_T[:, :prompt], cache=cache, slots_B=slots_B)
    assert (got - full[:, :prompt]).abs().max().item() <= TOL
    for t in range(prompt, prompt + steps):
        positions_B_1 = torch.full((2, 1), t)
        step = _logits(
            cfg, params, tokens_B_T[:, t : t + 1], positions_B_1, cache=cache, slots_B=slots_B
        )
        assert (step[:, 0] - full[:, t]).abs().max().item() <= TOL


def test_decode_batch_with_rows_at_different_lengths(llama) -> None:
    cfg, params = llama
    torch.manual_seed(4)
    lengths = [3, 9, 5]
    seqs = [torch.randint(3, cfg.vocab_size, (n + 4,)) for n in lengths]
    cache = KVCache(cfg, num_slots=5, max_len=24)
    slots_B = torch.tensor([4, 0, 2])
    # One right-padded prefill for all rows: pad positions write junk that is never read.
    T = max(lengths)
    prompts_B_T = torch.zeros(3, T, dtype=torch.long)
    for b, n in enumerate(lengths):
        prompts_B_T[b, :n] = seqs[b][:n]
    _logits(cfg, params, prompts_B_T, cache=cache, slots_B=slots_B)
    for k in range(4):
        positions_B_1 = torch.tensor([[n + k] for n in lengths])
        tokens_B_1 = torch.stack([seqs[b][n + k] for b, n in enumerate(lengths)])[:, None]
        step = _logits(cfg, params, tokens_B_1, positions_B_1, cache=cache, slots_B=slots_B)
        for b, n in enumerate(lengths):
            full = _logits(cfg, params, seqs[b][None, : n + k + 1])
            assert (step[b, 0] - full[0, -1]).abs().max().item() <= TOL


def test_copy_prefix_shares_one_prefill_across_a_group(llama) -> None:
    cfg, params = llama
    torch.manual_seed(5)
    prompt = torch.randint(3, cfg.vocab_size, (7,))
    G, steps = 4, 3
    continuations_G_S = torch.randint(3, cfg.vocab_size, (G, steps))
    cache = KVCache(cfg, num_slots=6, max_len=16)
    _logits(cfg, params, prompt[None], cache=cache, slots_B=torch.tensor([2]))
    group_slots = [2, 5, 0, 3]
    cache.copy_prefix(2, [s for s in group_slots if s != 2], length=len(prompt))
    slots_G = torch.tensor(group_slots)
    for k in range(steps):
        positions_G_1 = torch.full((G, 1), len(prompt) + k)
        step = _logits(
            cfg,
            params,
            continuations_G_S[:, k : k + 1],
            positions_G_1,
            cache=cache,
            slots_B=slots_G,
        )
        seqs_G_T = torch.cat([prompt.expand(G, -1), continuations_G_S[:, : k + 1]], dim=1)
        full = _logits(cfg, params, seqs_G_T)
        assert (step[:, 0] - full[:, -1]).abs().max().item() <= TOL


def test_cache_rejects_positions_beyond_max_len(llama) -> None:
    cfg, params = llama
    cache = KVCache(cfg, num_slots=1, max_len=4)
    with pytest.raises(InvalidArgumentError, match="max_len"):
        forward_hidden(
            cfg, params, torch.ones(1, 5, dtype=torch.long), cache=cache, slots_B=torch.tensor([0])
        )
    with pytest.raises(InvalidArgumentError, match="slots_B"):
        forward_hidden(cfg, params, torch.ones(1, 2, dtype=torch.long), cache=cache)


# ---------------------------------------------------------------------- params and checkpoints


def test_params_round_trip_hf_names(checkpoints: dict[str, Path]) -> None:
    for path in checkpoints.values():
        cfg, params = load_checkpoint(path)
        on_disk = load_file(str(path / "model.safetensors"))
        if cfg.tie_word_embeddings:
            on_disk.pop("lm_head.weight", None)
        assert set(params.state_dict()) == set(on_disk)
        again = LlamaParams.from_state_dict(cfg, params.state_dict())
        assert all(a is b for a, b in zip(again.parameters(), params.parameters(), strict=True))


def test_clone_is_independent_and_trainable(llama) -> None:
    cfg, params = llama
    trainable = params.clone().requires_grad_()
    assert all(t.requires_grad for t in trainable.parameters())
    assert not any(t.requires_grad for t in params.parameters())
    with torch.no_grad():
        trainable.norm.add_(1.0)
    assert not torch.equal(trainable.norm, params.norm)
    logits = lm_logits(cfg, trainable, forward_hidden(cfg, trainable, torch.tensor([[1, 4, 7]])))
    logits.sum().backward()
    assert trainable.layers[0].q_proj.grad is not None and params.layers[0].q_proj.grad is None


def test_save_params_is_read_by_us_and_transformers(checkpoints, tmp_path: Path) -> None:
    cfg, params = load_checkpoint(checkpoints["llama3-tied-bias"])
    out = save_params(params, cfg, tmp_path / "saved")
    cfg2, params2 = load_checkpoint(out)
    assert cfg2 == cfg
    tokens_B_T = torch.tensor([[1, 20, 30, 40, 50]])
    ours = _logits(cfg2, params2, tokens_B_T)
    with torch.no_grad():
        theirs = AutoModelForCausalLM.from_pretrained(out)(tokens_B_T).logits
    assert (ours - theirs).abs().max().item() <= TOL


def test_sharded_checkpoint_loads(llama, tmp_path: Path) -> None:
    cfg, params = llama
    tensors = {n: t.contiguous() for n, t in params.named_tensors()}
    names = list(tensors)
    shards = {
        "model-00001-of-00002.safetensors": names[:7],
        "model-00002-of-00002.safetensors": names[7:],
    }
    for fname, part in shards.items():
        save_file({n: tensors[n] for n in part}, str(tmp_path / fname))
    weight_map = {n: fname for fname, part in shards.items() for n in part}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_hf_dict()))
    _, loaded = load_checkpoint(tmp_path, dtype=torch.float64)
    assert loaded.dtype == torch.float64
    assert all(
        torch.equal(a, b.double())
        for a, b in zip(loaded.parameters(), params.parameters(), strict=True)
    )


def test_missing_files_are_invalid_argument(llama, tmp_path: Path) -> None:
    cfg, params = llama
    with pytest.raises(InvalidArgumentError, match="config.json"):
        load_checkpoint(tmp_path / "nowhere")
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_hf_dict()))
    with pytest.raises(InvalidArgumentError, match="model.safetensors"):
        load_checkpoint(tmp_path)
    state = {n: t.contiguous() for n, t in params.named_tensors()}
    del state["model.norm.weight"]
    save_file(
        state | {"model.layers.0.mlp.extra.weight": torch.zeros(2)},
        str(tmp_path / "model.safetensors"),
    )
    with pytest.raises(InvalidArgumentError, match="not part of"):
        load_checkpoint(tmp_path)
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(InvalidArgumentError, match="lacks"):
        load_checkpoint(tmp_path)
    with pytest.raises(InvalidArgumentError, match="shape"):
        LlamaParams.from_state_dict(cfg, params.state_dict() | {"model.norm.weight": torch.ones(3)})


# ---------------------------------------------------------------------- config parsing


def _hf_dict(**changes) -> dict:
    base = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 32,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "eos_token_id": [2, 7],
        "rope_theta": 1e6,
        "rope_scaling": {
            "type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    }
    return {k: v for k, v in (base | changes).items() if v is not None}


def test_config_reads_the_legacy_layout() -> None:
    cfg = ModelConfig.from_hf_dict(_hf_dict())
    assert cfg.head_dim == 16 and cfg.rope_theta == 1e6 and cfg.eos_token_ids == (2, 7)
    assert cfg.rope_scaling is not None and cfg.rope_scaling.factor == 8.0
    assert ModelConfig.from_hf_dict(cfg.to_hf_dict()) == cfg
    mistral = ModelConfig.from_hf_dict(
        _hf_dict(architectures=["MistralForCausalLM"], sliding_window=4096)
    )
    assert mistral.arch == "mistral" and not mistral.attention_bias


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"architectures": ["GPT2LMHeadModel"]}, "GPT2LMHeadModel"),
        ({"architectures": None, "model_type": "gpt_neox"}, "gpt_neox"),
        ({"hidden_size": None}, "hidden_size"),
        ({"num_key_value_heads": 3}, "num_kv_heads"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "yarn"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 4.0}}, "low_freq_factor"),
        ({"vocab_size": 0}, "vocab_size"),
    ],
)
def test_config_errors_are_invalid_argument(changes: dict, match: str) -> None:
    with pytest.raises(InvalidArgumentError, match=match):
        ModelConfig.from_hf_dict(_hf_dict(**changes))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_rms_norm_fast_path_is_the_hf_formula_bit_for_bit(dtype: torch.dtype) -> None:
    """``rms_norm`` takes ``F.rms_norm`` for float32/float64: the same values and
    gradients, bit for bit, as HF's formula written out."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 7, 64, generator=gen, dtype=dtype).requires_grad_()
    w = (1 + 0.1 * torch.randn(64, generator=gen, dtype=dtype)).requires_grad_()
    g = torch.randn(5, 7, 64, generator=gen, dtype=dtype)
    fast = rms_norm(x, w, 1e-5)
    written_out = w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))
    assert torch.equal(fast, written_out)
    for ours, theirs in zip(
        torch.autograd.grad(fast, (x, w), g),
        torch.autograd.grad(written_out, (x, w), g),
        strict=True,
    ):
        assert torch.equal(ours, theirs)
