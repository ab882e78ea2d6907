"""The torch sampler's tokens: chosen on the device, read by the host once per step.

A step's forward passes (one per set of base weights) each leave their logits
on the device; ``choose`` samples every row there (inverse-CDF with the row's
uniform, ``workers.sampler.sampling``) and gathers the chosen tokens' logprobs, so no
value goes back to the host per row or per token. ``to_host`` then copies every
pass's tokens and logprobs in one transfer, the only device read of a decode
step; ``record`` appends them to their rows and checks stops against that host
copy (stop token ids are a set lookup per row, stop strings a decode of the
row's tail), which costs no synchronisation.

The host inputs of a step (token ids, positions, slots; the rows' uniforms and
sampling parameters) go the other way without waiting for the device:
``device.upload`` stages them in pinned memory and copies them asynchronously
on CUDA (on the CPU they are used as they are).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from tokenizers import Tokenizer
from torch import Tensor

from treadle.workers.device import device
from treadle.workers.sampler.partials import PartialStore
from treadle.workers.sampler.sampling import row_uniforms, sample_tokens
from treadle.workers.sampler.state import Row, partial_of


def step_inputs(
    tokens: Sequence[int], positions: Sequence[int], slots: Sequence[int], where: torch.device
) -> tuple[Tensor, Tensor, Tensor, slice | None]:
    """A decode step's ``tokens_B_1``, ``positions_B_1``, ``slots_B`` on ``where`` (one
    host-to-device copy), and the slots as a slice when they are consecutive (known
    here, on the host: attention then reads the cache in place)."""
    host_3_B = torch.tensor([list(tokens), list(positions), list(slots)], dtype=torch.long)
    on_3_B = device.upload(host_3_B, where)
    first = slots[0] if slots else 0
    consecutive = list(slots) == list(range(first, first + len(slots)))
    span = slice(first, first + len(slots)) if consecutive and slots else None
    return on_3_B[0][:, None], on_3_B[1][:, None], on_3_B[2], span


def choose(rows: Sequence[Row], logits_B_V: Tensor) -> tuple[Tensor, Tensor]:
    """Each row's next token and its logprob (temperature contract), on the logits'
    device; nothing is read back."""
    params = [r.request.op.params for r in rows]
    uniforms_B = row_uniforms(
        np.array([r.key for r in rows], dtype=np.uint64),
        np.array([len(r.tokens) for r in rows], dtype=np.uint64),
    )
    return sample_tokens(
        logits_B_V,
        [p.temperature for p in params],
        [p.top_k for p in params],
        [p.top_p for p in params],
        uniforms_B,
    )


def to_host(tokens: Sequence[Tensor], logprobs: Sequence[Tensor]) -> tuple[list[int], list[float]]:
    """Every pass's tokens and logprobs of one step, in order, in one device read
    (token ids are exact in float64)."""
    tokens_B = tokens[0] if len(tokens) == 1 else torch.cat(list(tokens))
    logprobs_B = logprobs[0] if len(logprobs) == 1 else torch.cat(list(logprobs))
    host_2_B = torch.stack([tokens_B.to(torch.float64), logprobs_B.to(torch.float64)]).cpu()
    values = host_2_B.numpy()
    return [int(t) for t in values[0]], [float(x) for x in values[1]]


def record(
    rows: Sequence[Row],
    tokens: Sequence[int],
    logprobs: Sequence[float],
    partials: PartialStore,
    tokenizer: Tokenizer | None,
) -> None:
    """Append each row's token and mark the rows that stop (on the host copy)."""
    for row, tok, lp in zip(rows, tokens, logprobs, strict=True):
        p = row.request.op.params
        row.tokens.append(tok)
        row.logprobs.append(lp)
        row.versions.append(row.snapshot.version)
        row.next_input = tok
        if tok in row.request.stop_ids:  # EOS (unless ignore_eos) or a stop token id
            row.stop_reason = "stop_token" if tok in p.stop_token_ids else "stop"
        elif p.stop_strings and hit_stop_string(row, tokenizer):
            row.stop_reason = "stop_string"
        elif len(row.tokens) >= p.max_tokens:
            row.stop_reason = "length"
        elif p.token_budget and len(row.tokens) >= p.token_budget:
            row.stop_reason = "partial"
            row.handle = partials.keep(partial_of(row))


def hit_stop_string(row: Row, tokenizer: Tokenizer | None) -> bool:
    stops = row.request.op.params.stop_strings
    if tokenizer is None:
        return False
    longest = max(len(s) for s in stops)
    tail = tokenizer.decode(row.tokens[-(longest + 1) :], skip_special_tokens=False)
    return any(s in tail for s in stops)
