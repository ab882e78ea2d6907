"""How stale a rollout is, in optimizer steps, and dropping the ones past a bound.

Versions count optimizer steps (docs/concepts.md): a model's weight version is
the number of optimizer steps applied, every sampled token carries the version
that wrote it, and a token's staleness is ``current_version - token_version``.
In async RL the sampler lags the trainer; bounding the lag (dropping rollouts
older than ``max_staleness`` steps) keeps the importance ratios, and so the
clip, meaningful.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from treadle.errors import InvalidArgumentError
from treadle.types import VersionSpan

if TYPE_CHECKING:
    from treadle.rl.datums import Rollout

#: Either the spans ``SampledSequence.versions`` carries or one version per token.
Versions = Sequence[VersionSpan] | Sequence[int]


def _check_int(value: Any, field_name: str, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise InvalidArgumentError(f"{field_name}: must be an integer >= {minimum}, got {value!r}")
    return int(value)


def expand_versions(versions: Versions | Any, *, field_name: str = "versions") -> np.ndarray:
    """Per-token versions (int64) from spans or from a per-token list.

    Spans must be contiguous from token 0, as the sampler returns them, so a
    missing or overlapping span is an error rather than a silent misalignment.
    """
    items = list(versions)
    if items and all(isinstance(item, VersionSpan) for item in items):
        out: list[int] = []
        for i, span in enumerate(items):
            if span.start != len(out) or span.length < 0:
                raise InvalidArgumentError(
                    f"{field_name}[{i}]: span starts at {span.start} (length {span.length}), "
                    f"expected a contiguous span starting at {len(out)}"
                )
            out.extend([span.version] * span.length)
        return np.asarray(out, dtype=np.int64)
    if any(isinstance(item, VersionSpan) for item in items):
        raise InvalidArgumentError(f"{field_name}: mixes VersionSpan and plain ints")
    return np.asarray(
        [_check_int(v, f"{field_name}[{i}]") for i, v in enumerate(items)], dtype=np.int64
    )


def count_versions(versions: Versions | Any, *, field_name: str = "versions") -> int:
    """``len(expand_versions(versions))``, with the same checks and errors, without
    building the per-token array for the common case (spans with int fields)."""
    items = versions if isinstance(versions, tuple | list) else list(versions)
    if not items or not all(
        type(item) is VersionSpan and type(item.start) is int and type(item.length) is int
        for item in items
    ):
        return len(expand_versions(items, field_name=field_name))
    total = 0
    for i, span in enumerate(items):
        if span.start != total or span.length < 0:
            raise InvalidArgumentError(
                f"{field_name}[{i}]: span starts at {span.start} (length {span.length}), "
                f"expected a contiguous span starting at {total}"
            )
        total += span.length
    return total


def token_staleness(versions: Versions | Any, current_version: int) -> np.ndarray:
    """``current_version - version`` for every token (int64, >= 0)."""
    current = _check_int(current_version, "current_version")
    token_versions = expand_versions(versions)
    if token_versions.size:
        _check_not_newer(int(token_versions.max()), current)
    return current - token_versions


def _check_not_newer(newest: int, current: int) -> None:
    if newest > current:
        raise InvalidArgumentError(
            f"versions: a token has version {newest}, newer than "
            f"current_version {current} (pass the trainer's current version)"
        )


def rollout_staleness(rollout: Rollout, current_version: int) -> int:
    """The rollout's oldest token, in optimizer steps (0 for an empty completion).

    A multi-version rollout (its sampler picked up new weights mid-sequence) is
    as stale as its oldest token: that token's ratio is the least trustworthy.
    """
    if not rollout.completion_tokens:
        return 0
    versions = rollout.versions
    if not versions:
        raise InvalidArgumentError(
            "rollout.versions: empty; staleness needs the version of each sampled token "
            "(SampledSequence.versions)"
        )
    bounds = _span_bounds(versions)
    if bounds is None:
        return int(token_staleness(versions, current_version).max())
    # token_staleness's answer and errors, from the spans without a per-token array
    oldest, newest = bounds
    current = _check_int(current_version, "current_version")
    _check_not_newer(newest, current)
    return current - oldest


def _span_bounds(versions: Any) -> tuple[int, int] | None:
    """(oldest, newest) version of the tokens of contiguous spans with int fields (the
    sampler's), None for anything else (the general path checks and expands it)."""
    if type(versions) is not tuple and type(versions) is not list:
        return None
    oldest = newest = None
    total = 0
    for span in versions:
        if type(span) is not VersionSpan:
            return None
        start, length, version = span.start, span.length, span.version
        if type(start) is not int or type(length) is not int or type(version) is not int:
            return None
        if start != total or length < 0:
            return None  # the general path raises its error
        total += length
        if length:
            if oldest is None or version < oldest:
                oldest = version
            if newest is None or version > newest:
                newest = version
    if oldest is None or newest is None:
        return None  # spans of no tokens: the general path's answer
    return oldest, newest


def drop_stale(
    rollouts: Iterable[Rollout], current_version: int, max_staleness: int
) -> tuple[list[Rollout], int]:
    """Keep rollouts whose staleness is ``<= max_staleness``; return them and how many were dropped."""
    bound = _check_int(max_staleness, "max_staleness")
    kept: list[Rollout] = []
    dropped = 0
    for rollout in rollouts:
        if rollout_staleness(rollout, current_version) <= bound:
            kept.append(rollout)
        else:
            dropped += 1
    return kept, dropped


def staleness_histogram(
    rollouts: Iterable[Rollout], current_version: int, *, per_token: bool = False
) -> dict[int, int]:
    """Staleness -> count, sorted by staleness; counts rollouts, or completion tokens with ``per_token``."""
    counts: Counter[int] = Counter()
    for rollout in rollouts:
        if per_token:
            if rollout.completion_tokens and not rollout.versions:
                rollout_staleness(rollout, current_version)  # raises the same error
            counts.update(int(s) for s in token_staleness(rollout.versions, current_version))
        else:
            counts[rollout_staleness(rollout, current_version)] += 1
    return dict(sorted(counts.items()))
