"""Weights prepacked for the CPU's matmul library: the sampler's fast path.

A plain ``F.linear`` on CPU runs MKL's sgemm, which repacks the weight matrix
into its blocked layout on every call. For the skinny products of decoding (a
few dozen rows times a large weight) that repacking costs as much as the
multiply. Two ways to pay it once, per weight, are kept as a second copy:

* ``"mkl"``: MKL's packed sgemm (``torch.ops.mkl._mkl_linear``). torch uses
  the packed copy only when the input has exactly the row count it was packed
  for, and otherwise falls back to the plain product. So the sampler packs
  for its decode width (its slot count) and pads a decode batch at most 1/8
  short of that width up to it; every other batch runs plain.
* ``"onednn"``: oneDNN's reordered weight (``torch.ops.mkldnn._linear_pointwise``),
  valid for any row count. It is used for inputs of up to the packed row
  count (the decode batches), with no padding; larger inputs (prefill) run
  plain.

bf16 weights have only oneDNN's copy, on a CPU with native bf16 multiplies
(AVX512-BF16, AMX): on a 2-core Xeon with AMX it ran the 110M model's
bf16 products at 32 rows in 5.8 ms a decode step against 9.8 ms for
``F.linear``, with equal results (the plain product goes through oneDNN too).

Which is faster, if either beats the plain product, depends on the CPU and
the shapes. On one 2-core AVX-512 machine MKL's
packed copy made decoding 1.19x faster than plain weights; on a 2-core AMD
EPYC it gave 1.04x, while oneDNN ran the 110M model's products 1.3-2x faster
than ``F.linear`` at 8-64 rows (its 32k-vocabulary head at 32 rows: 13 against
24 ms). So the method is measured, once per process for each set of weight
shapes and row count (``method_for``): each method, and the plain product,
multiplies every distinct weight shape a few times at that row count, and the
fastest in total wins ("plain": no packed copy; the demo model's 128-wide
weights on that EPYC: plain 0.39 ms, MKL's 0.40, oneDNN's 0.48 at 128 rows).
Two more things are measured with it: the fewest rows at which oneDNN's copy
still beats the plain product (``min_rows``: smaller decode batches multiply
plain), and how many decode steps packing takes to pay for itself
(``pack_after``: the sampler packs a set of weights only once it has decoded
with it that long, so a full fine-tune's versions, replaced every optimizer
step, are not packed only to be thrown away).

The packed copy is attached to each weight tensor and freed with it (or by
``unpack``). It is used only inside ``decoding()`` (the sampler's decode
steps, on that thread), under no-grad, and only while the weight is
unchanged since packing (its version counter), so a tensor updated in place
never multiplies with stale packed values. The trainer shares the base
weights but never takes this path: its ``forward_logprobs`` and
``forward_backward`` give bit-identical logprobs whatever the sampler packed.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import math
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor

if TYPE_CHECKING:
    from treadle.workers.model.llama import LlamaParams

log = logging.getLogger("treadle.sampler")

#: on a weight tensor: (its version when packed, rows, method, the packed copy)
_ATTR = "_treadle_packed"
#: the measured choice, per (weight shapes, dtype, rows): (method, fewest rows it
#: pays at, decode steps it takes to earn back the packing)
_chosen: dict[tuple[tuple[tuple[int, ...], ...], torch.dtype, int], tuple[str, int, int]] = {}
_local = threading.local()  # .decoding: inside ``decoding()`` on this thread


@contextlib.contextmanager
def decoding() -> Iterator[None]:
    """Inside, on this thread, ``linear`` may multiply with packed copies."""
    before = getattr(_local, "decoding", False)
    _local.decoding = True
    try:
        yield
    finally:
        _local.decoding = before


def methods(dtype: torch.dtype = torch.float32) -> list[str]:
    """The prepacking methods this torch build and CPU have for ``dtype`` weights,
    in order of preference on a tie. MKL's packed sgemm is fp32 only; oneDNN
    reorders bf16 weights too, where the CPU multiplies bf16 natively."""
    out = []
    onednn = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    if onednn and (dtype == torch.float32 or (dtype == torch.bfloat16 and _bf16_native())):
        out.append("onednn")
    if dtype == torch.float32 and torch.backends.mkl.is_available():
        out.append("mkl")
    return out


def _bf16_native() -> bool:
    """Whether oneDNN has bf16 kernels for this CPU (AVX512-BF16, AMX)."""
    check = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return bool(check()) if check is not None else False


def available(params: LlamaParams) -> bool:
    """Whether ``params`` can be prepacked here: fp32 or bf16 weights on CPU, and a
    method for their dtype."""
    w = params.embed_tokens
    return w.device.type == "cpu" and bool(methods(w.dtype))


def _weights(params: LlamaParams) -> Iterator[Tensor]:
    for layer in params.layers:
        yield from (layer.q_proj, layer.k_proj, layer.v_proj, layer.o_proj)
        yield from (layer.gate_proj, layer.up_proj, layer.down_proj)
    yield params.lm_head_weight


def _pack(method: str, w: Tensor, rows: int) -> Tensor:
    if method == "plain":
        return w
    if method == "onednn":
        return torch.ops.mkldnn._reorder_linear_weight(w)
    return torch.ops.mkl._mkl_reorder_linear_weight(w, rows)


def _packed_product(method: str, x_N_I: Tensor, packed: Tensor, w: Tensor, rows: int) -> Tensor:
    if method == "plain":
        return F.linear(x_N_I, w)
    if method == "onednn":
        return torch.ops.mkldnn._linear_pointwise(x_N_I, packed, None, "none", [], "")
    return torch.ops.mkl._mkl_linear(x_N_I, packed, w, None, rows)


def method_for(params: LlamaParams, rows: int) -> str:
    """The faster method on this machine for ``params``' weight shapes at ``rows``
    rows (measured on the first call for those shapes, then remembered)."""
    return _plan(params, rows)[0]


def min_rows(params: LlamaParams, rows: int) -> int:
    """The fewest rows at which ``method_for(params, rows)``'s packed copy beats the
    plain product (oneDNN's copy serves any batch up to ``rows``, but at a few
    rows it can be the slower one: the demo model's weights at 8 rows, 0.37 ms
    against plain's 0.21, on the EPYC above). Measured at halvings of ``rows``."""
    return _plan(params, rows)[1]


def pack_after(params: LlamaParams, rows: int) -> int:
    """Decode steps with one set of weights after which packing them has paid for
    itself (packing time / time saved per ``rows``-row step): pack weights once
    they have been decoded with that long, and short-lived weights (a full
    fine-tune's in-flight versions, one per optimizer step) never cost more
    than twice the best choice made knowing their lifetime in advance."""
    return _plan(params, rows)[2]


def _plan(params: LlamaParams, rows: int) -> tuple[str, int, int]:
    all_weights = [w.detach() for w in _weights(params)]
    by_shape = {tuple(w.shape): w for w in all_weights}
    dtype = all_weights[0].dtype
    key = (tuple(sorted(by_shape)), dtype, rows)
    if key not in _chosen:
        weights = list(by_shape.values())
        per_shape = collections.Counter(tuple(w.shape) for w in all_weights)
        counts = [per_shape[shape] for shape in by_shape]
        candidates = ["plain", *methods(dtype)]  # "plain": no packed copy beats them
        seconds = {m: _time_method(m, weights, rows, counts) for m in candidates}
        method = min(candidates, key=lambda m: seconds[m])
        after = 0
        if method != "plain":
            t0 = time.perf_counter()
            for w in all_weights:
                _pack(method, w, rows)
            packing = time.perf_counter() - t0
            after = math.ceil(packing / max(seconds["plain"] - seconds[method], 1e-9))
        fewest = rows
        if method == "onednn":  # MKL's copy serves exactly ``rows`` rows anyway
            smaller = rows // 2
            while smaller >= 1 and _time_method(method, weights, smaller) < _time_method(
                "plain", weights, smaller
            ):
                fewest, smaller = smaller, smaller // 2
        _chosen[key] = (method, fewest, after)
        log.info(
            "prepacked weights for %d-row decode batches: %s from %d rows, after %d steps (%s)",
            rows,
            method,
            fewest,
            after,
            ", ".join(f"{m} {s * 1e3:.2f} ms" for m, s in seconds.items()),
        )
    return _chosen[key]


def _time_method(
    method: str,
    weights: list[Tensor],
    rows: int,
    counts: list[int] | None = None,
    repeat: int = 5,
) -> float:
    """Seconds for one ``rows``-row product with each of ``weights`` (best of
    ``repeat``), each counted ``counts`` times (the weights of that shape)."""
    total = 0.0
    with torch.no_grad():
        for i, w in enumerate(weights):
            x_N_I = torch.randn(rows, w.shape[1]).to(w.dtype)
            packed = _pack(method, w, rows)
            _packed_product(method, x_N_I, packed, w, rows)  # warm-up
            best = float("inf")
            for _ in range(repeat):
                t0 = time.perf_counter()
                _packed_product(method, x_N_I, packed, w, rows)
                best = min(best, time.perf_counter() - t0)
            total += best * (counts[i] if counts else 1)
    return total


def prepack(params: LlamaParams, rows: int, method: str | None = None) -> str:
    """Attach to every linear weight of ``params`` its copy packed for decode batches
    of ``rows`` rows (``method``: default ``method_for``); returns the method.
    "plain" attaches nothing (and drops what an earlier call attached)."""
    method = method or method_for(params, rows)
    if method == "plain":
        unpack(params)
        return method
    with torch.no_grad():
        for w in _weights(params):
            setattr(w, _ATTR, (w._version, rows, method, _pack(method, w.detach(), rows)))
    return method


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
    """``F.linear(x, w, b)``, through ``w``'s packed copy when it has a valid one for
    this many rows, inside ``decoding()``, with no gradient being recorded."""
    entry = getattr(w, _ATTR, None)
    if (
        entry is None
        or not getattr(_local, "decoding", False)
        or torch.is_grad_enabled()
        or entry[0] != w._version
    ):
        return F.linear(x, w, b)
    _, rows, method, packed = entry
    x_N_I = x.reshape(-1, x.shape[-1])
    if x_N_I.shape[0] > rows if method == "onednn" else x_N_I.shape[0] != rows:
        return F.linear(x, w, b)
    out = _packed_product(method, x_N_I, packed, w, rows)
    if b is not None:
        out = out + b
    return out.view(*x.shape[:-1], out.shape[-1])
