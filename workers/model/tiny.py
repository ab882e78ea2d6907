"""Small random-weight models with a character tokenizer, built on the spot.

Tests, demos and benchmarks need a real checkpoint directory without any
download. ``build_tiny_model`` writes one in exactly the format of a released
model: transformers' own ``save_pretrained`` (safetensors + ``config.json``)
and a ``tokenizer.json`` that both ``tokenizers`` and ``AutoTokenizer`` load.

The tokenizer maps each printable ASCII character and ``"\\n"`` to one id
(after ``<pad>``=0, ``<s>``=1, ``</s>``=2), which keeps toy tasks such as
``"12+34=46"`` easy to read in token space. Characters outside that set are
dropped by the tokenizer.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models

from treadle.errors import InvalidArgumentError

PAD, BOS, EOS = "<pad>", "<s>", "</s>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD, BOS, EOS)  # ids 0, 1, 2
CHARS: str = "".join(chr(c) for c in range(32, 127)) + "\n"


@dataclass(frozen=True)
class Preset:
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int | None = None  # None: the char tokenizer's size, rounded up to 8
    tie_word_embeddings: bool = False


PRESETS: dict[str, Preset] = {
    "tiny": Preset(64, 2, 4, 2, 128),  # unit tests
    "demo": Preset(128, 4, 4, 2, 352),  # ~0.8M params: fast demos on 2 CPU cores
    "5m": Preset(256, 6, 8, 4, 688),  # ~4.6M params
    # 109.5M params (24.6M tied embeddings + 12 x 7.1M layers): the benchmarks' model
    "110m": Preset(768, 12, 12, 12, 2048, vocab_size=32000, tie_word_embeddings=True),
}
_HF_CLASSES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
}


def build_char_tokenizer() -> Tokenizer:
    """A character-level tokenizer: specials 0..2, then ``CHARS`` in order.

    A BPE model with no merges splits text into single characters; the Fuse
    decoder joins them back without separators, so decode(encode(s)) == s.
    """
    vocab = {tok: i for i, tok in enumerate((*SPECIAL_TOKENS, *CHARS))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    tok.decoder = decoders.Fuse()
    return tok


def char_vocab_size() -> int:
    return len(SPECIAL_TOKENS) + len(CHARS)


def save_tokenizer(out_dir: Path) -> None:
    """``tokenizer.json`` plus the two JSON files transformers reads beside it."""
    build_char_tokenizer().save(str(out_dir / "tokenizer.json"))
    specials = {"pad_token": PAD, "bos_token": BOS, "eos_token": EOS}
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **specials,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 2048,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    (out_dir / "special_tokens_map.json").write_text(json.dumps(specials, indent=2) + "\n")


def hf_config_kwargs(preset: str = "tiny", arch: str = "llama") -> dict[str, Any]:
    """The transformers config arguments of a preset (before any overrides)."""
    if preset not in PRESETS:
        raise InvalidArgumentError(f"preset: {preset!r} is not one of {sorted(PRESETS)}")
    if arch not in _HF_CLASSES:
        raise InvalidArgumentError(f"arch: {arch!r} is not one of {sorted(_HF_CLASSES)}")
    p = PRESETS[preset]
    vocab = p.vocab_size or -(-char_vocab_size() // 8) * 8
    kwargs: dict[str, Any] = {
        "vocab_size": vocab,
        "hidden_size": p.hidden_size,
        "num_hidden_layers": p.num_layers,
        "num_attention_heads": p.num_heads,
        "num_key_value_heads": p.num_kv_heads,
        "head_dim": p.hidden_size // p.num_heads,
        "intermediate_size": p.intermediate_size,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": p.tie_word_embeddings,
        "rms_norm_eps": 1e-6,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
    }
    if arch == "mistral":
        kwargs["sliding_window"] = None
    return kwargs


def build_tiny_model(
    out_dir: str | Path,
    preset: str = "tiny",
    seed: int = 0,
    arch: str = "llama",
    *,
    overrides: dict[str, Any] | None = None,
) -> Path:
    """Write a random-weight ``arch`` model of ``preset`` size plus tokenizer to ``out_dir``.

    Same arguments, same bytes: weights come from transformers' initialisation
    under ``torch.manual_seed(seed)`` (inside a forked RNG, so the caller's RNG
    state is untouched). ``overrides`` replaces transformers config arguments
    (tests use it for tied embeddings, RoPE scaling, q/k/v bias...).
    """
    import transformers  # heavy: only when building
    from transformers.utils import logging as hf_logging

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    kwargs = hf_config_kwargs(preset, arch) | dict(overrides or {})
    config_cls, model_cls = (getattr(transformers, n) for n in _HF_CLASSES[arch])
    config = config_cls(**kwargs)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config)
    bar_was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # print nothing: the CLI reports
    try:
        model.save_pretrained(out)
    finally:
        if bar_was_on:
            hf_logging.enable_progress_bar()
    save_tokenizer(out)
    return out
