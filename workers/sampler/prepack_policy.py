"""When the torch sampler decodes with prepacked weights (``workers.model.prepack``).

Packing a weight version is a second copy of it, paid once; it pays only for
weights that last (a ``latest`` sampler's weights change every step) and for
decode batches wide enough. The policy is decided once per base model and
dtype (``prepack.method_for``), then per decode batch here.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict

from treadle.workers.model import prepack
from treadle.workers.model.llama import LlamaParams

#: weight versions kept prepacked per sampler (each is a second copy of the weights)
MAX_PACKED = 2


class PrepackPolicy:
    def __init__(self, enabled: bool, width: int) -> None:
        self.enabled = enabled
        self.width = width  # the slot count: the batch width packed weights serve
        self._packed: OrderedDict[int, weakref.ref[LlamaParams]] = OrderedDict()
        self._method: str | None = None  # prepack.method_for the decode width
        self._min_rows = 0  # prepack.min_rows: smaller decode batches run plain
        self._after = 0  # prepack.pack_after: decode steps before weights are packed
        self._decoded: dict[int, tuple[weakref.ref[LlamaParams], int]] = {}

    @property
    def packed(self) -> int:
        """Weight versions held packed now."""
        return len(self._packed)

    def pad_rows(self, params: LlamaParams, rows: int, running: int) -> int:
        """Prepack ``params`` for a decode batch of ``rows`` rows (of ``running``
        decoding) when it pays, and return the filler rows to add. oneDNN's packed
        weights serve any batch up to the slot count: no filler. MKL's serve only
        the slot count: filler up to it when the batch is at most 1/8 short
        (filler rows cost every other op of the step, the packed matmuls save
        ~20-30% of theirs) and is every running row (so the free slots are the
        filler's); else the plain product, no filler."""
        width = self.width
        if self._method is None:  # one base model and dtype: decided once
            on = self.enabled and prepack.available(params)
            self._method = prepack.method_for(params, width) if on else "plain"
            self._min_rows = prepack.min_rows(params, width) if on else width
            self._after = prepack.pack_after(params, width) if on else 0
        if self._method == "plain":  # off, or measured: no packed copy is faster
            return 0
        if prepack.packed_rows(params) is None and self._steps_with(params) < self._after:
            return 0  # not (yet) worth packing: these weights may not last
        if self._method == "onednn":
            if rows >= self._min_rows:
                self._ensure_packed(params)
            return 0
        if rows < width - width // 8 or rows != running:
            return 0
        self._ensure_packed(params)
        return width - rows

    def packs_for(self, rows: int) -> bool:
        """Whether a decode batch of ``rows`` real rows multiplies with packed copies
        (below oneDNN's measured crossover the plain product is faster)."""
        return self._method != "onednn" or rows >= self._min_rows

    def _steps_with(self, params: LlamaParams) -> int:
        """Decode steps taken with ``params`` so far, this one included."""
        key = id(params)
        known = self._decoded.get(key)
        steps = 1 if known is None or known[0]() is not params else known[1] + 1
        self._decoded[key] = (weakref.ref(params), steps)
        if len(self._decoded) > 64:  # forget weights that are gone
            self._decoded = {k: v for k, v in self._decoded.items() if v[0]() is not None}
        return steps

    def _ensure_packed(self, params: LlamaParams) -> None:
        """``params`` packed for the width; the last ``MAX_PACKED`` weights decoded
        stay packed, older ones are unpacked."""
        key = id(params)
        known = self._packed.pop(key, None)
        if known is None or known() is not params:
            while len(self._packed) >= MAX_PACKED:
                oldest = self._packed.popitem(last=False)[1]()
                if oldest is not None:
                    prepack.unpack(oldest)
        if prepack.packed_rows(params) != self.width:
            prepack.prepack(params, self.width)
        self._packed[key] = weakref.ref(params)  # the newest
