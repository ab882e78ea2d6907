"""Choosing tokens: per-row randomness without generator state, and inverse-CDF
sampling over the vocabulary.

A row's uniform for its t-th token is a counter-based hash (SplitMix64) of
(request seed, sample index, t), so a seeded request draws the same numbers
whatever else shares the batch. ``sample_tokens`` turns logits and those
uniforms into tokens and their logprobs with per-row operations only.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from treadle.workers.device.device import upload

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser, elementwise on uint64 (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        z = x + _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def row_keys(seed: int, count: int) -> list[int]:
    """Each sample's random stream key: the values of the SplitMix64 stream that the
    hashed request seed starts, one a sample.

    Not ``hash(hash(seed) ^ hash(index))``: XOR is symmetric, so sample i of the
    request seeded s drew the numbers of sample s of the request seeded i (and
    sample s of seed s those of sample 0 of seed 0): requests seeded 0, 1, 2, ...
    (an evaluation set's, one seed a prompt) shared streams.
    """
    return requests_row_keys([seed], [count])[0]


def requests_row_keys(seeds: Sequence[int], counts: Sequence[int]) -> list[list[int]]:
    """``row_keys(seeds[i], counts[i])`` for each i, hashed in one pass over all rows."""
    seeds_F = _splitmix64(np.array([s % 2**64 for s in seeds], dtype=np.uint64))
    counts_F = np.asarray(counts, dtype=np.int64)
    starts_F = np.cumsum(counts_F) - counts_F
    total = int(counts_F.sum())
    index_R = np.arange(total, dtype=np.int64) - np.repeat(starts_F, counts_F)
    with np.errstate(over="ignore"):
        keys_R = _splitmix64(
            np.repeat(seeds_F, counts_F) + index_R.astype(np.uint64) * _GOLDEN
        ).tolist()
    return [keys_R[start : start + n] for start, n in zip(starts_F.tolist(), counts, strict=True)]


def row_uniforms(keys_B: np.ndarray, counters_B: np.ndarray) -> Tensor:
    """One uniform in (0, 1) per row: a hash of (row key, token index), float64."""
    with np.errstate(over="ignore"):
        bits = _splitmix64(keys_B + counters_B * _GOLDEN)
    u = ((bits >> np.uint64(11)).astype(np.float64) + 0.5) * 2.0**-53
    return torch.from_numpy(u)


def sample_tokens(
    logits_B_V: Tensor,
    temperatures: Sequence[float],
    top_ks: Sequence[int],
    top_ps: Sequence[float],
    uniforms_B: Tensor,
) -> tuple[Tensor, Tensor]:
    """One token per row and its logprob at the row's temperature (pre-truncation).

    Inverse-CDF sampling: token = the first whose cumulative (truncated)
    probability reaches ``u * total``, with ``u`` the row's uniform; found in
    two levels (block sums, then one block) so the vocabulary is read twice in
    all, a softmax and a sum. Temperature 0 is greedy; its reported logprob is
    at temperature 1. Every operation is per row, so a row's result does not
    depend on the others in the batch.
    """
    B, V = logits_B_V.shape
    logits = logits_B_V.float()
    temps = [t if t > 0 else 1.0 for t in temperatures]
    if any(t != 1.0 for t in temps):
        logits = logits / upload(torch.tensor(temps, dtype=logits.dtype), logits.device)[:, None]
    probs_B_V = torch.softmax(logits, dim=-1)
    truncate = [b for b in range(B) if (0 < top_ks[b] < V) or top_ps[b] < 1.0]
    weights_B_V = probs_B_V
    if truncate:
        weights_B_V = probs_B_V.clone()
        rows = upload(torch.tensor(truncate), logits.device)
        weights_B_V[rows] = _truncate(
            probs_B_V[rows],
            probs_B_V[rows].sum(-1, dtype=torch.float64),
            [top_ks[b] for b in truncate],
            [top_ps[b] for b in truncate],
        )
    tokens_B = _inverse_cdf(weights_B_V, upload(uniforms_B, logits.device))
    greedy = [b for b in range(B) if temperatures[b] <= 0]
    if greedy:
        rows_G = upload(torch.tensor(greedy), logits.device)
        tokens_B[rows_G] = logits_B_V[rows_G].argmax(-1)
    logprobs_B = probs_B_V.gather(-1, tokens_B[:, None]).squeeze(-1).log()
    return tokens_B, logprobs_B


def _inverse_cdf(weights_B_V: Tensor, uniforms_B: Tensor) -> Tensor:
    """Per row, the first index whose cumulative weight reaches ``u * total`` (float64).

    Blocks of ``blk`` tokens: a cumulative sum over block sums picks the block,
    a cumulative sum inside that block picks the token. A chosen token always
    has positive weight.
    """
    B, V = weights_B_V.shape
    blk = 256
    while blk > 8 and V % blk:
        blk //= 2
    if V % blk:
        weights_B_V = F.pad(weights_B_V, (0, blk - V % blk))
    nb = weights_B_V.shape[1] // blk
    w_B_N_K = weights_B_V.view(B, nb, blk)
    cum_B_N = w_B_N_K.sum(-1, dtype=torch.float64).cumsum(-1)
    target_B = uniforms_B.to(torch.float64) * cum_B_N[:, -1]
    block_B = torch.searchsorted(cum_B_N, target_B[:, None]).squeeze(-1).clamp_(max=nb - 1)
    before_B = cum_B_N.gather(-1, (block_B - 1).clamp(min=0)[:, None]).squeeze(-1)
    before_B = torch.where(block_B > 0, before_B, torch.zeros_like(before_B))
    rows_B = torch.arange(B, device=weights_B_V.device)
    cdf_B_K = w_B_N_K[rows_B, block_B].cumsum(-1, dtype=torch.float64)
    inner_B = torch.minimum((target_B - before_B).clamp(min=1e-300), cdf_B_K[:, -1])
    index_B = torch.searchsorted(cdf_B_K, inner_B[:, None]).squeeze(-1).clamp_(max=blk - 1)
    return (block_B * blk + index_B).clamp_(max=V - 1)


def _truncate(
    probs_R_V: Tensor, total_R: Tensor, top_ks: Sequence[int], top_ps: Sequence[float]
) -> Tensor:
    """Zero every token outside the row's top-k and outside its top-p nucleus.

    A token is kept when its rank is below k and the probability mass of the
    tokens ranked before it is below p (so the nucleus always holds the top
    token). Ties at the cut are kept.
    """
    R, V = probs_R_V.shape
    sorted_R_V, _ = torch.sort(probs_R_V, dim=-1, descending=True)
    dev = probs_R_V.device  # every tensor of the step on the logits' device
    ks = upload(torch.tensor([k if 0 < k < V else V for k in top_ks]), dev)
    keep_R_V = torch.arange(V, device=dev)[None, :] < ks[:, None]
    ps = upload(torch.tensor(list(top_ps), dtype=torch.float64), dev)
    if any(p < 1.0 for p in top_ps):  # decided on the host: no device read
        cum_before_R_V = sorted_R_V.cumsum(-1, dtype=torch.float64) - sorted_R_V
        keep_R_V &= cum_before_R_V < (ps * total_R)[:, None]
    keep_R_V[:, 0] = True
    kept_R = keep_R_V.sum(-1)
    threshold_R_1 = sorted_R_V.gather(-1, (kept_R - 1)[:, None])
    return torch.where(probs_R_V >= threshold_R_1, probs_R_V, torch.zeros_like(probs_R_V))
