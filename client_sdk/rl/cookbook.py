"""tinker-cookbook environments in treadle's episode loops: a thin adapter.

A cookbook ``Env`` differs from a treadle one in three small ways, each handled
here: ``initial_observation()`` returns ``(ModelInput, stop_condition)`` (or an
``InitialObservationOverflow``); ``step`` returns the cookbook's ``StepResult``
(``reward``, ``episode_done``, ``next_observation``, ``next_stop_condition``,
``metrics``); and the stop condition (the renderer's stop sequences) changes the
sampling of the next turn. An ``EnvGroupBuilder`` gives a group's environments
from ``async make_envs()``. Nothing here imports tinker or the cookbook: the
adapter reads those names, so it runs wherever the cookbook is installed.

Not carried over: ``EnvGroupBuilder.compute_group_rewards`` (a reward that
compares a group's trajectories; the cookbook's built-in builders return 0) and
``logging_tags``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Iterator
from typing import Any

from treadle.rl.episodes import EnvGroup, EpisodeError, StepResult


class CookbookEnv:
    """One cookbook ``Env`` as a treadle environment. ``stop`` is the stop
    condition the cookbook asked for the next turn (the episode runner reads it
    before each sample)."""

    def __init__(self, env: Any) -> None:
        self.env = env
        self.stop: Any = None

    async def initial_observation(self) -> Any:
        out = await self.env.initial_observation()
        if not isinstance(out, tuple):  # InitialObservationOverflow
            raise EpisodeError(
                f"initial_observation: the environment reported that its prompt overflows "
                f"({type(out).__name__}, reward {getattr(out, 'reward', None)!r})"
            )
        observation, self.stop = out
        return observation

    async def step(self, action: list[int]) -> StepResult:
        result = await self.env.step(action)
        self.stop = getattr(result, "next_stop_condition", self.stop)
        done = bool(result.episode_done)
        return StepResult(
            reward=result.reward,
            done=done,
            observation=() if done else result.next_observation.to_ints(),
            metrics={k: float(v) for k, v in (getattr(result, "metrics", None) or {}).items()},
        )


def cookbook_groups(builders: Iterable[Any]) -> Iterator[EnvGroup]:
    """An ``EnvGroup`` per cookbook ``EnvGroupBuilder``, its environments made
    (``make_envs`` awaited) as the loop asks for the group."""
    for builder in builders:
        envs = asyncio.run(builder.make_envs())
        yield EnvGroup([CookbookEnv(e) for e in envs], task=builder)
