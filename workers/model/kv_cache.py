"""A preallocated key/value cache addressed by (slot, position).

The sampler owns one ``KVCache`` per base model: ``num_slots`` sequences of up
to ``max_len`` tokens each, allocated once. A sequence lives in a slot; the
forward pass writes each token's K/V at ``[layer, slot, :, position]`` and
reads a slot's prefix back, so a decode step never concatenates or reallocates.

The cache keeps no per-slot length: the caller (the sampler's batcher) knows
each row's position and passes it in, and attention masks keys by position
(``key_pos <= query_pos``). Stale entries beyond a row's position are never
read, and are overwritten as the row advances, so freeing a slot costs nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from treadle.errors import InvalidArgumentError
from treadle.workers.model.config import ModelConfig


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
    ) -> None:
        """Store this call's K/V of row b, token t at ``[layer, slots_B[b], :, positions_B_T[b, t]]``.

        One ``index_put_`` per tensor, whatever the mix of slots and positions.
        Two rows of one call must not share a slot.
        """
        slot_idx_B_1 = slots_B[:, None]
        # Advanced indices around a slice put the indexed dims first: [B, T, H, D].
        self.k_L_S_H_T_D[layer][slot_idx_B_1, :, positions_B_T] = k_B_T_H_D
        self.v_L_S_H_T_D[layer][slot_idx_B_1, :, positions_B_T] = v_B_T_H_D

    def read(self, layer: int, slots_B: Tensor, length: int) -> tuple[Tensor, Tensor]:
        """K and V of the first ``length`` positions of each row's slot, ``[B, H, length, D]``.

        Gathers (copies) only the first ``length`` positions of the requested
        slots, so a short batch in a long cache stays cheap.
        """
        k_S_H_T_D = self.k_L_S_H_T_D[layer, :, :, :length]
        v_S_H_T_D = self.v_L_S_H_T_D[layer, :, :, :length]
        return k_S_H_T_D.index_select(0, slots_B), v_S_H_T_D.index_select(0, slots_B)

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
