"""Weights prepacked for MKL's sgemm: the sampler's fast path for fp32 on CPU.

MKL's sgemm repacks the weight matrix into its blocked layout on every call.
For the skinny products of decoding (a few dozen rows times a large weight)
that repacking costs as much as the multiply: a prepacked weight makes these
matmuls 1.2-1.5x faster here (``benchmarks/sampler_uniform.py``).

torch packs for one row count: ``torch.ops.mkl._mkl_linear`` multiplies with
the packed copy only when the input has exactly that many rows, and otherwise
falls back to the plain product (the same numbers as ``F.linear``). So the
sampler packs a snapshot's weights for its decode width (its slot count) and
pads a decode batch at most 1/8 short of that width up to it
(``TorchSampler``); every other call (prefill, the trainer) is unchanged.

The packed copy is a second copy of the weights; it is attached to each weight
tensor and freed with it (or by ``unpack``). It is used only under no-grad and
only while the weight is unchanged since packing (its version counter), so a
tensor updated in place never multiplies with stale packed values.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor

if TYPE_CHECKING:
    from treadle.workers.model.llama import LlamaParams

_ATTR = "_treadle_mkl_packed"  # on a weight tensor: (its version when packed, rows, packed)


def available(params: LlamaParams) -> bool:
    """Whether ``params`` can be prepacked here: fp32 weights on a CPU torch with MKL."""
    w = params.embed_tokens
    return w.device.type == "cpu" and w.dtype == torch.float32 and torch.backends.mkl.is_available()


def _weights(params: LlamaParams) -> Iterator[Tensor]:
    for layer in params.layers:
        yield from (layer.q_proj, layer.k_proj, layer.v_proj, layer.o_proj)
        yield from (layer.gate_proj, layer.up_proj, layer.down_proj)
    yield params.lm_head_weight


def prepack(params: LlamaParams, rows: int) -> None:
    """Attach to every linear weight of ``params`` its copy packed for ``rows``-row inputs."""
    with torch.no_grad():
        for w in _weights(params):
            packed = torch.ops.mkl._mkl_reorder_linear_weight(w.detach(), rows)
            setattr(w, _ATTR, (w._version, rows, packed))


def unpack(params: LlamaParams) -> None:
    """Free the packed copies ``prepack`` attached."""
    for w in _weights(params):
        if hasattr(w, _ATTR):
            delattr(w, _ATTR)


def packed_rows(params: LlamaParams) -> int | None:
    """The row count ``params`` is packed for (None: not packed, or changed since)."""
    w = params.lm_head_weight
    entry = getattr(w, _ATTR, None)
    return entry[1] if entry is not None and entry[0] == w._version else None


def linear(x: Tensor, w: Tensor, b: Tensor | None = None) -> Tensor:
    """``F.linear(x, w, b)``, through ``w``'s packed copy when it has a valid one and
    no gradient is being recorded."""
    entry = getattr(w, _ATTR, None)
    if entry is None or torch.is_grad_enabled() or entry[0] != w._version:
        return F.linear(x, w, b)
    rows = x.reshape(-1, x.shape[-1])
    out = torch.ops.mkl._mkl_linear(rows, entry[2], w, b, entry[1])
    return out.view(*x.shape[:-1], out.shape[-1])
