"""A training forward that computes a prefix shared by several rows once.

GRPO trains G completions of each prompt: G rows whose first tokens (the prompt,
often more than half of each row) are identical. Causal attention makes the
hidden states of those positions identical too, so a plain forward computes them
G times. Here the rows are grouped by their longest common prefix (``plan``),
and each layer runs two streams:

* the **prefix stream**: one row per group, its shared prefix, plain causal
  attention (as ``forward_hidden``);
* the **suffix stream**: one row per datum, the tokens after its group's prefix,
  attending to its group's prefix keys (gathered from the prefix stream) and
  causally to its own.

Each datum's hidden states are then gathered back to the padded ``[B, T]``
layout the loss reads. The gradient of a shared position is the sum over its
group's rows, exactly what the plain forward's G copies sum to (the gather's
backward adds them), so results agree with ``forward_hidden`` up to the
rounding of a different summation order (float64: ~1e-12; float32: ~1e-6,
``tests/unit/model/test_shared_prefix.py``).

``plan`` returns ``None`` when sharing would not save enough positions to pay
for the second stream (``MIN_SAVING``), or when the suffix stream's attention
mask would be large (``MAX_MASK_BYTES``: long rows). Rows of one batch must share one set of
weights: the layout is for a single model's call, not for ``LoraRows``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from treadle.common.engine.model_config import ModelConfig
from treadle.workers.model.llama import (
    LlamaParams,
    Lora,
    attention_output,
    attention_qkv,
    mlp,
    rms_norm,
    rope_cos_sin,
)

#: share only when the two streams hold at most this share of the plain forward's
#: padded positions (the second stream's fixed cost is a few ops per layer)
MIN_SAVING = 0.25
#: a group's prefix must be at least this long to be worth a row of its own
MIN_PREFIX = 2
#: the suffix stream's attention takes an explicit mask ``[B, S, P + S]`` (and its
#: scores as large, per head), where the plain forward's causal kernel needs none:
#: long rows stay on the plain forward (float32 elements)
MAX_MASK_BYTES = 64 << 20


@dataclass(frozen=True)
class PrefixLayout:
    """Where each datum's positions live in the two streams (host arrays, made once
    per call from its token rows).

    ``prefix_tokens_G_P``: each group's shared prefix, right-padded; ``prefix_len_G``;
    ``suffix_tokens_B_S``: each datum's tokens after its group's prefix,
    right-padded; ``group_B``: each datum's group; ``index_B_T``: each datum
    position's row in the pool ``[prefix positions (G x P) ; suffix positions
    (B x S)]`` (padding points at 0 and is masked by the caller)."""

    prefix_tokens_G_P: np.ndarray
    prefix_len_G: np.ndarray
    suffix_tokens_B_S: np.ndarray
    group_B: np.ndarray
    index_B_T: np.ndarray

    @property
    def positions(self) -> int:
        """Padded positions the two streams compute."""
        return self.prefix_tokens_G_P.size + self.suffix_tokens_B_S.size


def _common(a: np.ndarray, b: np.ndarray) -> int:
    n = min(a.size, b.size)
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n


def plan(rows: Sequence[np.ndarray], pad_id: int = 0) -> PrefixLayout | None:
    """The two-stream layout of ``rows`` (each datum's input tokens), or ``None`` when it
    would not save ``MIN_SAVING`` of the plain forward's ``B x T`` positions
    (``pad_id`` fills the streams' padding, which no real position reads).

    Rows are sorted, and consecutive rows join a group while that does not shrink
    the positions the group saves (a row whose common prefix with the group is
    shorter starts a group of its own); every row keeps at least one token of its
    own, so its last hidden state is always in the suffix stream."""
    B = len(rows)
    if B < 2:
        return None
    T = max(r.size for r in rows)
    order = sorted(range(B), key=lambda b: rows[b].tobytes())
    groups: list[list[int]] = []
    lengths: list[int] = []
    for b in order:
        own = rows[b].size - 1
        if groups:
            members, shared = groups[-1], lengths[-1]
            joined = min(shared, own, _common(rows[members[-1]], rows[b]))
            if joined >= MIN_PREFIX and len(members) * joined >= (len(members) - 1) * shared:
                members.append(b)
                lengths[-1] = joined
                continue
        groups.append([b])
        lengths.append(own)
    if len(groups) == B:
        return None
    P = max(lengths)
    S = max(rows[b].size - lengths[g] for g, members in enumerate(groups) for b in members)
    if len(groups) * P + B * S > (1 - MIN_SAVING) * B * T or B * S * (P + S) * 4 > MAX_MASK_BYTES:
        return None
    prefix = np.full((len(groups), P), pad_id, dtype=np.int64)
    suffix = np.full((B, S), pad_id, dtype=np.int64)
    group_B = np.zeros(B, dtype=np.int64)
    index = np.zeros((B, T), dtype=np.int64)
    for g, (members, p) in enumerate(zip(groups, lengths, strict=True)):
        prefix[g, :p] = rows[members[0]][:p]
        for b in members:
            row = rows[b]
            group_B[b] = g
            suffix[b, : row.size - p] = row[p:]
            index[b, :p] = g * P + np.arange(p)
            index[b, p : row.size] = len(groups) * P + b * S + np.arange(row.size - p)
    return PrefixLayout(prefix, np.asarray(lengths, dtype=np.int64), suffix, group_B, index)


def forward_hidden_shared(
    cfg: ModelConfig,
    params: LlamaParams,
    layout: PrefixLayout,
    *,
    lora: Lora | None = None,
) -> Tensor:
    """``forward_hidden``'s final-norm hidden states ``[B, T, H]`` of the rows ``layout``
    was planned from, each shared prefix computed once.

    Both streams' positions live in one pool ``[1, G x P + B x S, H]``: the
    projections, norms and MLPs run once over it, only attention is per stream."""
    device = params.embed_tokens.device
    group_B = torch.from_numpy(layout.group_B).to(device)
    plen_B = torch.from_numpy(layout.prefix_len_G).to(device)[group_B]
    (G, P), (B, S) = layout.prefix_tokens_G_P.shape, layout.suffix_tokens_B_S.shape
    split = G * P
    tokens = np.concatenate((layout.prefix_tokens_G_P.ravel(), layout.suffix_tokens_B_S.ravel()))
    x = F.embedding(torch.from_numpy(tokens).to(device)[None], params.embed_tokens)
    dtype = x.dtype
    positions = torch.cat(
        (
            torch.arange(P, device=device).repeat(G),
            (plen_B[:, None] + torch.arange(S, device=device)).ravel(),
        )
    )
    cos, sin = rope_cos_sin(cfg, positions[None], dtype)
    # a suffix query sees its group's prefix (keys < its prefix length) and its own
    # earlier suffix tokens; an additive float mask, as the cached forward's
    sees_prefix_B_1_P = (torch.arange(P, device=device) < plen_B[:, None])[:, None]
    sees_own_S_S = torch.ones(S, S, dtype=torch.bool, device=device).tril()
    visible = torch.cat((sees_prefix_B_1_P.expand(B, S, P), sees_own_S_S.expand(B, S, S)), -1)
    mask_B_1_S_L = torch.zeros(visible[:, None].shape, dtype=dtype, device=device)
    mask_B_1_S_L.masked_fill_(~visible[:, None], -math.inf)
    gqa = cfg.num_heads != cfg.num_kv_heads
    eps = cfg.rms_norm_eps
    for n, layer in enumerate(params.layers):
        q, k, v = attention_qkv(
            cfg, layer, n, rms_norm(x, layer.input_layernorm, eps), cos, sin, lora
        )
        # [1, N, heads, D] -> each stream's [rows, heads, T, D]
        qp, kp, vp = (t[0, :split].view(G, P, *t.shape[2:]).transpose(1, 2) for t in (q, k, v))
        qs, ks, vs = (t[0, split:].view(B, S, *t.shape[2:]).transpose(1, 2) for t in (q, k, v))
        out_p = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, enable_gqa=gqa)
        out_s = F.scaled_dot_product_attention(
            qs,
            torch.cat((kp[group_B], ks), dim=2),
            torch.cat((vp[group_B], vs), dim=2),
            attn_mask=mask_B_1_S_L,
            enable_gqa=gqa,
        )
        out = torch.cat(
            (
                out_p.transpose(1, 2).reshape(split, cfg.q_size),
                out_s.transpose(1, 2).reshape(B * S, cfg.q_size),
            )
        )
        x = x + attention_output(layer, n, out[None], lora)
        x = x + mlp(layer, n, rms_norm(x, layer.post_attention_layernorm, eps), lora)
    hidden_N_H = rms_norm(x[0], params.norm, eps)
    return hidden_N_H[torch.from_numpy(layout.index_B_T).to(device)]
