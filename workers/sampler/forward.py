"""The sampler's two forwards over the KV cache: what a prefill chunk and a
decode step compute. ``sampler.py`` keeps the scheduling around them (which
requests prefill, when rows start, finish and free their slots); these only
run the model and charge its time to the requests that shared the pass.

- ``prefill``: one chunk of prompt tokens per request, into its staging slot,
  in one batched forward (and the prompt's logprobs from that same forward).
- ``decode``: one token for every running row, one forward per set of base
  weights (LoRA rows of any adapter and version share it), each sampled on the
  device; the caller reads all chosen tokens back at once (``token_choice``).
"""

from __future__ import annotations

import contextlib
import time

import torch
from torch import Tensor

from treadle.common.engine.model_config import ModelConfig
from treadle.workers.model import prepack
from treadle.workers.model.kv_cache import KVCache
from treadle.workers.model.llama import forward_hidden, lm_logits
from treadle.workers.sampler.prepack_policy import PrepackPolicy
from treadle.workers.sampler.state import Row, TorchRequest, charge, lora_for
from treadle.workers.sampler.token_choice import choose, step_inputs


def prefill(
    cfg: ModelConfig,
    stage: KVCache,
    batch: list[tuple[TorchRequest, int]],
    max_len: int,
    device: torch.device,
) -> Tensor:
    """Run ``n`` more prompt tokens of each ``(request, n)`` into its staging slot;
    the hidden states ``[B, T, H]`` (row b's first n positions are its chunk).
    Requests that score their prompt score this chunk from the same forward."""
    B, T = len(batch), max(n for _, n in batch)
    tokens_B_T = torch.zeros(B, T, dtype=torch.long)
    positions_B_T = torch.full((B, T), max_len - 1, dtype=torch.long)
    for b, (req, n) in enumerate(batch):
        start = req.prefilled
        tokens_B_T[b, :n] = torch.from_numpy(req.prompt[start : start + n])
        positions_B_T[b, :n] = torch.arange(start, start + n)
    params = batch[0][0].snapshot.params
    t0 = time.perf_counter()
    hidden_B_T_H = forward_hidden(
        cfg,
        params,
        tokens_B_T.to(device),
        positions_B_T.to(device),
        lora=lora_for([req.snapshot.adapter for req, _ in batch]),
        cache=stage,
        slots_B=torch.tensor([req.stage_slot for req, _ in batch], device=device),
        kv_len=max(req.prefilled + n for req, n in batch),  # known here: no device read
    )
    for b, (req, n) in enumerate(batch):
        if req.scorer is not None:  # prompt logprobs, from this same forward
            lora = lora_for([req.snapshot.adapter])
            req.scorer.add(cfg, params, hidden_B_T_H[b, :n], req.prefilled, lora)
    charge(batch, time.perf_counter() - t0)
    return hidden_B_T_H


def decode(
    cfg: ModelConfig,
    cache: KVCache,
    packing: PrepackPolicy,
    running: list[Row],
    device: torch.device,
) -> list[tuple[list[Row], Tensor, Tensor]]:
    """Advance every running row one position; per set of base weights, the rows
    and their chosen tokens and logprobs, still on the device."""
    groups: dict[int, list[Row]] = {}
    for row in running:
        groups.setdefault(id(row.snapshot.params), []).append(row)
    chosen: list[tuple[list[Row], Tensor, Tensor]] = []
    for rows in groups.values():
        params = rows[0].snapshot.params
        tokens = [r.next_input for r in rows]
        positions = [r.position for r in rows]
        slots = [r.slot for r in rows]
        adapters = [r.snapshot.adapter for r in rows]
        pad = packing.pad_rows(params, len(rows), len(running))
        if pad:
            # Filler rows in free slots at position 0 (overwritten before any
            # real row reads them), so the batch has the packed width.
            free = len(running)
            tokens += [0] * pad
            positions += [0] * pad
            slots += range(free, free + pad)
            adapters += [adapters[0]] * pad
        t0 = time.perf_counter()
        packs = packing.packs_for(len(rows))
        packed = prepack.decoding() if packs else contextlib.nullcontext()
        with packed:
            lora = lora_for(adapters)
            tokens_B_1, positions_B_1, slots_B, span = step_inputs(tokens, positions, slots, device)
            hidden_B_1_H = forward_hidden(
                cfg,
                params,
                tokens_B_1,
                positions_B_1,
                lora=lora,
                cache=cache,
                slots_B=slots_B,
                kv_len=max(positions) + 1,  # known here: no device read
                slot_span=span,
            )
            logits_B_V = lm_logits(cfg, params, hidden_B_1_H[:, -1], lora=lora)
            logits_B_V = logits_B_V[: len(rows)]
        for r in rows:
            r.position += 1
        charge([(r.request, 1) for r in rows], time.perf_counter() - t0)
        chosen.append((rows, *choose(rows, logits_B_V)))
    return chosen
