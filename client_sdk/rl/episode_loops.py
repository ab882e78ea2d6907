"""The async-RL ladder over agent episodes: the loops of ``treadle.rl.loops``,
with environment groups where they have prompts.

Each loop takes an iterator of :class:`~treadle.rl.episodes.EnvGroup` (G fresh
environments per group; advantages are relative within a group) instead of
prompts and a reward function: the environment gives the rewards. Every
episode of a batch runs at once on an :class:`EpisodeRunner`, each turn's
sample sent as soon as its observation is ready; a slow tool holds only its
own episode. An episode is trained on as one masked rollout
(``Episode.to_rollout``: observations at weight 0); a failed episode (bad
input, a raising tool) is left out of its group and counted in
``StepStats.failed_episodes``, the others go on.

Staleness is per episode: its oldest model token's version. An episode that
spans a ``sync_weights`` (in ``async_episode_loop``, on a ``latest`` sampler)
samples its later turns with the newer weights, and every token keeps the
version that wrote it. ``max_staleness`` and ``on_stale`` apply per episode
group as they apply per sample group in ``async_loop``.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

from treadle.errors import InvalidArgumentError
from treadle.rl.episode_runner import EpisodeRunner
from treadle.rl.episodes import EnvGroup, Episode, EpisodeLimits
from treadle.rl.loops import (
    Launch,
    PendingGroup,
    _check_common,
    _check_sampling,
    check_async,
    run_async,
    run_one_step_stale,
    run_sync,
)
from treadle.rl.train_step import Group, Prompt, StepStats, TrainStep
from treadle.types import SamplingParams

if TYPE_CHECKING:
    from treadle.sampling_client import SamplingClient
    from treadle.training_client import TrainingClient


def _runner(trainer: TrainingClient, limits: EpisodeLimits, tool_threads: int) -> EpisodeRunner:
    base = [
        b for b in trainer._service.get_server_info().base_models if b.name == trainer.base_model
    ]
    context = base[0].max_context if base else (limits.context_limit or 0)
    if limits.context_limit is not None:
        context = min(context, limits.context_limit) if context else limits.context_limit
    if not context:
        raise InvalidArgumentError(
            "limits.context_limit: the server does not report this model's context; set it"
        )
    return EpisodeRunner(
        context_limit=context,
        vocab_size=base[0].vocab_size if base else None,
        tool_threads=tool_threads,
    )


def _episode_launch(
    runner: EpisodeRunner, params: SamplingParams, limits: EpisodeLimits, timeout: float
) -> Launch:
    counter = itertools.count()

    def launch(sampler: SamplingClient, group: EnvGroup) -> PendingGroup:
        if not isinstance(group, EnvGroup):
            raise InvalidArgumentError(
                f"env_groups: yields EnvGroup(envs=[...]), got {type(group).__name__}"
            )
        if not group.envs:
            raise InvalidArgumentError("env_groups: a group has no environments")
        _check_sampling(group.sampling_params, "env_group.sampling_params")
        fut = runner.submit(sampler, group, str(next(counter)), params, limits)

        def to_group(timeout: float) -> Group:
            episodes = fut.result(timeout)
            return Group(
                Prompt(tokens=(), task=group.task),
                [e.to_rollout() for e in episodes if e.ok],
                episodes=episodes,
            )

        return PendingGroup(fut, to_group)

    return launch


def _setup(
    trainer: TrainingClient,
    steps: int,
    groups_per_step: int,
    sampling_params: SamplingParams | None,
    limits: EpisodeLimits | None,
    tool_threads: int,
    timeout: float,
) -> tuple[EpisodeRunner, Launch]:
    _check_common(groups_per_step, 1, steps, timeout)
    _check_sampling(sampling_params, "sampling_params")
    limits = limits or EpisodeLimits()
    runner = _runner(trainer, limits, tool_threads)
    return runner, _episode_launch(runner, sampling_params or SamplingParams(), limits, timeout)


def _closing(runner: EpisodeRunner, stats: Iterator[StepStats]) -> Iterator[StepStats]:
    try:
        yield from stats
    finally:
        close = getattr(stats, "close", None)
        if close is not None:
            close()  # the inner loop's own cleanup (rung 3 waits for its requests) first
        runner.close()


def sync_episode_loop(
    trainer: TrainingClient,
    env_groups: Iterable[EnvGroup],
    *,
    steps: int,
    groups_per_step: int,
    sampling_params: SamplingParams | None = None,
    limits: EpisodeLimits | None = None,
    train_step: TrainStep | None = None,
    tool_threads: int = 16,
    timeout: float = 300.0,
) -> Iterator[StepStats]:
    """Rung 0 over episodes: run a batch of episode groups on the current
    weights (all at once), train on it, sync, repeat. ``timeout`` bounds the
    wait for each group (all its turns and tool calls)."""
    runner, launch = _setup(
        trainer, steps, groups_per_step, sampling_params, limits, tool_threads, timeout
    )
    return _closing(
        runner, run_sync(trainer, env_groups, launch, steps, groups_per_step, train_step, timeout)
    )


def one_step_stale_episode_loop(
    trainer: TrainingClient,
    env_groups: Iterable[EnvGroup],
    *,
    steps: int,
    groups_per_step: int,
    sampling_params: SamplingParams | None = None,
    limits: EpisodeLimits | None = None,
    train_step: TrainStep | None = None,
    tool_threads: int = 16,
    timeout: float = 300.0,
) -> Iterator[StepStats]:
    """Rung 2 over episodes: batch k+1's episodes run (on the weights before
    step k) while the trainer trains on batch k's."""
    runner, launch = _setup(
        trainer, steps, groups_per_step, sampling_params, limits, tool_threads, timeout
    )
    return _closing(
        runner,
        run_one_step_stale(
            trainer, env_groups, launch, steps, groups_per_step, train_step, timeout
        ),
    )


def async_episode_loop(
    trainer: TrainingClient,
    sampler: SamplingClient,
    env_groups: Iterable[EnvGroup],
    *,
    steps: int,
    groups_per_step: int,
    buffer_groups: int,
    max_staleness: int,
    sync_every: int = 1,
    inflight: bool = False,
    on_stale: str = "drop",
    sampling_params: SamplingParams | None = None,
    limits: EpisodeLimits | None = None,
    train_step: TrainStep | None = None,
    tool_threads: int = 16,
    timeout: float = 300.0,
) -> Iterator[StepStats]:
    """Rung 3 over episodes: episode groups run continuously on a ``latest``
    sampler, at most ``buffer_groups`` in flight or finished-and-waiting; the
    trainer takes finished groups, each as stale as its oldest model token.
    A turn sampled after a sync uses the new weights (and, with ``inflight``,
    a turn sampling during one switches mid-turn): the versions per token say
    which. Groups past ``max_staleness`` are dropped, or waited for
    (``on_stale="wait"``), exactly as in :func:`~treadle.rl.async_loop`."""
    check_async(
        trainer,
        sampler,
        max_staleness=max_staleness,
        sync_every=sync_every,
        buffer_groups=buffer_groups,
        on_stale=on_stale,
        name="async_episode_loop",
    )
    runner, launch = _setup(
        trainer, steps, groups_per_step, sampling_params, limits, tool_threads, timeout
    )
    stats = run_async(
        trainer,
        sampler,
        env_groups,
        launch,
        steps=steps,
        groups_per_step=groups_per_step,
        buffer_groups=buffer_groups,
        max_staleness=max_staleness,
        sync_every=sync_every,
        inflight=inflight,
        on_stale=on_stale,
        train_step=train_step,
        timeout=timeout,
    )
    return _closing(runner, stats)


def run_episodes(
    sampler: SamplingClient,
    env_groups: Iterable[EnvGroup],
    *,
    context_limit: int,
    vocab_size: int | None = None,
    sampling_params: SamplingParams | None = None,
    limits: EpisodeLimits | None = None,
    tool_threads: int = 16,
    timeout: float = 300.0,
) -> list[list[Episode]]:
    """Run some episode groups once, all at once, with no training: an
    evaluation, or a custom loop's rollout phase. Returns each group's
    :class:`~treadle.rl.episodes.Episode` list, in order."""
    _check_sampling(sampling_params, "sampling_params")
    with EpisodeRunner(
        context_limit=context_limit, vocab_size=vocab_size, tool_threads=tool_threads
    ) as runner:
        futures = [
            runner.submit(
                sampler, g, str(i), sampling_params or SamplingParams(), limits or EpisodeLimits()
            )
            for i, g in enumerate(env_groups)
        ]
        return [f.result(timeout) for f in futures]
