"""KL estimators on per-token log-probs (numpy), for client-side diagnostics.

The server's losses use the same k3 estimator (``treadle.workers.trainer.losses``), so
a client that has sampler, trainer and reference log-probs can check the
numbers it will be trained on.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def _as_array(values: Any) -> np.ndarray:
    if hasattr(values, "detach") and hasattr(
        values, "cpu"
    ):  # a torch tensor, without importing torch
        values = values.detach().cpu().numpy()
    return np.asarray(values, dtype=np.float64)


def kl_k3(logp: Any, ref_logp: Any) -> np.ndarray:
    """Elementwise k3 estimate of KL(p ‖ ref) from tokens sampled from p.

    ``k3 = exp(x) - x - 1`` with ``x = ref_logp - logp`` (Schulman, "Approximating
    KL divergence", 2020): unbiased, always >= 0, and much lower variance than
    ``-x``. Average it over response tokens for the sequence- or batch-level KL.
    With ``logp`` the trainer's and ``ref_logp`` the sampler's log-probs it gives
    the sampler/trainer mismatch; swap the arguments' roles for KL(ref ‖ p) only
    when the tokens came from ref.
    """
    x = _as_array(ref_logp) - _as_array(logp)
    return np.exp(x) - x - 1.0
