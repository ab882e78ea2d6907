"""Agent episodes: the async episode loop against the sync one, and the prefill a
turn reuses from the turns before it.

The embedded server (in-process engine, the torch sampler) and the "demo"
preset built locally, a LoRA model of rank 8. 64 episodes of 4 turns: each
first observation is 120 random tokens (distinct per episode), each turn
samples 16 tokens (``ignore_eos``), and the tool answers with 8 tokens after a
random 50-500 ms (an ``async def`` step awaiting ``asyncio.sleep``, seeded).
Groups of 8 episodes; the reward is noise (the parity of the turn's tokens), the
train step ``grpo_train_step`` (PPO, one optimizer step a batch).

* **sync**: ``sync_episode_loop``, 2 groups a step, 4 steps: each batch's 16
  episodes run together, the trainer waits for the slowest, then trains and syncs.
* **async**: ``async_episode_loop`` on a ``latest`` sampler, 2 groups a step,
  4 steps, ``buffer_groups`` 8 (64 episodes in flight or waiting),
  ``max_staleness`` 4, ``on_stale="wait"``.
* **rollout only**: the same 64 episodes through ``run_episodes`` (no training,
  so no weight changes mid-episode), each turn but the last asking the sampler
  to keep its completion's KV (``SamplingParams.cache_completion``, as the
  episode loops do) and, in the same run, every turn sent as a plain request
  (``cache_completion`` cleared: only the prompt's KV is reused, as before).

Episodes/s counts the episodes trained on (or rolled out) over the phase's
wall-clock. Prefill reuse on turns >= 2 is ``prefix_reused_tokens`` over
prompt positions (computed + reused) from ``GetServerInfo``, less the first
turns' 120 tokens (distinct random prefixes: nothing of them can be reused
beyond a chance first-token match).

    .venv/bin/python benchmarks/agents.py            # ~1-2 min on 2 busy cores

Thread budget: 2 (fixed). Targets: async >= 2x sync episodes/s; reuse >= 0.9.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import random
import time
from collections.abc import Callable, Iterator
from typing import Any

import _common  # sets the thread budget before torch starts its pools

import treadle
from treadle import rl
from treadle.server.config import ServerConfig
from treadle.server.embedded import EmbeddedServer

FIRST, SAMPLED, OBSERVED = 120, 16, 8
BUFFER_GROUPS = 8  # episode groups in flight or waiting in the async loop


class PlainRequests:
    """A sampler whose requests never ask to keep their completion's KV."""

    def __init__(self, sampler: treadle.SamplingClient) -> None:
        self.sampler = sampler

    def sample(self, prompt: Any, num_samples: int, params: treadle.SamplingParams) -> Any:
        plain = dataclasses.replace(params, cache_completion=False)
        return self.sampler.sample(prompt, num_samples, plain)


class ToolEnv:
    """``turns`` turns; the tool takes a seeded 50-500 ms, then answers 8 tokens."""

    def __init__(self, seed: int, turns: int) -> None:
        self.rng = random.Random(seed)
        self.turns, self.k = turns, 0

    def initial_observation(self) -> list[int]:
        return [self.rng.randrange(3, 90) for _ in range(FIRST)]

    async def step(self, action: list[int]) -> rl.StepResult:
        await asyncio.sleep(self.rng.uniform(0.05, 0.5))  # a tool call over the network
        self.k += 1
        if self.k == self.turns:
            return rl.StepResult(float(sum(action) % 2), done=True)
        observation = [self.rng.randrange(3, 90) for _ in range(OBSERVED)]
        return rl.StepResult(0.0, done=False, observation=observation)


def env_groups(turns: int, group_size: int, seed: int) -> Iterator[rl.EnvGroup]:
    ids = itertools.count(seed * 1_000_000)
    while True:
        yield rl.EnvGroup([ToolEnv(next(ids), turns) for _ in range(group_size)])


class Counting:
    """The env groups a loop took (its episodes' first turns count as turn 1)."""

    def __init__(self, groups: Iterator[rl.EnvGroup]) -> None:
        self.groups, self.started = groups, 0

    def __iter__(self) -> Counting:
        return self

    def __next__(self) -> rl.EnvGroup:
        self.started += 1
        return next(self.groups)


def counters(service: treadle.ServiceClient) -> tuple[int, int]:
    (m,) = [m for m in service.get_server_info().sampler_metrics if m.base_model == "demo"]
    return m.prompt_tokens, m.prefix_reused_tokens


def measure(
    service: treadle.ServiceClient, run: Callable[[], tuple[int, int, float]]
) -> tuple[int, float, float]:
    """(episodes, episodes/s, reuse on turns >= 2) of one phase. ``run`` returns
    the episodes trained on (or rolled out), all the episodes it started and the
    moment its last step ended (a loop's episodes still in flight then are
    waited for, but not timed: they belong to the steps a longer run would take)."""
    computed0, reused0 = counters(service)
    t0 = time.perf_counter()
    done, started, t_end = run()
    seconds = t_end - t0
    computed, reused = counters(service)
    computed, reused = computed - computed0, reused - reused0
    later = computed + reused - FIRST * started  # prompt positions of turns >= 2
    return done, done / seconds, reused / later if later > 0 else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--episodes", type=int, default=64)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--model-dir", default=None, help="reuse a built demo model")
    args = parser.parse_args()
    G = args.group_size
    groups_per_step = 2
    steps = args.episodes // (G * groups_per_step)
    params = treadle.SamplingParams(max_tokens=SAMPLED, temperature=1.0, ignore_eos=True)
    limits = rl.EpisodeLimits(max_turns=args.turns)
    train = rl.grpo_train_step(adam=treadle.AdamParams(learning_rate=1e-4))
    data = _common.scratch("treadle-bench-agents-")
    model = _common.model_dir("demo", args.model_dir)
    config = ServerConfig(data_dir=data, models={"demo": model}, port=0, threads=1)
    rows: list[list[Any]] = []
    with (
        EmbeddedServer(config) as server,
        treadle.ServiceClient(server.address, api_key=server.api_key) as service,
    ):
        trainer = service.create_lora_training_client("demo", rank=8, seed=0)
        context = service.get_server_info().base_models[0].max_context

        def rollout(seed: int, keep: bool = True) -> tuple[int, int, float]:
            groups = list(itertools.islice(env_groups(args.turns, G, seed), args.episodes // G))
            sampler: Any = trainer.sync_weights()
            if not keep:
                sampler = PlainRequests(sampler)
            results = rl.run_episodes(
                sampler, groups, context_limit=context, sampling_params=params, limits=limits
            )
            return sum(1 for g in results for e in g if e.ok), args.episodes, time.perf_counter()

        def timed(stats: Iterator[rl.StepStats], source: Counting) -> tuple[int, int, float]:
            done, t_end = 0, 0.0
            for s in stats:
                done += s.rollouts
                t_end = time.perf_counter()
            return done, source.started * G, t_end

        def sync() -> tuple[int, int, float]:
            source = Counting(env_groups(args.turns, G, 1))
            stats = rl.sync_episode_loop(
                trainer,
                source,
                steps=steps,
                groups_per_step=groups_per_step,
                sampling_params=params,
                limits=limits,
                train_step=train,
            )
            return timed(stats, source)

        def async_() -> tuple[int, int, float]:
            trainer.sync_weights().sampler_id  # noqa: B018 - a version to follow
            latest = service.create_sampling_client(weights=f"treadle://{trainer.model_id}/latest")
            source = Counting(env_groups(args.turns, G, 2))
            stats = rl.async_episode_loop(
                trainer,
                latest,
                source,
                steps=steps,
                groups_per_step=groups_per_step,
                buffer_groups=BUFFER_GROUPS,
                max_staleness=4,
                on_stale="wait",
                sampling_params=params,
                limits=limits,
                train_step=train,
            )
            return timed(stats, source)

        rollout(9)  # warm-up: first calls, allocations
        sync_row = measure(service, sync)
        async_row = measure(service, async_)
        kept_row = measure(service, lambda: rollout(3))
        prompt_only_row = measure(service, lambda: rollout(4, keep=False))
        base = sync_row[1]
        for name, (n, eps, reuse) in (
            ("sync_episode_loop (baseline)", sync_row),
            (f"async_episode_loop, buffer {BUFFER_GROUPS}, wait", async_row),
            ("rollout only, completion KV kept", kept_row),
            ("rollout only, plain requests (prompt KV only)", prompt_only_row),
        ):
            rows.append([name, n, eps, eps / base, reuse])
    print(
        f"{args.episodes} episodes x {args.turns} turns, tool 50-500 ms, "
        f"first observation {FIRST}, {SAMPLED} sampled + {OBSERVED} observed a turn"
    )
    print(
        _common.table(
            ["variant", "episodes", "episodes/s", "x sync", "prefill reused, turns >= 2"], rows
        )
    )


if __name__ == "__main__":
    main()
