"""RL helpers for the client side of the loop: advantages, datums, staleness, KL.

numpy only; torch tensors are accepted as inputs but torch is never imported.
"""

from treadle.rl.advantages import effective_group_rate, group_advantages, informative_groups
from treadle.rl.datums import AGGREGATIONS, Aggregation, Rollout, build_datums
from treadle.rl.kl import kl_k3
from treadle.rl.staleness import (
    Versions,
    drop_stale,
    expand_versions,
    rollout_staleness,
    staleness_histogram,
    token_staleness,
)

__all__ = [
    "AGGREGATIONS",
    "Aggregation",
    "Rollout",
    "Versions",
    "build_datums",
    "drop_stale",
    "effective_group_rate",
    "expand_versions",
    "group_advantages",
    "informative_groups",
    "kl_k3",
    "rollout_staleness",
    "staleness_histogram",
    "token_staleness",
]
