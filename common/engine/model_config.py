"""The model's shape and numerics, parsed once from a HF ``config.json``.

One frozen, hashable object describes every Llama-family checkpoint the engine
runs (Llama 2/3, Qwen2, Qwen3, Mistral). The forward pass branches on its flags
(``attention_bias``, ``qk_norm``, ``tie_word_embeddings``), never on the
architecture name, so a new family member usually means a new parser branch
here and nothing else.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from treadle.errors import InvalidArgumentError

#: HF ``architectures`` entry -> our arch name.
HF_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MistralForCausalLM": "mistral",
}
ARCHS: frozenset[str] = frozenset(HF_ARCHITECTURES.values())
_ARCH_TO_HF = {arch: hf for hf, arch in HF_ARCHITECTURES.items()}


@dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama 3.1-style frequency scaling of RoPE ("rope_type": "llama3").

    Low frequencies (long wavelengths) are divided by ``factor``, high ones kept,
    the band in between interpolated; see ``llama.rope_inv_freq``.
    """

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def to_hf_dict(self) -> dict[str, Any]:
        return {
            "rope_type": "llama3",
            "factor": self.factor,
            "low_freq_factor": self.low_freq_factor,
            "high_freq_factor": self.high_freq_factor,
            "original_max_position_embeddings": self.original_max_position_embeddings,
        }


@dataclass(frozen=True)
class ModelConfig:
    """Everything the forward pass needs to know about a checkpoint.

    ``attention_bias`` means q/k/v projections carry a bias (Qwen2 always; Llama
    and Qwen3 when their config says so); ``o_proj_bias`` is the separate flag
    for the output projection (Llama/Qwen3 with ``attention_bias``, never Qwen2).
    ``qk_norm`` is Qwen3's per-head RMSNorm on q and k before RoPE.
    """

    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: Llama3RopeScaling | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    o_proj_bias: bool = False
    qk_norm: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None

    def __post_init__(self) -> None:
        if self.arch not in ARCHS:
            raise InvalidArgumentError(
                f"arch: {self.arch!r} is not supported (supported: {sorted(ARCHS)})"
            )
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise InvalidArgumentError(f"{name}: must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise InvalidArgumentError(
                f"num_kv_heads: {self.num_kv_heads} does not divide num_heads {self.num_heads}"
            )
        if self.head_dim % 2:
            raise InvalidArgumentError(
                f"head_dim: RoPE needs an even head_dim, got {self.head_dim}"
            )

    # ------------------------------------------------------------------ sizes

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def num_params(self) -> int:
        """Number of scalars in the checkpoint (tied embeddings counted once)."""
        h, i = self.hidden_size, self.intermediate_size
        attn = h * self.q_size + 2 * h * self.kv_size + self.q_size * h
        if self.attention_bias:
            attn += self.q_size + 2 * self.kv_size
        if self.o_proj_bias:
            attn += h
        if self.qk_norm:
            attn += 2 * self.head_dim
        per_layer = attn + 3 * h * i + 2 * h
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return embed + self.num_layers * per_layer + h

    # ------------------------------------------------------------------ HF <-> us

    @classmethod
    def from_hf_dict(cls, d: Mapping[str, Any]) -> ModelConfig:
        """Parse a HF ``config.json`` of a Llama/Qwen2/Qwen3/Mistral causal LM.

        Reads both the transformers 5 layout (``rope_parameters``) and the older
        one (top-level ``rope_theta`` + ``rope_scaling``). Mistral's (and Qwen's)
        sliding window is ignored: attention is always full, which is exact for
        sequences no longer than the window (4096+ tokens for released models).
        """
        arch = _arch_of(d)
        try:
            hidden = int(d["hidden_size"])
            num_heads = int(d["num_attention_heads"])
            cfg_fields: dict[str, Any] = {
                "vocab_size": int(d["vocab_size"]),
                "hidden_size": hidden,
                "intermediate_size": int(d["intermediate_size"]),
                "num_layers": int(d["num_hidden_layers"]),
                "num_heads": num_heads,
            }
        except KeyError as e:
            raise InvalidArgumentError(f"config.json: missing field {e.args[0]!r}") from None
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise InvalidArgumentError(f"config.json: hidden_act {act!r} is not supported (silu)")
        if d.get("mlp_bias"):
            raise InvalidArgumentError("config.json: mlp_bias=true is not supported")
        head_dim = d.get("head_dim") or hidden // num_heads
        rope_theta, rope_scaling = _parse_rope(d)
        bias = bool(d.get("attention_bias", False))
        return cls(
            arch=arch,
            **cfg_fields,
            num_kv_heads=int(d.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=True if arch == "qwen2" else (bias and arch != "mistral"),
            o_proj_bias=bias and arch in ("llama", "qwen3"),
            qk_norm=arch == "qwen3",
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=_as_id_tuple(d.get("eos_token_id")),
            pad_token_id=d.get("pad_token_id"),
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """A ``config.json`` transformers loads as the same model."""
        rope: dict[str, Any] = {"rope_type": "default"}
        if self.rope_scaling is not None:
            rope = self.rope_scaling.to_hf_dict()
        rope["rope_theta"] = self.rope_theta
        eos: int | list[int] | None = list(self.eos_token_ids) or None
        if len(self.eos_token_ids) == 1:
            eos = self.eos_token_ids[0]
        d: dict[str, Any] = {
            "architectures": [_ARCH_TO_HF[self.arch]],
            "model_type": self.arch,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": rope,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos,
            "pad_token_id": self.pad_token_id,
        }
        if self.arch in ("llama", "qwen3"):
            d["attention_bias"] = self.attention_bias
        return d


def _arch_of(d: Mapping[str, Any]) -> str:
    archs = d.get("architectures") or []
    for name in archs:
        if name in HF_ARCHITECTURES:
            return HF_ARCHITECTURES[name]
    model_type = d.get("model_type")
    if not archs and model_type in ARCHS:
        return str(model_type)
    got = archs or model_type
    raise InvalidArgumentError(
        f"config.json: architecture {got!r} is not supported "
        f"(supported: {sorted(HF_ARCHITECTURES)})"
    )


def _parse_rope(d: Mapping[str, Any]) -> tuple[float, Llama3RopeScaling | None]:
    """(rope_theta, scaling) from either HF layout; rejects scalings we don't run."""
    params = dict(d.get("rope_parameters") or {})
    legacy = d.get("rope_scaling")
    if legacy:
        params = {**dict(legacy), **params}
    theta = float(params.get("rope_theta", d.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type != "llama3":
        raise InvalidArgumentError(
            f"config.json: rope type {rope_type!r} is not supported (default, llama3)"
        )
    try:
        scaling = Llama3RopeScaling(
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position_embeddings=int(params["original_max_position_embeddings"]),
        )
    except KeyError as e:
        raise InvalidArgumentError(f"config.json: llama3 rope is missing {e.args[0]!r}") from None
    if not math.isfinite(scaling.factor) or scaling.factor <= 0:
        raise InvalidArgumentError(f"config.json: rope factor must be > 0, got {scaling.factor}")
    return theta, scaling


def _as_id_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)
