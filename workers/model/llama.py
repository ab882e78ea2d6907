"""The engine's one forward pass for the Llama family (Llama, Qwen2, Qwen3, Mistral).

Trainer and sampler both call these functions, so their logprobs for the same
weights agree by construction (invariant 4). The code is functional: weights
are plain tensors in a ``LlamaParams``, so a full fine-tune owns a trainable
copy while every LoRA model of a worker shares one frozen base copy, and the
multi-LoRA layer is just an optional ``lora`` argument.

Numerics follow transformers' modeling code (its implementation is the
reference the tests compare against): RMSNorm in float32 then cast back, RoPE
tables in float32 cast to the activation dtype, logits in the weights' dtype
then upcast.

Shapes in names: B rows, T tokens, H hidden (or heads where obvious), D head
dim, L attended key length, V vocab.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import Tensor

from treadle.common.engine.model_config import ModelConfig
from treadle.errors import InvalidArgumentError
from treadle.workers.device.device import upload
from treadle.workers.model.params import LayerParams as LayerParams
from treadle.workers.model.params import LlamaParams as LlamaParams
from treadle.workers.model.params import param_shapes as param_shapes
from treadle.workers.model.prepack import linear

if TYPE_CHECKING:
    from treadle.workers.model.kv_cache import KVCache


class Lora(Protocol):
    """What the forward needs of a LoRA layer (``LoraAdapter``, ``LoraRows``)."""

    def apply(self, layer: int, target: str, x: Tensor, y: Tensor) -> Tensor:
        """``y`` (the base projection of ``x``) plus the low-rank update, if any."""
        ...


# ---------------------------------------------------------------------- building blocks


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for the norms and RoPE tables (as HF), float64 for float64 activations:
    a float64 model is the engine's exact reference mode, nothing may round to float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm over the last axis, in float32 (float64 for float64), cast back before the weight (as HF).

    A float32 or float64 input needs no casts: torch's own ``F.rms_norm``
    computes the same ops, bit for bit forward and backward (checked in
    tests/unit/model/test_model_forward.py), in fewer dispatches (12.6 against 18 µs
    on a decode step's ``[40, 1, 128]``; the demo model's sampler 1.4% more tokens/s at
    8 rows, none at 48)."""
    if x.dtype == weight.dtype and x.dtype in (torch.float32, torch.float64):
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    x_c = x.to(_compute_dtype(x.dtype))
    x_c = x_c * torch.rsqrt(x_c.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x_c.to(x.dtype)


@functools.lru_cache(maxsize=16)
def rope_inv_freq(
    cfg: ModelConfig, device: torch.device, dtype: torch.dtype = torch.float32
) -> Tensor:
    """RoPE inverse frequencies ``[D/2]`` in ``dtype`` (float32, or float64 for a float64
    model), with llama3 scaling if configured."""
    d = cfg.head_dim
    exponents = torch.arange(0, d, 2, dtype=torch.int64).to(dtype) / d
    inv_freq = 1.0 / (cfg.rope_theta**exponents)
    s = cfg.rope_scaling
    if s is not None:
        low_freq_wavelen = s.original_max_position_embeddings / s.low_freq_factor
        high_freq_wavelen = s.original_max_position_embeddings / s.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
        smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
            s.high_freq_factor - s.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
        is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        inv_freq = torch.where(is_medium, smoothed, scaled)
    return upload(inv_freq, torch.device(device))  # no host wait for the device per forward


def rope_cos_sin(
    cfg: ModelConfig, positions_B_T: Tensor, dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """cos and sin ``[B, T, 1, D]`` (broadcast over heads), computed in float32
    (float64 for float64)."""
    compute = _compute_dtype(dtype)
    inv_freq = rope_inv_freq(cfg, positions_B_T.device, compute)
    freqs_B_T_D2 = positions_B_T[..., None].to(compute) * inv_freq
    emb_B_T_D = torch.cat((freqs_B_T_D2, freqs_B_T_D2), dim=-1)
    return emb_B_T_D.cos().to(dtype)[:, :, None], emb_B_T_D.sin().to(dtype)[:, :, None]


def apply_rope(x_B_T_H_D: Tensor, cos_B_T_1_D: Tensor, sin_B_T_1_D: Tensor) -> Tensor:
    half = x_B_T_H_D.shape[-1] // 2
    x1, x2 = x_B_T_H_D[..., :half], x_B_T_H_D[..., half:]
    rotated = torch.cat((-x2, x1), dim=-1)
    return x_B_T_H_D * cos_B_T_1_D + rotated * sin_B_T_1_D


def _proj(
    x: Tensor, w: Tensor, b: Tensor | None, lora: Lora | None, layer: int, name: str
) -> Tensor:
    """A linear projection; the LoRA update (if any) is added after the shared base matmul."""
    y = linear(x, w, b)
    return y if lora is None else lora.apply(layer, name, x, y)


@dataclass
class _CacheStep:
    """Per-call state of a cached forward, computed once and shared by all layers."""

    cache: KVCache
    slots_B: Tensor
    positions_B_T: Tensor
    kv_len: int
    mask_B_1_T_L: Tensor
    read_slots: Tensor | slice  # a slice when the rows' slots are consecutive: no gather
    write_index_N: Tensor  # the cache cells this call's K/V go to (every layer)


def attention_qkv(
    cfg: ModelConfig,
    layer: LayerParams,
    n: int,
    h_B_T_H: Tensor,
    cos: Tensor,
    sin: Tensor,
    lora: Lora | None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Layer ``n``'s queries, keys and values of ``h_B_T_H`` (``[B, T, heads, D]``), the
    queries and keys normed (Qwen3) and rotated: what every attention of the family
    computes before it reads keys (``workers.model.shared_prefix`` reads them across
    rows)."""
    B, T, _ = h_B_T_H.shape
    q = _proj(h_B_T_H, layer.q_proj, layer.q_bias, lora, n, "q_proj")
    k = _proj(h_B_T_H, layer.k_proj, layer.k_bias, lora, n, "k_proj")
    v = _proj(h_B_T_H, layer.v_proj, layer.v_bias, lora, n, "v_proj")
    q_B_T_Hq_D = q.view(B, T, cfg.num_heads, cfg.head_dim)
    k_B_T_Hk_D = k.view(B, T, cfg.num_kv_heads, cfg.head_dim)
    v_B_T_Hk_D = v.view(B, T, cfg.num_kv_heads, cfg.head_dim)
    if layer.q_norm is not None and layer.k_norm is not None:
        q_B_T_Hq_D = rms_norm(q_B_T_Hq_D, layer.q_norm, cfg.rms_norm_eps)
        k_B_T_Hk_D = rms_norm(k_B_T_Hk_D, layer.k_norm, cfg.rms_norm_eps)
    return apply_rope(q_B_T_Hq_D, cos, sin), apply_rope(k_B_T_Hk_D, cos, sin), v_B_T_Hk_D


def attention_output(layer: LayerParams, n: int, out_B_T_Q: Tensor, lora: Lora | None) -> Tensor:
    """The attention's heads, concatenated (``[B, T, heads x D]``), through layer
    ``n``'s output projection."""
    return _proj(out_B_T_Q, layer.o_proj, layer.o_bias, lora, n, "o_proj")


def _attention(
    cfg: ModelConfig,
    layer: LayerParams,
    n: int,
    h_B_T_H: Tensor,
    cos: Tensor,
    sin: Tensor,
    lora: Lora | None,
    step: _CacheStep | None,
) -> Tensor:
    B, T, _ = h_B_T_H.shape
    q_B_T_Hq_D, k_B_T_Hk_D, v_B_T_Hk_D = attention_qkv(cfg, layer, n, h_B_T_H, cos, sin, lora)
    gqa = cfg.num_heads != cfg.num_kv_heads
    if step is None:
        out_B_Hq_T_D = F.scaled_dot_product_attention(
            q_B_T_Hq_D.transpose(1, 2),
            k_B_T_Hk_D.transpose(1, 2),
            v_B_T_Hk_D.transpose(1, 2),
            is_causal=True,
            enable_gqa=gqa,
        )
    else:
        step.cache.write(
            n, step.slots_B, step.positions_B_T, k_B_T_Hk_D, v_B_T_Hk_D, step.write_index_N
        )
        k_B_Hk_L_D, v_B_Hk_L_D = step.cache.read(n, step.read_slots, step.kv_len)
        out_B_Hq_T_D = F.scaled_dot_product_attention(
            q_B_T_Hq_D.transpose(1, 2),
            k_B_Hk_L_D,
            v_B_Hk_L_D,
            attn_mask=step.mask_B_1_T_L,
            enable_gqa=gqa,
        )
    out_B_T_Q = out_B_Hq_T_D.transpose(1, 2).reshape(B, T, cfg.q_size)
    return attention_output(layer, n, out_B_T_Q, lora)


def mlp(layer: LayerParams, n: int, h_B_T_H: Tensor, lora: Lora | None) -> Tensor:
    """Layer ``n``'s gated MLP (its input already normed)."""
    gate = _proj(h_B_T_H, layer.gate_proj, None, lora, n, "gate_proj")
    up = _proj(h_B_T_H, layer.up_proj, None, lora, n, "up_proj")
    return _proj(F.silu(gate) * up, layer.down_proj, None, lora, n, "down_proj")


# ---------------------------------------------------------------------- the forward pass


def forward_hidden(
    cfg: ModelConfig,
    params: LlamaParams,
    tokens_B_T: Tensor,
    positions_B_T: Tensor | None = None,
    *,
    lora: Lora | None = None,
    cache: KVCache | None = None,
    slots_B: Tensor | None = None,
    checkpoint_layers: bool = False,
    kv_len: int | None = None,
    slot_span: slice | None = None,
) -> Tensor:
    """Final-norm hidden states ``[B, T, H]`` of ``tokens_B_T``.

    Without ``cache``: plain causal attention over the T axis; ``positions_B_T``
    (default ``0..T-1``) only sets RoPE. Right padding is harmless: a token
    never attends to later ones.

    With ``cache`` and ``slots_B`` (row b lives in cache slot ``slots_B[b]``):
    this call's K/V are written at ``[slot, positions]``, then each query
    attends to its slot's entries at positions <= its own. The same call serves
    a prefill (T > 1, positions from 0 or from an already cached prefix) and a
    decode step (T = 1, each row at its own position); rows at different
    lengths are handled by the positional mask. Positions of padded tokens must
    still be < ``cache.max_len``; what they write is overwritten before it is
    ever read.

    ``lora`` is one ``LoraAdapter`` for every row (the fast path) or a
    ``LoraRows`` mapping each row to its own adapter (or none).

    ``checkpoint_layers`` (training long sequences): keep only each layer's
    input for the backward and recompute the layer there (activation
    checkpointing): about one more forward of time for a layer's worth of
    activations instead of all of them.

    ``kv_len`` (with ``cache``): ``positions_B_T.max() + 1`` when the caller
    knows it on the host, so a GPU step does not wait to read it back;
    ``slot_span``: ``slots_B`` as a slice when the caller knows them consecutive
    (attention reads the cache in place, with no device read to find out).
    """
    B, T = tokens_B_T.shape
    if positions_B_T is None:
        positions_B_T = torch.arange(T, device=tokens_B_T.device).expand(B, T)
    x_B_T_H = F.embedding(tokens_B_T, params.embed_tokens)
    cos, sin = rope_cos_sin(cfg, positions_B_T, x_B_T_H.dtype)

    step = None
    if cache is not None:
        if slots_B is None:
            raise InvalidArgumentError("forward_hidden: slots_B is required with a cache")
        if kv_len is None:  # a caller that knows it (the sampler) saves a device read
            kv_len = int(positions_B_T.max()) + 1
        if kv_len > cache.max_len:
            raise InvalidArgumentError(
                f"forward_hidden: position {kv_len - 1} is beyond the cache (max_len "
                f"{cache.max_len})"
            )
        key_pos_L = torch.arange(kv_len, device=tokens_B_T.device)
        # An additive float mask: the CPU attention kernel runs ~2x faster with it
        # than with a boolean one.
        visible_B_1_T_L = (key_pos_L <= positions_B_T[:, :, None])[:, None]
        mask_B_1_T_L = torch.zeros(
            visible_B_1_T_L.shape, dtype=x_B_T_H.dtype, device=tokens_B_T.device
        ).masked_fill_(~visible_B_1_T_L, -math.inf)
        step = _CacheStep(
            cache,
            slots_B,
            positions_B_T,
            kv_len,
            mask_B_1_T_L,
            slot_span if slot_span is not None else _slot_span(slots_B),
            cache.flat_index(slots_B, positions_B_T),
        )

    for n, layer in enumerate(params.layers):
        if checkpoint_layers:
            x_B_T_H = torch.utils.checkpoint.checkpoint(
                _layer, cfg, layer, n, x_B_T_H, cos, sin, lora, step, use_reentrant=False
            )
        else:
            x_B_T_H = _layer(cfg, layer, n, x_B_T_H, cos, sin, lora, step)
    return rms_norm(x_B_T_H, params.norm, cfg.rms_norm_eps)


def decoder_layer(
    cfg: ModelConfig,
    layer: LayerParams,
    n: int,
    x_B_T_H: Tensor,
    cos: Tensor,
    sin: Tensor,
    lora: Lora | None = None,
) -> Tensor:
    """Decoder layer ``n`` of a plain causal forward (no cache): what
    ``forward_hidden`` runs per layer, for a caller that runs the layers one at a
    time (the FSDP layers of a sharded full fine-tune or of a LoRA model's sharded
    base, ``workers.trainer.fsdp``)."""
    return _layer(cfg, layer, n, x_B_T_H, cos, sin, lora, None)


def _layer(
    cfg: ModelConfig,
    layer: LayerParams,
    n: int,
    x_B_T_H: Tensor,
    cos: Tensor,
    sin: Tensor,
    lora: Lora | None,
    step: _CacheStep | None,
) -> Tensor:
    eps = cfg.rms_norm_eps
    h_B_T_H = rms_norm(x_B_T_H, layer.input_layernorm, eps)
    x_B_T_H = x_B_T_H + _attention(cfg, layer, n, h_B_T_H, cos, sin, lora, step)
    h_B_T_H = rms_norm(x_B_T_H, layer.post_attention_layernorm, eps)
    return x_B_T_H + mlp(layer, n, h_B_T_H, lora)


def _slot_span(slots_B: Tensor) -> Tensor | slice:
    """``slots_B`` as a slice when they are consecutive and ascending (attention
    then reads the cache in place), else the tensor itself (a gather)."""
    if slots_B.device.type != "cpu" or slots_B.numel() == 0:
        return slots_B
    first = int(slots_B[0])
    if slots_B.numel() == 1 or torch.equal(
        slots_B, torch.arange(first, first + slots_B.numel(), dtype=slots_B.dtype)
    ):
        return slice(first, first + slots_B.numel())
    return slots_B


def lm_logits(
    cfg: ModelConfig, params: LlamaParams, hidden_B_T_H: Tensor, lora: Lora | None = None
) -> Tensor:
    """Logits ``[..., V]`` in float32 (float64 for float64 weights).

    The matmul runs in the weights' dtype (as HF), only the result is upcast:
    upcasting a V x H head per call would cost more than the matmul. Slice
    ``hidden`` first when only some positions are needed (the sampler's last
    token). ``lora`` (the same object the forward took) adds the unembedding's
    adapter if it has one (layer index ``HEAD`` = -1, target ``lm_head``); its
    rows are ``hidden``'s first dimension.
    """
    del cfg  # the head is fully described by params; kept for a uniform signature
    logits = linear(hidden_B_T_H, params.lm_head_weight)
    if lora is not None:
        if hidden_B_T_H.ndim == 2:  # [B, H]: rows of one position each
            logits = lora.apply(-1, "lm_head", hidden_B_T_H[:, None], logits[:, None])[:, 0]
        else:
            logits = lora.apply(-1, "lm_head", hidden_B_T_H, logits)
    if logits.dtype not in (torch.float32, torch.float64):
        logits = logits.float()
    return logits


def target_logprobs(logits_B_T_V: Tensor, targets_B_T: Tensor, temperature: float = 1.0) -> Tensor:
    """``log_softmax(logits / temperature)`` at ``targets``, ``[B, T]``, at least float32.

    The policy's logprob at temperature T (DESIGN "Temperature belongs to the
    policy"): sampler and trainer both call this, before any top-k/top-p.
    Computed as ``logit[target] - logsumexp(logits)`` so no ``[B, T, V]``
    log-softmax tensor is materialised.
    """
    if not temperature > 0:
        raise InvalidArgumentError(f"temperature: must be > 0, got {temperature}")
    logits = logits_B_T_V
    if logits.dtype not in (torch.float32, torch.float64):
        logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    picked_B_T = logits.gather(-1, targets_B_T.unsqueeze(-1)).squeeze(-1)
    return picked_B_T - torch.logsumexp(logits, dim=-1)
