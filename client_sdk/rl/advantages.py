"""Group-relative advantages (GRPO / Dr.GRPO) and the informative-group filter.

Rewards are laid out group by group: the ``group_size`` completions of prompt 0,
then those of prompt 1, and so on (the order ``Sample`` returns them in).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from treadle.errors import InvalidArgumentError
from treadle.types import to_numpy


def _groups(rewards: Sequence[float] | np.ndarray | Any, group_size: int) -> np.ndarray:
    """Rewards reshaped to ``(n_groups, group_size)`` as float64."""
    if (
        isinstance(group_size, bool)
        or not isinstance(group_size, (int, np.integer))
        or group_size < 1
    ):
        raise InvalidArgumentError(f"group_size: must be a positive integer, got {group_size!r}")
    rewards_B = to_numpy(rewards, dtype=np.float64, field_name="rewards")
    if rewards_B.size % group_size:
        raise InvalidArgumentError(
            f"rewards: {rewards_B.size} rewards is not a multiple of group_size {group_size}"
        )
    if not np.isfinite(rewards_B).all():
        raise InvalidArgumentError("rewards: contains NaN or inf")
    return rewards_B.reshape(-1, group_size)


def group_advantages(
    rewards: Sequence[float] | np.ndarray | Any,
    group_size: int,
    normalize_std: bool = False,
    eps: float = 1e-6,
) -> np.ndarray:
    """One advantage per completion: its reward minus its group's mean reward.

    The group mean is the baseline GRPO uses instead of a critic. With
    ``normalize_std`` the centred rewards are divided by the group's population
    standard deviation plus ``eps`` (original GRPO); Dr.GRPO argues the division
    biases updates toward groups that are nearly all right or all wrong, and
    leaves it off, which is the default here. A group whose rewards are all
    equal gets zeros either way (``eps`` keeps the division finite).

    >>> group_advantages([1, 0, 1, 0], 4).tolist()
    [0.5, -0.5, 0.5, -0.5]
    """
    rewards_G = _groups(rewards, group_size)
    adv_G = rewards_G - rewards_G.mean(axis=1, keepdims=True)
    if normalize_std:
        adv_G = adv_G / (rewards_G.std(axis=1, keepdims=True) + eps)
    return adv_G.reshape(-1)


def informative_groups(
    rewards: Sequence[float] | np.ndarray | Any, group_size: int, min_std: float = 1e-6
) -> np.ndarray:
    """Boolean per group: True where the rewards differ (population std > ``min_std``).

    A group whose completions all earned the same reward has zero advantage
    everywhere and so contributes no gradient; DAPO's dynamic sampling drops
    such groups and samples more prompts to keep the effective batch full.
    """
    return _groups(rewards, group_size).std(axis=1) > min_std


def effective_group_rate(
    rewards: Sequence[float] | np.ndarray | Any, group_size: int, min_std: float = 1e-6
) -> float:
    """Fraction of groups that carry signal (0.0 for no groups).

    Worth logging every step: when it falls toward zero the prompts are solved
    (or hopeless) and the curriculum needs to move.
    """
    mask = informative_groups(rewards, group_size, min_std)
    return float(mask.mean()) if mask.size else 0.0
