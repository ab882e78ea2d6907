"""Agent episodes: an environment, the turns of one episode, and its training rollout.

An episode alternates the environment's observations and the model's turns:

    obs_0  act_0  obs_1  act_1  ...  act_n

``obs_0`` is the environment's first observation (the prompt); after each of
the model's turns the environment answers (``Env.step``) with a reward, whether
the episode is done and, if not, the next observation. A tool call is such a
turn: the model writes the call, the environment runs the tool and its output
is the next observation.

The history is never re-tokenised: turn k's prompt is exactly the tokens before
``act_k`` above, so the training datum of an episode is that one sequence, with
the model's tokens trained on (mask 1, the sampler's logprobs and versions) and
every observation token at weight 0. One datum per episode, not one per turn:
the per-turn datums would repeat the shared history in every turn's forward
pass (quadratic in the turns), while the single masked sequence computes each
token once and is the exact sequence the sampler saw. (Per-turn datums are
needed only when the history is rewritten between turns, e.g. a reasoning
trace dropped from later prompts; treadle's episodes keep the history as is.)
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from treadle.errors import InvalidArgumentError
from treadle.rl.datums import Rollout
from treadle.types import SamplingParams


@dataclass(frozen=True)
class StepResult:
    """The environment's answer to one of the model's turns.

    ``observation`` is what the model sees next (a tool's output, the user's
    reply); ignored when ``done``. ``reward`` is this turn's; an episode's
    reward is the sum over its turns. The names follow tinker-cookbook's
    ``StepResult`` (``reward``, ``episode_done``, ``next_observation``) in short.
    """

    reward: float
    done: bool
    observation: Sequence[int] = ()
    metrics: Mapping[str, float] = field(default_factory=dict)


@runtime_checkable
class Env(Protocol):
    """One episode's environment. Either method may be ``async def`` (awaited on
    the episode runner's event loop) or a plain function (run on a bounded thread
    pool, so a blocking tool holds one thread and only its own episode waits).

    * ``initial_observation()`` -> the first observation's tokens (non-empty).
    * ``step(action)`` -> :class:`StepResult`, ``action`` being the tokens of
      the model's turn.

    An environment may also have a ``stop`` attribute (stop strings and/or stop
    token ids): when set, it replaces the sampling params' ``stop`` for its
    next turn (tinker-cookbook's stop condition, ``treadle.rl.cookbook``).
    """

    def initial_observation(self) -> Sequence[int] | Awaitable[Sequence[int]]: ...

    def step(self, action: list[int]) -> StepResult | Awaitable[StepResult]: ...


@dataclass(frozen=True)
class EnvGroup:
    """The G episodes whose rewards are compared (GRPO's group): fresh
    environments for the same task. ``task`` is for the caller's bookkeeping;
    ``sampling_params`` override the loop's for these episodes."""

    envs: Sequence[Env]
    task: Any = None
    sampling_params: SamplingParams | None = None


@dataclass(frozen=True)
class EpisodeLimits:
    """Token limits of an episode, checked before each turn is sampled.

    * ``max_turn_tokens``: the most tokens one turn may sample (``None``: the
      sampling params' ``max_tokens``);
    * ``max_episode_tokens``: the most model tokens over all turns; an episode
      that reaches it ends ``truncated="max_episode_tokens"``;
    * ``max_turns``: the most model turns (``truncated="max_turns"``);
    * ``context_limit``: the most tokens the whole history may hold (``None``:
      the base model's ``max_context`` from ``GetServerInfo``). A turn samples
      at most the room left, so the model's tokens never overflow it; an
      observation that leaves no room ends its episode with an error.
    """

    max_turn_tokens: int | None = None
    max_episode_tokens: int | None = None
    max_turns: int | None = None
    context_limit: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_turn_tokens", "max_episode_tokens", "max_turns", "context_limit"):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value < 1
            ):
                raise InvalidArgumentError(f"limits.{name}: must be an integer >= 1, got {value!r}")


@dataclass(frozen=True)
class EpisodeTurn:
    """One of the model's turns and the observation it answered.

    ``versions`` has one weight version per token of ``tokens``: in an
    episode that spans a ``sync_weights``, each turn says which weights wrote
    it (and a turn sampled during an in-flight update, which wrote which token).
    """

    observation: tuple[int, ...]  # what the environment said before this turn
    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]
    versions: tuple[int, ...]
    stop_reason: str
    reward: float
    metrics: Mapping[str, float] = field(default_factory=dict)


@dataclass
class Episode:
    """What one episode did. ``error`` is set when it ended on bad input (its
    message names the episode and the field) or a raising tool; such an episode
    is not trained on. ``truncated`` names the limit that ended it early."""

    episode_id: str
    turns: list[EpisodeTurn] = field(default_factory=list)
    done: bool = False
    truncated: str | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.turns)

    @property
    def reward(self) -> float:
        return float(sum(t.reward for t in self.turns))

    @property
    def model_tokens(self) -> int:
        return sum(len(t.tokens) for t in self.turns)

    def tokens(self) -> list[int]:
        """The whole history: every observation and turn, in order."""
        out: list[int] = []
        for t in self.turns:
            out += [*t.observation, *t.tokens]
        return out

    def to_rollout(self) -> Rollout:
        """The episode as one masked rollout: the first observation is the prompt,
        the rest is the completion, the model's tokens with mask 1 and their
        sampler logprobs, observations with mask 0 (and logprob 0). An observation
        token carries the version of the turn it answered (it does not change
        the rollout's staleness, which is its oldest model token's)."""
        if not self.ok:
            raise InvalidArgumentError(
                f"{self.episode_id}: "
                + (self.error or "has no turns: nothing to train on")
                + " (a failed episode is not trained on)"
            )
        first = self.turns[0]
        completion: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        mask: list[float] = []
        for k, t in enumerate(self.turns):
            if k:
                completion += t.observation
                logprobs += [0.0] * len(t.observation)
                versions += [self.turns[k - 1].versions[-1]] * len(t.observation)
                mask += [0.0] * len(t.observation)
            completion += t.tokens
            logprobs += t.logprobs
            versions += t.versions
            mask += [1.0] * len(t.tokens)
        return Rollout(
            prompt_tokens=first.observation,
            completion_tokens=completion,
            completion_logprobs=logprobs,
            reward=self.reward,
            versions=versions,
            mask=mask,
        )


class EpisodeError(InvalidArgumentError):
    """Bad input from an environment, or a tool that raised: it ends one episode.

    The message starts with the episode's id and names the field."""


def check_reward(value: Any, where: str) -> float:
    try:
        reward = float(value)
    except (TypeError, ValueError):
        raise EpisodeError(f"{where}: {value!r} is not a number") from None
    if not math.isfinite(reward):
        raise EpisodeError(f"{where}: {reward} is not a finite number")
    return reward


def check_tokens(value: Any, where: str, vocab_size: int | None) -> tuple[int, ...]:
    try:
        tokens = tuple(int(t) for t in value)
    except (TypeError, ValueError):
        raise EpisodeError(f"{where}: must be a sequence of token ids, got {value!r:.80}") from None
    if vocab_size is not None:
        bad = [t for t in tokens if not 0 <= t < vocab_size]
        if bad:
            raise EpisodeError(
                f"{where}: token id {bad[0]} is outside the model's vocabulary [0, {vocab_size})"
            )
    return tokens
