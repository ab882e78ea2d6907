"""Agent episodes (treadle.rl episodes) against the embedded engine, tiny model.

Environments here are small and deterministic: each turn's reward and the
observation they answer are functions of the model's tokens, so a group's
episodes disagree and a step trains. Every wait has a timeout; the ordering
tests use events, never the clock.
"""

from __future__ import annotations

import asyncio
import math
import threading
from collections.abc import Iterator
from typing import Any

import pytest

import treadle
from treadle.rl import (
    EnvGroup,
    EpisodeLimits,
    EpisodeRunner,
    StepResult,
    async_episode_loop,
    grpo_train_step,
    one_step_stale_episode_loop,
    run_episodes,
    sync_episode_loop,
)

PARAMS = treadle.SamplingParams(max_tokens=3, temperature=1.0)
TIMEOUT = 60.0
TURN = 300  # tokens a turn decodes while an in-flight update lands


class CountingEnv:
    """``turns`` model turns; each is answered with ``[7, 8]``; reward on the last
    turn is the parity of the model's tokens (noise, but varied within a group)."""

    def __init__(self, turns: int = 2) -> None:
        self.turns = turns
        self.k = 0

    def initial_observation(self) -> list[int]:
        return [1, 5, 9]

    def step(self, action: list[int]) -> StepResult:
        self.k += 1
        if self.k == self.turns:
            return StepResult(reward=float(sum(action) % 2), done=True)
        return StepResult(reward=0.0, done=False, observation=[7, 8])


class AsyncCountingEnv(CountingEnv):
    async def step(self, action: list[int]) -> StepResult:  # type: ignore[override]
        await asyncio.sleep(0)
        return CountingEnv.step(self, action)


class RaisingEnv(CountingEnv):
    def step(self, action: list[int]) -> StepResult:
        if self.k == 1:
            raise RuntimeError("calculator crashed")
        return super().step(action)


class NanRewardEnv(CountingEnv):
    def step(self, action: list[int]) -> StepResult:
        return StepResult(reward=math.nan, done=True)


class EmptyEnv(CountingEnv):
    def initial_observation(self) -> list[int]:
        return []


class LongObservationEnv(CountingEnv):
    def step(self, action: list[int]) -> StepResult:
        return StepResult(reward=0.0, done=False, observation=[7] * 100)


class OutOfVocabularyEnv(CountingEnv):
    def step(self, action: list[int]) -> StepResult:
        return StepResult(reward=0.0, done=False, observation=[7, 70_000])


def groups(make: Any = CountingEnv, size: int = 4) -> Iterator[EnvGroup]:
    i = 0
    while True:
        yield EnvGroup([make() for _ in range(size)], task=i)
        i += 1


@pytest.fixture(scope="module")
def trainer(service: treadle.ServiceClient) -> treadle.TrainingClient:
    return service.create_lora_training_client("tiny", rank=4, seed=0)


def test_sync_and_one_step_stale_episode_loops_train(trainer: treadle.TrainingClient) -> None:
    step = grpo_train_step(adam=treadle.AdamParams(learning_rate=1e-3))
    kw: dict[str, Any] = dict(
        steps=2, groups_per_step=2, sampling_params=PARAMS, train_step=step, timeout=TIMEOUT
    )
    for loop in (sync_episode_loop, one_step_stale_episode_loop):
        v0 = trainer.get_info().version
        stats = list(loop(trainer, groups(), **kw))
        assert [s.step for s in stats] == [1, 2]
        assert all(s.rollouts == 8 and s.failed_episodes == 0 for s in stats)
        # trained tokens are the model's only: 2 turns of 1..3 tokens per episode
        assert all(16 <= s.trained_tokens <= 48 for s in stats)
        assert stats[-1].version >= v0
        if loop is sync_episode_loop:
            assert all(s.staleness == {0: 8} for s in stats)  # on-policy


def test_bad_episodes_end_alone_with_a_clear_error(trainer: treadle.TrainingClient) -> None:
    mixed = [
        CountingEnv(),
        RaisingEnv(),
        NanRewardEnv(),
        EmptyEnv(),
        LongObservationEnv(),
        AsyncCountingEnv(),
        OutOfVocabularyEnv(),
    ]
    sampler = trainer.sync_weights()
    info = trainer._service.get_server_info().base_models[0]
    (episodes,) = run_episodes(
        sampler,
        [EnvGroup(mixed)],
        context_limit=info.max_context,
        vocab_size=info.vocab_size,
        sampling_params=PARAMS,
        limits=EpisodeLimits(context_limit=60),
        timeout=TIMEOUT,
    )
    errors = [e.error for e in episodes]
    assert errors[0] is None and episodes[0].done and len(episodes[0].turns) == 2
    assert errors[5] is None and episodes[5].done
    assert errors[1] is not None and errors[1].startswith("episode 0.1: turns[1] step: ")
    assert "calculator crashed" in errors[1]
    assert errors[2] == "episode 0.2: turns[0].reward: nan is not a finite number"
    assert errors[3] is not None and errors[3].startswith("episode 0.3: initial_observation: empty")
    assert errors[4] is not None and errors[4].startswith("episode 0.4: turns[0].observation: ")
    assert "context limit 60" in errors[4]
    assert errors[6] is not None and errors[6].startswith(
        "episode 0.6: turns[0].observation: token id 70000 is outside the model's vocabulary"
    )
    # the raising tool's episode kept the turn before it
    assert len(episodes[1].turns) == 1


def test_a_failed_episode_is_left_out_and_the_loop_goes_on(
    trainer: treadle.TrainingClient,
) -> None:
    def make_groups() -> Iterator[EnvGroup]:
        while True:
            yield EnvGroup([CountingEnv(), CountingEnv(), RaisingEnv(), CountingEnv()])

    stats = list(
        sync_episode_loop(
            trainer,
            make_groups(),
            steps=1,
            groups_per_step=2,
            sampling_params=PARAMS,
            timeout=TIMEOUT,
        )
    )
    assert stats[0].failed_episodes == 2 and stats[0].rollouts == 6


def test_a_slow_tool_blocks_only_its_own_episode(trainer: treadle.TrainingClient) -> None:
    """The slow episode's tool (blocking, then async) waits until the fast
    episodes have finished all their turns: if it held them up, this deadlocks
    and times out."""
    sampler = trainer.sync_weights()
    fast_done = threading.Event()
    finished = [0]
    lock = threading.Lock()

    class Fast(CountingEnv):
        def step(self, action: list[int]) -> StepResult:
            out = super().step(action)
            if out.done:
                with lock:
                    finished[0] += 1
                    if finished[0] == 2:
                        fast_done.set()
            return out

    class SlowBlocking(CountingEnv):
        def step(self, action: list[int]) -> StepResult:
            assert fast_done.wait(TIMEOUT), "the fast episodes waited for the slow tool"
            return super().step(action)

    class SlowAsync(CountingEnv):
        async def step(self, action: list[int]) -> StepResult:  # type: ignore[override]
            while not fast_done.is_set():
                await asyncio.sleep(0.01)
            return CountingEnv.step(self, action)

    with EpisodeRunner(context_limit=2048, tool_threads=2) as runner:
        group = EnvGroup([SlowBlocking(), SlowAsync(), Fast(3), Fast(3)])
        episodes = runner.submit(sampler, group, "0", PARAMS, EpisodeLimits()).result(TIMEOUT)
    assert [e.error for e in episodes] == [None] * 4
    assert [len(e.turns) for e in episodes] == [2, 2, 3, 3]


def test_an_episode_resumed_after_a_weight_update_has_the_right_versions(
    service: treadle.ServiceClient, trainer: treadle.TrainingClient
) -> None:
    """Turn 0 samples on version v; the tool holds the episode while the trainer
    steps and syncs; turn 1, sampled on the `latest` sampler, is version v + 1,
    and the episode's rollout says so token by token."""
    trainer.sync_weights().sampler_id  # noqa: B018 - a version to follow
    latest = service.create_sampling_client(weights=f"treadle://{trainer.model_id}/latest")
    v = trainer.get_info().version
    at_tool, resume = threading.Event(), threading.Event()

    class Held(CountingEnv):
        def step(self, action: list[int]) -> StepResult:
            if self.k == 0:
                at_tool.set()
                assert resume.wait(TIMEOUT)
            return super().step(action)

    with EpisodeRunner(context_limit=2048) as runner:
        fut = runner.submit(latest, EnvGroup([Held()]), "0", PARAMS, EpisodeLimits())
        assert at_tool.wait(TIMEOUT)
        datum = treadle.Datum(
            model_input=treadle.ModelInput.from_ints([1, 5, 9]),
            loss_fn_inputs={"target_tokens": [5, 9, 2], "weights": [1.0, 1.0, 1.0]},
        )
        trainer.forward_backward([datum], "cross_entropy").result(TIMEOUT)
        trainer.optim_step(treadle.AdamParams(learning_rate=1e-3)).result(TIMEOUT)
        trainer.sync_weights().sampler_id  # noqa: B018 - lands before turn 1 is sent
        resume.set()
        (episode,) = fut.result(TIMEOUT)
    assert episode.error is None and len(episode.turns) == 2
    t0, t1 = episode.turns
    assert t0.versions == (v,) * len(t0.tokens)
    assert t1.versions == (v + 1,) * len(t1.tokens)
    rollout = episode.to_rollout()
    assert rollout.token_versions() == [v] * (len(t0.tokens) + 2) + [v + 1] * len(t1.tokens)


@pytest.mark.parametrize("on_stale", ["drop", "wait"])
def test_async_episode_loop_bounds_staleness_per_episode(
    service: treadle.ServiceClient, trainer: treadle.TrainingClient, on_stale: str
) -> None:
    trainer.sync_weights().sampler_id  # noqa: B018
    latest = service.create_sampling_client(weights=f"treadle://{trainer.model_id}/latest")
    stats = list(
        async_episode_loop(
            trainer,
            latest,
            groups(AsyncCountingEnv, size=4),
            steps=3,
            groups_per_step=2,
            buffer_groups=3,
            max_staleness=1,
            on_stale=on_stale,
            sampling_params=PARAMS,
            timeout=TIMEOUT,
        )
    )
    assert [s.step for s in stats] == [1, 2, 3]
    for s in stats:
        assert max(s.staleness) <= 1 and s.failed_episodes == 0
        assert s.rollouts == 8


def test_an_environment_may_answer_with_model_inputs_and_cookbook_names(
    trainer: treadle.TrainingClient,
) -> None:
    """Observations with ``to_ints()`` and results named ``reward`` /
    ``episode_done`` / ``next_observation`` (tinker-cookbook's names) are read."""

    class Result:
        def __init__(self, reward: float, episode_done: bool, next_observation: Any) -> None:
            self.reward, self.episode_done = reward, episode_done
            self.next_observation = next_observation

    class NamedEnv:
        def __init__(self) -> None:
            self.k = 0

        async def initial_observation(self) -> treadle.ModelInput:
            return treadle.ModelInput.from_ints([1, 5, 9])

        async def step(self, action: list[int]) -> Result:
            self.k += 1
            return Result(0.5, self.k == 2, treadle.ModelInput.from_ints([7, 8]))

    (episodes,) = run_episodes(
        trainer.sync_weights(),
        [EnvGroup([NamedEnv()])],
        context_limit=2048,
        sampling_params=PARAMS,
        timeout=TIMEOUT,
    )
    (episode,) = episodes
    assert episode.error is None and episode.done and episode.reward == 1.0
    assert episode.turns[0].observation == (1, 5, 9)
    assert episode.turns[1].observation == (7, 8)


def _sampler_counters(service: treadle.ServiceClient) -> tuple[int, int, int]:
    """(prompt tokens computed, reused, rows decoding) over the tiny base's samplers."""
    ms = [m for m in service.get_server_info().sampler_metrics if m.base_model == "tiny"]
    return (
        sum(m.prompt_tokens for m in ms),
        sum(m.prefix_reused_tokens for m in ms),
        sum(m.running_rows for m in ms),
    )


def _counted(service: treadle.ServiceClient, positions: int) -> tuple[int, int]:
    """(computed, reused) once the published stats count ``positions`` prompt
    positions in all: the sampler publishes them just after the step that
    answered the request, so a read right after a result may miss its last turn."""
    for _ in range(int(TIMEOUT / 0.01)):
        computed, reused, _ = _sampler_counters(service)
        if computed + reused >= positions:
            return computed, reused
        threading.Event().wait(0.01)
    raise AssertionError(f"the sampler's stats never counted {positions} prompt positions")


def test_an_episodes_turns_prefill_only_their_observations(
    service: treadle.ServiceClient, trainer: treadle.TrainingClient
) -> None:
    """The runner asks the sampler to keep each turn's KV (``cache_completion``):
    turns 2 and 3 compute only the last sampled token and the 2 observed ones,
    not the 8 tokens the turn before sampled."""
    sampler = trainer.sync_weights()
    params = treadle.SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True)
    computed0, reused0, _ = _sampler_counters(service)
    total = computed0 + reused0
    with EpisodeRunner(context_limit=2048) as runner:
        runner.submit(sampler, EnvGroup([CountingEnv(1)]), "w", params, EpisodeLimits()).result(
            TIMEOUT
        )  # the sampler exists and has run once
        total += 3
        computed0, reused0 = _counted(service, total)
        (episode,) = runner.submit(
            sampler, EnvGroup([CountingEnv(3)]), "0", params, EpisodeLimits()
        ).result(TIMEOUT)
    # turn 1: the 3-token first observation; turns 2 and 3: the history so far
    total += 3 + (3 + 8 + 2) + (3 + 2 * (8 + 2))
    computed, reused = _counted(service, total)
    assert episode.error is None and [len(t.tokens) for t in episode.turns] == [8, 8, 8]
    assert computed + reused == total
    # turn 1 reuses 2 tokens of the warm-up's identical first observation; turns 2
    # and 3 compute 1 + 2 tokens each
    assert computed - computed0 <= 3 + 2 * (1 + 2)
    assert reused - reused0 >= 2 * 8 + 8 + 2

    # a turn that max_turns makes the last does not ask: a request extending its
    # prompt + completion reuses the prompt (staged) and computes the completion again
    with EpisodeRunner(context_limit=2048) as runner:
        (capped,) = runner.submit(
            sampler, EnvGroup([CountingEnv(5)]), "1", params, EpisodeLimits(max_turns=2)
        ).result(TIMEOUT)
    assert capped.truncated == "max_turns" and len(capped.turns) == 2
    total += 3 + (3 + 8 + 2)
    computed0, reused0 = _counted(service, total)
    follow = [*capped.tokens(), 7, 8]
    sampler.sample(follow, 1, treadle.SamplingParams(max_tokens=1)).result(TIMEOUT)
    computed, reused = _counted(service, total + len(follow))
    assert (computed - computed0, reused - reused0) == (8 + 2, len(follow) - 8 - 2)


def test_a_turn_with_no_tokens_ends_only_its_episode(trainer: treadle.TrainingClient) -> None:
    """A group whose sampling params leave a turn no tokens (``max_tokens`` 0):
    the sampler returns an empty completion, and each of that group's episodes
    ends with an error naming it and ``turns[0].tokens``; the other group's
    episodes go on (one of them answered its first turn with an empty
    observation: not an error, the next turn follows the model's own tokens)."""

    class SilentToolEnv(CountingEnv):
        def step(self, action: list[int]) -> StepResult:
            result = super().step(action)
            return result if result.done else StepResult(reward=0.0, done=False, observation=[])

    sampler = trainer.sync_weights()
    empty = treadle.SamplingParams(max_tokens=0, temperature=1.0)
    fine, starved = run_episodes(
        sampler,
        [
            EnvGroup([CountingEnv(), SilentToolEnv()]),
            EnvGroup([CountingEnv(), CountingEnv()], sampling_params=empty),
        ],
        context_limit=2048,
        sampling_params=PARAMS,
        timeout=TIMEOUT,
    )
    assert [(e.error, e.done, len(e.turns)) for e in fine] == [(None, True, 2)] * 2
    assert fine[1].turns[1].observation == ()
    assert list(fine[1].to_rollout().mask or []) == [1.0] * fine[1].model_tokens
    for i, episode in enumerate(starved):
        assert episode.error == (
            f"episode 1.{i}: turns[0].tokens: the sampler returned no tokens (max_tokens 0); "
            "a turn must sample at least one"
        )
        assert not episode.ok and episode.turns == []
        with pytest.raises(treadle.InvalidArgumentError, match=rf"episode 1\.{i}: turns\[0\]"):
            episode.to_rollout()


def test_a_turn_decoding_through_an_inflight_update_has_the_right_versions(
    service: treadle.ServiceClient, trainer: treadle.TrainingClient
) -> None:
    """Turn 0 samples on version v. While the tool holds the episode the trainer
    steps; turn 1 (300 tokens) is decoding when ``sync_weights(inflight=True)``
    publishes v + 1 on the ``latest`` sampler: its first tokens are v's, the rest
    v + 1's; turn 2 is all v + 1 (it prefills its history again: turn 1's KV,
    written by two versions, was not kept). The rollout's versions say so token
    by token, observations taking the version of the turn they answer."""
    trainer.sync_weights().sampler_id  # noqa: B018 - a version to follow
    latest = service.create_sampling_client(weights=f"treadle://{trainer.model_id}/latest")
    v = trainer.get_info().version
    at_tool, resume = threading.Event(), threading.Event()

    class Held(CountingEnv):
        def step(self, action: list[int]) -> StepResult:
            if self.k == 0:
                at_tool.set()
                assert resume.wait(TIMEOUT)
            return super().step(action)

    long = treadle.SamplingParams(max_tokens=TURN, temperature=1.0, ignore_eos=True)
    context = service.get_server_info().base_models[0].max_context
    assert context >= 3 + 3 * TURN + 2 * 2
    with EpisodeRunner(context_limit=context) as runner:
        fut = runner.submit(latest, EnvGroup([Held(3)]), "0", long, EpisodeLimits())
        assert at_tool.wait(TIMEOUT)
        datum = treadle.Datum(
            model_input=treadle.ModelInput.from_ints([1, 5, 9]),
            loss_fn_inputs={"target_tokens": [5, 9, 2], "weights": [1.0, 1.0, 1.0]},
        )
        trainer.forward_backward([datum], "cross_entropy").result(TIMEOUT)
        trainer.optim_step(treadle.AdamParams(learning_rate=1e-2)).result(TIMEOUT)
        resume.set()
        for _ in range(int(TIMEOUT / 0.005)):  # turn 1 is decoding
            if _sampler_counters(service)[2] > 0:
                break
            threading.Event().wait(0.005)
        assert trainer.sync_weights(inflight=True).version == v + 1
        (episode,) = fut.result(TIMEOUT)
    assert episode.error is None and [len(t.tokens) for t in episode.turns] == [TURN] * 3
    t0, t1, t2 = episode.turns
    assert t0.versions == (v,) * TURN
    switch = t1.versions.index(v + 1)
    assert 0 < switch < TURN, "the update landed before or after turn 1's decode"
    assert t1.versions == (v,) * switch + (v + 1,) * (TURN - switch)
    assert t2.versions == (v + 1,) * TURN
    assert episode.to_rollout().token_versions() == (
        [v] * (TURN + 2 + switch) + [v + 1] * (TURN - switch + 2 + TURN)
    )
