"""RL helpers for the client side of the loop: advantages, datums, staleness, KL, agent episodes.

numpy only; torch tensors are accepted as inputs but torch is never imported.
"""

from treadle.rl.advantages import effective_group_rate, group_advantages, informative_groups
from treadle.rl.cookbook import CookbookEnv, cookbook_groups
from treadle.rl.datums import AGGREGATIONS, Aggregation, Rollout, build_datums
from treadle.rl.episode_loops import (
    async_episode_loop,
    one_step_stale_episode_loop,
    run_episodes,
    sync_episode_loop,
)
from treadle.rl.episode_runner import EpisodeRunner
from treadle.rl.episodes import (
    Env,
    EnvGroup,
    Episode,
    EpisodeError,
    EpisodeLimits,
    EpisodeTurn,
    StepResult,
)
from treadle.rl.kl import kl_k3
from treadle.rl.loops import async_loop, one_step_stale_loop, sync_loop
from treadle.rl.metrics import merge_metrics
from treadle.rl.staleness import (
    Versions,
    drop_stale,
    expand_versions,
    rollout_staleness,
    staleness_histogram,
    token_staleness,
)
from treadle.rl.sweep import RunSpec, create_runs, sweep_loop
from treadle.rl.train_step import Group, GrpoTrainStep, Prompt, StepStats, grpo_train_step

__all__ = [
    "CookbookEnv",
    "cookbook_groups",
    "Env",
    "EnvGroup",
    "Episode",
    "EpisodeError",
    "EpisodeLimits",
    "EpisodeRunner",
    "EpisodeTurn",
    "StepResult",
    "async_episode_loop",
    "one_step_stale_episode_loop",
    "run_episodes",
    "sync_episode_loop",
    "AGGREGATIONS",
    "Aggregation",
    "Rollout",
    "Group",
    "GrpoTrainStep",
    "RunSpec",
    "Prompt",
    "StepStats",
    "Versions",
    "async_loop",
    "build_datums",
    "create_runs",
    "drop_stale",
    "effective_group_rate",
    "expand_versions",
    "group_advantages",
    "grpo_train_step",
    "informative_groups",
    "kl_k3",
    "merge_metrics",
    "one_step_stale_loop",
    "rollout_staleness",
    "staleness_histogram",
    "sweep_loop",
    "sync_loop",
    "token_staleness",
]
