"""The random-weight model builder: determinism, tokenizer, presets."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer
from transformers import AutoTokenizer

from treadle.errors import InvalidArgumentError
from treadle.workers.model import ModelConfig, forward_hidden, lm_logits, load_checkpoint
from treadle.workers.model.tiny import (
    PRESETS,
    build_char_tokenizer,
    build_tiny_model,
    char_vocab_size,
    hf_config_kwargs,
)

torch.set_num_threads(2)
FILES = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
)
TEXTS = ("12+34=46", "Q: what is 7*6?\nA: 42", " leading and  double  spaces ~!@#$%^&*()_{}|")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "m")


def test_same_seed_same_bytes(tiny_dir: Path, tmp_path: Path) -> None:
    rng_before = torch.random.get_rng_state()
    again = build_tiny_model(tmp_path / "again")
    assert torch.equal(torch.random.get_rng_state(), rng_before)  # caller's RNG untouched
    for name in FILES:
        assert (again / name).read_bytes() == (tiny_dir / name).read_bytes(), name
    other = build_tiny_model(tmp_path / "other", seed=1)
    assert (other / "model.safetensors").read_bytes() != (
        tiny_dir / "model.safetensors"
    ).read_bytes()


def test_builder_prints_nothing(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    build_tiny_model(tmp_path / "quiet")
    out, err = capfd.readouterr()
    assert out == "" and err == ""


def test_tokenizer_round_trips_with_both_libraries(tiny_dir: Path) -> None:
    fast = Tokenizer.from_file(str(tiny_dir / "tokenizer.json"))
    auto = AutoTokenizer.from_pretrained(tiny_dir)
    for text in TEXTS:
        ids = fast.encode(text).ids
        assert len(ids) == len(text)  # one id per character, no BOS added
        assert fast.decode(ids) == text
        assert auto(text)["input_ids"] == ids
        assert auto.decode(ids) == text
    assert (auto.pad_token_id, auto.bos_token_id, auto.eos_token_id) == (0, 1, 2)
    assert fast.token_to_id("<s>") == 1 and fast.token_to_id("</s>") == 2
    assert fast.decode([1, *fast.encode("ab").ids, 2], skip_special_tokens=True) == "ab"
    assert build_char_tokenizer().get_vocab_size() == char_vocab_size() == 99


def test_checkpoint_config(tiny_dir: Path) -> None:
    cfg, params = load_checkpoint(tiny_dir)
    assert cfg.vocab_size == 104 and cfg.vocab_size % 8 == 0
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads) == (64, 2, 4, 2)
    assert (cfg.bos_token_id, cfg.eos_token_ids, cfg.pad_token_id) == (1, (2,), 0)
    assert cfg.max_position_embeddings == 2048 and not cfg.tie_word_embeddings
    logits = lm_logits(cfg, params, forward_hidden(cfg, params, torch.tensor([[1, 20, 21]])))
    assert logits.shape == (1, 3, 104) and torch.isfinite(logits).all()


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_other_archs(arch: str, tmp_path: Path) -> None:
    cfg, _ = load_checkpoint(build_tiny_model(tmp_path / arch, arch=arch))
    assert cfg.arch == arch and cfg.head_dim == 16
    assert cfg.attention_bias == (arch == "qwen2") and cfg.qk_norm == (arch == "qwen3")
    assert json.loads((tmp_path / arch / "config.json").read_text())["model_type"] == arch


def test_demo_preset_builds(tmp_path: Path) -> None:
    cfg, params = load_checkpoint(build_tiny_model(tmp_path / "demo", preset="demo"))
    assert 0.5e6 < cfg.num_params() < 2e6
    assert sum(t.numel() for t in params.parameters()) == cfg.num_params()


def test_preset_sizes() -> None:
    def cfg_of(preset: str) -> ModelConfig:
        return ModelConfig.from_hf_dict(
            hf_config_kwargs(preset) | {"architectures": ["LlamaForCausalLM"]}
        )

    assert set(PRESETS) == {"tiny", "demo", "5m", "110m"}
    assert 4e6 < cfg_of("5m").num_params() < 6e6
    big = cfg_of("110m")
    assert big.vocab_size == 32000 and big.tie_word_embeddings and big.num_kv_heads == 12
    assert (big.hidden_size, big.num_layers, big.intermediate_size) == (768, 12, 2048)
    assert 105e6 < big.num_params() < 115e6


def test_bad_preset_or_arch(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match="preset"):
        build_tiny_model(tmp_path, preset="huge")
    with pytest.raises(InvalidArgumentError, match="arch"):
        build_tiny_model(tmp_path, arch="gpt2")
