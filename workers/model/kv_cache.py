"""A preallocated key/value cache addressed by (slot, position).

The sampler owns one ``KVCache`` per base model: ``num_slots`` sequences of up
to ``max_len`` tokens each, allocated once. A sequence lives in a slot; the
forward pass writes each token's K/V at ``[layer, slot, :, position]`` and
reads a slot's prefix back, so a decode step never concatenates or reallocates.

The cache keeps no per-slot length: the caller (the sampler's batcher) knows
each row's position and passes it in, and attention masks keys by position
(``key_pos <= query_pos``) with an additive -inf. A step reads every row's slot
up to the batch's longest position, so a row's slot *is* read beyond its own
extent, masked; and a mask does not stop a non-finite value (NaN + -inf = NaN,
0 x NaN = NaN: a diverged tenant's NaN K/V would make the next tenant in that
slot sample NaN). So the sampler keeps an invariant: every cell beyond what a
slot's current occupant wrote holds zeros. A slot starts zeroed; when a row
leaves a main slot the cells its occupant wrote are zeroed (``clear``, from
``sampler_state.compact``), and a staging slot is zeroed beyond the prefix its
next prompt reuses (``prefix_cache``). The cost is proportional to what the
former occupant wrote, never to ``max_len``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from treadle.common.engine.model_config import ModelConfig
from treadle.errors import InvalidArgumentError
from treadle.workers.device.device import upload


class KVCache:
    """K and V of shape ``[layers, slots, kv_heads, max_len, head_dim]``.

    The head axis comes before the position axis so that a slot's prefix
    ``[:, :, :length]`` reads out directly in the ``[B, H, T, D]`` layout that
    ``scaled_dot_product_attention`` takes.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        num_slots: int,
        max_len: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        if num_slots <= 0 or max_len <= 0:
            raise InvalidArgumentError(
                f"KVCache: num_slots and max_len must be positive, got {num_slots}, {max_len}"
            )
        shape = (cfg.num_layers, num_slots, cfg.num_kv_heads, max_len, cfg.head_dim)
        self.k_L_S_H_T_D = torch.zeros(shape, dtype=dtype, device=device)
        self.v_L_S_H_T_D = torch.zeros(shape, dtype=dtype, device=device)

    @property
    def num_slots(self) -> int:
        return self.k_L_S_H_T_D.shape[1]

    @property
    def max_len(self) -> int:
        return self.k_L_S_H_T_D.shape[3]

    @property
    def dtype(self) -> torch.dtype:
        return self.k_L_S_H_T_D.dtype

    @property
    def device(self) -> torch.device:
        return self.k_L_S_H_T_D.device

    def nbytes(self) -> int:
        """Memory held by K and V together."""
        return 2 * self.k_L_S_H_T_D.numel() * self.k_L_S_H_T_D.element_size()

    def write(
        self,
        layer: int,
        slots_B: Tensor,
        positions_B_T: Tensor,
        k_B_T_H_D: Tensor,
        v_B_T_H_D: Tensor,
        index_N: Tensor | None = None,
    ) -> None:
        """Store this call's K/V of row b, token t at ``[layer, slots_B[b], :, positions_B_T[b, t]]``.

        One ``index_copy_`` per tensor into the layer seen as ``[S*H*T, D]``
        rows (advanced-index assignment over the same cells is ~100x slower on
        CPU). ``index_N`` is ``flat_index(slots_B, positions_B_T)``, computed
        once per forward and shared by every layer. Two rows of one call must
        not share a slot.
        """
        if index_N is None:
            index_N = self.flat_index(slots_B, positions_B_T)
        D = self.k_L_S_H_T_D.shape[-1]
        for cache, x_B_T_H_D in ((self.k_L_S_H_T_D, k_B_T_H_D), (self.v_L_S_H_T_D, v_B_T_H_D)):
            src_N_D = x_B_T_H_D.transpose(1, 2).reshape(-1, D).to(cache.dtype)
            cache[layer].view(-1, D).index_copy_(0, index_N, src_N_D)

    def flat_index(self, slots_B: Tensor, positions_B_T: Tensor) -> Tensor:
        """Row indices ``[B*H*T]`` (in ``[B, H, T]`` order) of the cells that
        ``(slot, position)`` pairs address in a layer viewed as ``[S*H*T, D]``."""
        _, _, H, T_max, _ = self.k_L_S_H_T_D.shape
        heads_1_H_1 = torch.arange(H, device=self.device)[None, :, None]
        base_B_H_1 = (slots_B.to(self.device)[:, None, None] * H + heads_1_H_1) * T_max
        return (base_B_H_1 + positions_B_T.to(self.device)[:, None, :]).reshape(-1)

    def read(self, layer: int, slots_B: Tensor | slice, length: int) -> tuple[Tensor, Tensor]:
        """K and V of the first ``length`` positions of each row's slot, ``[B, H, length, D]``.

        A ``slice`` of slots (rows living in consecutive slots, which the
        sampler arranges) is a view: nothing is copied, and attention reads the
        cache in place. A tensor of slots gathers (copies) the first ``length``
        positions of those slots, a cost of the whole batch's K/V per layer.
        """
        if isinstance(slots_B, slice):
            return (
                self.k_L_S_H_T_D[layer, slots_B, :, :length],
                self.v_L_S_H_T_D[layer, slots_B, :, :length],
            )
        k_S_H_T_D = self.k_L_S_H_T_D[layer, :, :, :length]
        v_S_H_T_D = self.v_L_S_H_T_D[layer, :, :, :length]
        return k_S_H_T_D.index_select(0, slots_B), v_S_H_T_D.index_select(0, slots_B)

    def clear(self, slots: range, stop: int, start: int = 0) -> None:
        """Zero positions ``start..stop-1`` of the consecutive ``slots`` (K and V,
        every layer): one in-place ``zero_`` per tensor.

        The sampler's part of the invariant above: what a slot's former occupant
        wrote beyond where its next occupant's own K/V ends goes back to zeros,
        at a cost of what was written there, never of ``max_len``.
        """
        stop = min(stop, self.max_len)
        if not slots or stop <= start:
            return
        if slots.step != 1:
            raise InvalidArgumentError(f"clear: slots {slots} are not consecutive")
        for cache in (self.k_L_S_H_T_D, self.v_L_S_H_T_D):
            cache[:, slots.start : slots.stop, :, start:stop].zero_()

    def move(self, src_slots: Sequence[int], dst_slots: Sequence[int], length: int) -> None:
        """Copy the first ``length`` positions of each ``src_slots[i]`` into ``dst_slots[i]``.

        The sampler's compaction: a row leaving the batch leaves a hole, and a
        row from the end moves into it, so running rows keep consecutive slots.
        Sources and destinations must be disjoint. One copy per tensor.
        """
        if not src_slots or length <= 0:
            return
        src = upload(torch.tensor(list(src_slots), dtype=torch.long), self.device)
        dst = upload(torch.tensor(list(dst_slots), dtype=torch.long), self.device)
        for cache in (self.k_L_S_H_T_D, self.v_L_S_H_T_D):
            cache[:, dst, :, :length] = cache[:, src, :, :length]

    def copy_from(
        self,
        other: KVCache,
        src_slots: Sequence[int],
        counts: Sequence[int],
        dst_start: int,
        length: int,
    ) -> None:
        """Copy ``other``'s slots ``src_slots`` (first ``length`` positions) into
        consecutive slots from ``dst_start``, ``counts[i]`` copies of ``src_slots[i]``
        after those of the slots before it: prefilled prompts entering the batch as
        their G rows each, in one copy per tensor. A prompt shorter than ``length``
        brings the zeros beyond it (the invariant above) and leaves them so."""
        total = sum(counts)
        if total <= 0 or length <= 0:
            return
        if not length <= min(self.max_len, other.max_len):
            raise InvalidArgumentError(f"copy_from: length {length} beyond the caches")
        index_R = None
        if len(src_slots) > 1:
            rows = [s for s, n in zip(src_slots, counts, strict=True) for _ in range(n)]
            index_R = upload(torch.tensor(rows, dtype=torch.long), self.device)
        for mine, theirs in (
            (self.k_L_S_H_T_D, other.k_L_S_H_T_D),
            (self.v_L_S_H_T_D, other.v_L_S_H_T_D),
        ):
            if index_R is None:  # one prompt: its slot broadcast to its rows
                src = theirs[:, src_slots[0] : src_slots[0] + 1, :, :length]
            else:
                src = theirs[:, :, :, :length].index_select(1, index_R)
            mine[:, dst_start : dst_start + total, :, :length] = src

    def copy_prefix(self, src_slot: int, dst_slots: Sequence[int] | Tensor, length: int) -> None:
        """Copy the first ``length`` positions of ``src_slot`` into every slot of ``dst_slots``.

        This is how G samples of one prompt share one prefill: prefill the prompt
        into one slot, copy its prefix to the other G-1 slots, then decode all G
        rows together. One copy per tensor for all layers.
        """
        if not 0 < length <= self.max_len:
            raise InvalidArgumentError(f"copy_prefix: length {length} outside 1..{self.max_len}")
        dst_D = torch.as_tensor(dst_slots, dtype=torch.long, device=self.device)
        if dst_D.numel() == 0:
            return
        for cache in (self.k_L_S_H_T_D, self.v_L_S_H_T_D):
            src_L_1_H_T_D = cache[:, src_slot : src_slot + 1, :, :length]
            cache[:, dst_D, :, :length] = src_L_1_H_T_D
