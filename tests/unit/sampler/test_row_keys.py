"""The per-sample random streams of seeded requests (``sampling.row_keys``)."""

from __future__ import annotations

import numpy as np

from treadle.workers.sampler.sampling import requests_row_keys, row_keys, row_uniforms


def test_requests_seeded_with_small_numbers_do_not_share_streams() -> None:
    # seeds 0, 1, 2, ... are what an evaluation set seeded one prompt apart sends
    keys = [k for seed in range(64) for k in row_keys(seed, 16)]
    assert len(set(keys)) == len(keys)
    assert row_keys(3, 8)[5] != row_keys(5, 8)[3]


def test_first_uniforms_of_consecutively_seeded_requests_are_uniform() -> None:
    keys_N = np.array([k for seed in range(1000) for k in row_keys(seed, 1024)], dtype=np.uint64)
    for counter in (0, 1):
        u_N = row_uniforms(keys_N, np.full(keys_N.size, counter, dtype=np.uint64)).numpy()
        counts_100 = np.histogram(u_N, bins=100, range=(0.0, 1.0))[0]
        expected = u_N.size / 100
        chi2 = float(((counts_100 - expected) ** 2 / expected).sum())
        # 99 degrees of freedom: mean 99, sd 14 (101-143 here); streams shared between
        # seeds duplicate draws (235-350 for these seeds when key(s, i) was key(i, s))
        assert chi2 < 99 + 5.5 * 14, chi2


def test_keys_of_several_requests_at_once_are_each_requests_own() -> None:
    """Started together (``requests_row_keys``), each request's rows get the keys it
    gets alone, so a seeded request draws the same tokens whatever starts beside it
    (the keys pinned here are those of the one-request form before the batched one)."""
    assert row_keys(0, 2) == [12035550249420947055, 12935080325729570654]
    assert row_keys(7, 3) == [13309476754707697221, 11984929618412882174, 10134167572453724827]
    seeds, counts = [7, 0, 2**64 + 7, 5, 123456789], [3, 2, 1, 0, 8]
    assert requests_row_keys(seeds, counts) == [
        row_keys(s, n) for s, n in zip(seeds, counts, strict=True)
    ]
    assert requests_row_keys(seeds, counts)[0] == row_keys(7, 3)
