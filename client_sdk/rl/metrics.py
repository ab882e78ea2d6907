"""One train step's metrics from its calls' metrics, under the server's own names.

A train step of the loops sends several ``forward_backward`` / ``optim_step``
calls (one per minibatch). Their metrics are keyed ``name:reduction``
(``loss:sum``, ``clip_frac:mean``, ``kl_ref:mean``, ``ratio:max``,
``grad_norm:value``), and the step reports them under the same keys, so a
name means one thing whether it came from one call or from a whole step. The
suffix says how calls combine: sums add, means are token means over the step
(weighted by each call's ``ntokens:sum`` when it reports one), minima and
maxima take the extreme, anything else (``:value``) is the last call's.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np


def merge_metrics(calls: Iterable[Mapping[str, float]]) -> dict[str, float]:
    """Combine per-call metrics into one dict with the same ``name:reduction`` keys."""
    calls = list(calls)
    out: dict[str, float] = {}
    keys = dict.fromkeys(k for m in calls for k in m)  # first-seen order
    for key in keys:
        present = [m for m in calls if key in m]
        values = [float(m[key]) for m in present]
        reduction = key.rsplit(":", 1)[1] if ":" in key else ""
        if reduction == "sum":
            out[key] = float(sum(values))
        elif reduction == "mean":
            weights = [float(m.get("ntokens:sum", 1.0)) for m in present]
            total = sum(weights)
            out[key] = float(np.average(values, weights=weights)) if total > 0 else values[-1]
        elif reduction == "min":
            out[key] = min(values)
        elif reduction == "max":
            out[key] = max(values)
        else:
            out[key] = values[-1]
    return out
