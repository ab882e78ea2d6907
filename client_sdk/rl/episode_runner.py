"""Running episodes: many at once, each turn sampled as soon as its observation is ready.

An :class:`EpisodeRunner` owns one asyncio event loop on a thread of its own and
a bounded thread pool. Every episode is a coroutine on that loop: it samples a
turn (the request is on the wire at once; the server batches it with every
other episode's), then calls the environment. An ``async def`` environment is
awaited on the loop; a blocking one runs on the pool, so a slow tool holds one
pool thread and only its own episode waits. The loops in
``treadle.rl.episode_loops`` submit groups here and wait on the futures.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from treadle.errors import InvalidArgumentError
from treadle.rl.episodes import (
    EnvGroup,
    Episode,
    EpisodeError,
    EpisodeLimits,
    EpisodeTurn,
    StepResult,
    check_reward,
    check_tokens,
)
from treadle.types import SamplingParams

if TYPE_CHECKING:
    from treadle.sampling_client import SamplingClient

log = logging.getLogger("treadle.rl")


class EpisodeRunner:
    """Runs episode groups on a background event loop; ``close()`` (or ``with``) stops it.

    ``tool_threads`` bounds the blocking environment calls that run at once
    (the rest queue for a thread); ``context_limit`` and ``vocab_size`` are the
    model's, checked on every observation."""

    def __init__(
        self,
        *,
        context_limit: int,
        vocab_size: int | None = None,
        tool_threads: int = 16,
    ) -> None:
        if tool_threads < 1:
            raise InvalidArgumentError(f"tool_threads: must be >= 1, got {tool_threads}")
        self.context_limit = context_limit
        self.vocab_size = vocab_size
        self._loop = asyncio.new_event_loop()
        self._pool = ThreadPoolExecutor(tool_threads, thread_name_prefix="treadle-tool")
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="treadle-episodes", daemon=True
        )
        self._thread.start()

    def submit(
        self,
        sampler: SamplingClient,
        group: EnvGroup,
        group_id: str,
        params: SamplingParams,
        limits: EpisodeLimits,
    ) -> Future[list[Episode]]:
        """Start the group's episodes now; the future gives them, in ``group.envs`` order."""
        params = group.sampling_params or params
        coro = self._group(sampler, group, group_id, params, limits)
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    async def _group(
        self,
        sampler: SamplingClient,
        group: EnvGroup,
        group_id: str,
        params: SamplingParams,
        limits: EpisodeLimits,
    ) -> list[Episode]:
        return list(
            await asyncio.gather(
                *(
                    self._episode(sampler, env, f"episode {group_id}.{i}", params, limits)
                    for i, env in enumerate(group.envs)
                )
            )
        )

    async def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        if inspect.iscoroutinefunction(fn):
            return await fn(*args)
        out = await self._loop.run_in_executor(self._pool, fn, *args)
        if inspect.isawaitable(out):
            out = await out
        return out

    async def _episode(
        self,
        sampler: SamplingClient,
        env: Any,
        episode_id: str,
        params: SamplingParams,
        limits: EpisodeLimits,
    ) -> Episode:
        episode = Episode(episode_id)
        try:
            await self._turns(sampler, env, episode, params, limits)
        except EpisodeError as err:
            episode.error = f"{episode_id}: {err.message}"
        except InvalidArgumentError as err:  # the server refused this episode's request
            episode.error = f"{episode_id}: turns[{len(episode.turns)}] sample: {err.message}"
        if episode.error:
            log.warning("%s", episode.error)
        return episode

    async def _turns(
        self,
        sampler: SamplingClient,
        env: Any,
        episode: Episode,
        params: SamplingParams,
        limits: EpisodeLimits,
    ) -> None:
        context = min(limits.context_limit or self.context_limit, self.context_limit)
        turn_cap = limits.max_turn_tokens or params.max_tokens
        try:
            first = await self._call(env.initial_observation)
        except Exception as err:
            raise EpisodeError(f"initial_observation raised {err!r}") from err
        observation = check_tokens(_tokens_of(first), "initial_observation", self.vocab_size)
        if not observation:
            raise EpisodeError(
                "initial_observation: empty; the first turn needs at least one token (e.g. BOS)"
            )
        history: list[int] = list(observation)
        where = "initial_observation"
        while True:
            k = len(episode.turns)
            if len(history) >= context:
                raise EpisodeError(
                    f"{where}: brings the history to {len(history)} tokens, at or past the "
                    f"context limit {context}: no room for turns[{k}]"
                )
            if limits.max_turns is not None and k >= limits.max_turns:
                episode.truncated = "max_turns"
                return
            budget = min(turn_cap, context - len(history))
            if limits.max_episode_tokens is not None:
                budget = min(budget, limits.max_episode_tokens - episode.model_tokens)
                if budget <= 0:
                    episode.truncated = "max_episode_tokens"
                    return
            stop = getattr(env, "stop", None)  # the environment's stop condition, if it has one
            # the sampler keeps this turn's KV for the next one, unless no next turn can come
            last = (limits.max_turns is not None and k + 1 >= limits.max_turns) or (
                len(history) + budget >= context
            )
            turn_params = dataclasses.replace(
                params,
                max_tokens=budget,
                cache_completion=not last,
                **({"stop": list(stop)} if stop else {}),
            )
            response = await sampler.sample(history, 1, turn_params)
            seq = response.sequences[0]
            if not seq.tokens:
                raise EpisodeError(
                    f"turns[{k}].tokens: the sampler returned no tokens (max_tokens {budget}); "
                    "a turn must sample at least one"
                )
            versions = tuple(seq.token_versions())
            if len(versions) != len(seq.tokens):
                raise EpisodeError(
                    f"turns[{k}].versions: {len(versions)} versions for {len(seq.tokens)} tokens"
                )
            try:
                result = await self._call(env.step, list(seq.tokens))
            except Exception as err:
                raise EpisodeError(f"turns[{k}] step: the environment raised {err!r}") from err
            if not isinstance(result, StepResult):
                result = _step_result_of(result, k)
            reward = check_reward(result.reward, f"turns[{k}].reward")
            episode.turns.append(
                EpisodeTurn(
                    observation=observation,
                    tokens=tuple(seq.tokens),
                    logprobs=tuple(seq.logprobs),
                    versions=versions,
                    stop_reason=seq.stop_reason,
                    reward=reward,
                    metrics=dict(result.metrics),
                )
            )
            history += seq.tokens
            if result.done:
                episode.done = True
                return
            where = f"turns[{k}].observation"
            observation = check_tokens(_tokens_of(result.observation), where, self.vocab_size)
            history += observation

    def close(self) -> None:
        """Stop the loop (episodes still running are cancelled) and the tool pool."""
        if self._loop.is_closed():
            return

        async def cancel_all() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(cancel_all(), self._loop).result(30.0)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(30.0)
        self._loop.close()
        self._pool.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> EpisodeRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _tokens_of(observation: Any) -> Sequence[int]:
    """Token ids from a list of ints or anything with ``to_ints()`` / ``.tokens``
    (treadle's and tinker's ``ModelInput``)."""
    if hasattr(observation, "to_ints"):
        return list(observation.to_ints())
    if hasattr(observation, "tokens") and not isinstance(observation, (list, tuple)):
        return list(observation.tokens)
    return list(observation)


def _step_result_of(result: Any, k: int) -> StepResult:
    """A tinker-cookbook-shaped result (``reward``, ``episode_done``,
    ``next_observation``) as a :class:`StepResult`."""
    try:
        return StepResult(
            reward=result.reward,
            done=bool(result.episode_done),
            observation=_tokens_of(result.next_observation) if not result.episode_done else (),
            metrics=dict(getattr(result, "metrics", {}) or {}),
        )
    except AttributeError:
        raise EpisodeError(
            f"turns[{k}] step: returned {type(result).__name__}, expected a StepResult"
        ) from None
