"""The weights of a Llama-family model as plain tensors (``LlamaParams``): built from
an HF state dict, named as HF names them, cloned, moved or mapped whole. A full
fine-tune owns a trainable copy; every LoRA model of a worker shares one frozen
base copy (``workers.model.llama`` runs the forward over them).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, fields, replace
from typing import TypeVar

import torch
from torch import Tensor

from treadle.common.engine.model_config import ModelConfig
from treadle.errors import InvalidArgumentError

# LayerParams field -> HF name suffix after "model.layers.{i}.".
_LAYER_HF_NAMES: dict[str, str] = {
    "q_proj": "self_attn.q_proj.weight",
    "k_proj": "self_attn.k_proj.weight",
    "v_proj": "self_attn.v_proj.weight",
    "o_proj": "self_attn.o_proj.weight",
    "q_bias": "self_attn.q_proj.bias",
    "k_bias": "self_attn.k_proj.bias",
    "v_bias": "self_attn.v_proj.bias",
    "o_bias": "self_attn.o_proj.bias",
    "q_norm": "self_attn.q_norm.weight",
    "k_norm": "self_attn.k_norm.weight",
    "gate_proj": "mlp.gate_proj.weight",
    "up_proj": "mlp.up_proj.weight",
    "down_proj": "mlp.down_proj.weight",
    "input_layernorm": "input_layernorm.weight",
    "post_attention_layernorm": "post_attention_layernorm.weight",
}


def layer_tensor_name(n: int, field: str) -> str:
    """The HF name of layer ``n``'s tensor ``field`` (a ``LayerParams`` field)."""
    return f"model.layers.{n}.{_LAYER_HF_NAMES[field]}"


def projection_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(out_features, in_features) of each projection of a decoder layer."""
    h, i, q, kv = cfg.hidden_size, cfg.intermediate_size, cfg.q_size, cfg.kv_size
    return {
        "q_proj": (q, h),
        "k_proj": (kv, h),
        "v_proj": (kv, h),
        "o_proj": (h, q),
        "gate_proj": (i, h),
        "up_proj": (i, h),
        "down_proj": (h, i),
    }


def param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint of ``cfg`` holds, by HF name, with its shape."""
    h, q, kv = cfg.hidden_size, cfg.q_size, cfg.kv_size
    layer: dict[str, tuple[int, ...]] = {
        **projection_shapes(cfg),
        "input_layernorm": (h,),
        "post_attention_layernorm": (h,),
    }
    if cfg.attention_bias:
        layer |= {"q_bias": (q,), "k_bias": (kv,), "v_bias": (kv,)}
    if cfg.o_proj_bias:
        layer["o_bias"] = (h,)
    if cfg.qk_norm:
        layer |= {"q_norm": (cfg.head_dim,), "k_norm": (cfg.head_dim,)}
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, h)}
    for n in range(cfg.num_layers):
        for field_name in _LAYER_HF_NAMES:
            if field_name in layer:
                shapes[f"model.layers.{n}.{_LAYER_HF_NAMES[field_name]}"] = layer[field_name]
    shapes["model.norm.weight"] = (h,)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    return shapes


_T = TypeVar("_T", bound="TensorSet")


class TensorSet:
    """Weights listed by ``named_tensors()``: their list and their ``requires_grad``
    (full parameters and LoRA adapters alike)."""

    def named_tensors(self) -> Iterator[tuple[str, Tensor]]:
        raise NotImplementedError

    def parameters(self) -> list[Tensor]:
        return [t for _, t in self.named_tensors()]

    def requires_grad_(self: _T, requires_grad: bool = True) -> _T:
        for t in self.parameters():
            t.requires_grad_(requires_grad)
        return self


@dataclass
class LayerParams:
    """One decoder layer's tensors; optional ones are None when the arch has none."""

    q_proj: Tensor
    k_proj: Tensor
    v_proj: Tensor
    o_proj: Tensor
    gate_proj: Tensor
    up_proj: Tensor
    down_proj: Tensor
    input_layernorm: Tensor
    post_attention_layernorm: Tensor
    q_bias: Tensor | None = None
    k_bias: Tensor | None = None
    v_bias: Tensor | None = None
    o_bias: Tensor | None = None
    q_norm: Tensor | None = None
    k_norm: Tensor | None = None


@dataclass
class LlamaParams(TensorSet):
    """All weights of a model as plain tensors, convertible to and from HF names.

    Sharing is explicit: ``from_state_dict`` keeps the given tensors (no copy),
    ``clone()`` makes an independent copy (a full fine-tune's trainable weights).
    ``lm_head`` is None when embeddings are tied.
    """

    embed_tokens: Tensor
    layers: list[LayerParams]
    norm: Tensor
    lm_head: Tensor | None = None

    @classmethod
    def from_state_dict(cls, cfg: ModelConfig, tensors: Mapping[str, Tensor]) -> LlamaParams:
        """Wrap ``tensors`` (HF names, exactly those of ``param_shapes(cfg)``)."""
        shapes = param_shapes(cfg)
        missing = [n for n in shapes if n not in tensors]
        unexpected = [n for n in tensors if n not in shapes]
        if missing or unexpected:
            raise InvalidArgumentError(
                f"weights do not match the {cfg.arch} config: "
                f"missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
                f"unexpected {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}"
            )
        for name, shape in shapes.items():
            if tuple(tensors[name].shape) != shape:
                raise InvalidArgumentError(
                    f"weights: {name} has shape {tuple(tensors[name].shape)}, config says {shape}"
                )
        layers = []
        for n in range(cfg.num_layers):
            prefix = f"model.layers.{n}."
            kwargs = {
                f: tensors[prefix + hf]
                for f, hf in _LAYER_HF_NAMES.items()
                if prefix + hf in tensors
            }
            layers.append(LayerParams(**kwargs))
        return cls(
            embed_tokens=tensors["model.embed_tokens.weight"],
            layers=layers,
            norm=tensors["model.norm.weight"],
            lm_head=tensors.get("lm_head.weight"),
        )

    def named_tensors(self) -> Iterator[tuple[str, Tensor]]:
        """(HF name, tensor) in checkpoint order; tied ``lm_head`` is not repeated."""
        yield "model.embed_tokens.weight", self.embed_tokens
        for n, layer in enumerate(self.layers):
            for f in fields(layer):
                t = getattr(layer, f.name)
                if t is not None:
                    yield f"model.layers.{n}.{_LAYER_HF_NAMES[f.name]}", t
        yield "model.norm.weight", self.norm
        if self.lm_head is not None:
            yield "lm_head.weight", self.lm_head

    def state_dict(self) -> dict[str, Tensor]:
        return dict(self.named_tensors())

    def clone(self) -> LlamaParams:
        """An independent, detached copy (same dtype and device)."""
        return self.map(lambda t: t.detach().clone())

    def to(
        self, dtype: torch.dtype | None = None, device: torch.device | str | None = None
    ) -> LlamaParams:
        return self.map(lambda t: t.to(dtype=dtype, device=device))

    def map(self, fn: Callable[[Tensor], Tensor]) -> LlamaParams:
        """A new LlamaParams with ``fn`` applied to every tensor."""

        def layer_map(layer: LayerParams) -> LayerParams:
            changes = {
                f.name: fn(getattr(layer, f.name))
                for f in fields(layer)
                if getattr(layer, f.name) is not None
            }
            return replace(layer, **changes)

        return LlamaParams(
            embed_tokens=fn(self.embed_tokens),
            layers=[layer_map(layer) for layer in self.layers],
            norm=fn(self.norm),
            lm_head=None if self.lm_head is None else fn(self.lm_head),
        )

    @property
    def lm_head_weight(self) -> Tensor:
        return self.embed_tokens if self.lm_head is None else self.lm_head

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.device
