"""The per-sample random streams of seeded requests (``sampling.row_keys``)."""

from __future__ import annotations

import numpy as np

from treadle.workers.sampler.sampling import row_keys, row_uniforms


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
