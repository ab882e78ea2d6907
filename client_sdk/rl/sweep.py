"""Many runs from one process: a sweep (learning rates, seeds, ablations) of N
LoRA models on one base model, stepped together from one thread.

Every SDK call returns a future at once, so N runs need no N threads of
blocking calls: :func:`sweep_loop` sends each phase of every run before it
waits for any of them (every run's ``sample`` requests, then every run's
``forward_backward`` + ``optim_step``, then every ``sync_weights``). What
arrives together is served together: the sampler decodes the rows of all the
runs' adapters in one batch, and the engine runs one call of each run in one
training pass (a tenant's ready models share a scheduling round; fair share
stays between tenants, so a sweep of 8 gets one tenant's share, spent in few
passes). ``ServerInfo.training_pass_metrics`` shows whether they did.

The runs move in lockstep, rung 0 of the async ladder for each
(:func:`treadle.rl.sync_loop`): every step each run samples from its current
weights, trains, syncs. They see the same prompts, so their curves differ by
what the sweep varies.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from treadle.errors import InvalidArgumentError, ResourceExhaustedError
from treadle.rl.loops import _check_common, _group, _occupancy, _stats, _submit, _version
from treadle.rl.train_step import Group, Prompt, RewardFn, StepStats, TrainStep, grpo_train_step
from treadle.types import SamplingParams

if TYPE_CHECKING:
    from treadle.sampling_client import SamplingClient
    from treadle.service_client import ServiceClient
    from treadle.training_client import TrainingClient


@dataclass(frozen=True)
class RunSpec:
    """One run of a sweep: its own LoRA model."""

    rank: int = 16
    seed: int = 0
    alpha: float | None = None  # LoRA alpha; None: the server's default


def create_runs(
    service: ServiceClient, base_model: str, runs: Sequence[RunSpec]
) -> list[TrainingClient]:
    """One LoRA model per run, all or none. A sweep larger than what the tenant's
    ``max_models`` quota leaves free is refused with RESOURCE_EXHAUSTED, naming
    the quota, before any model is created (``ServerInfo.max_models`` and
    ``live_models``). Should the server still refuse one (another client of the
    tenant created models meanwhile), the models made so far are deleted and
    the same error is raised."""
    if not runs:
        raise InvalidArgumentError("runs: a sweep needs at least one run")
    info = service.get_server_info()
    free = info.max_models - info.live_models
    if info.max_models and len(runs) > free:
        raise ResourceExhaustedError(
            f"max_models: a sweep of {len(runs)} runs needs {len(runs)} models; the tenant "
            f"has {info.live_models} of its quota of {info.max_models}, so {max(free, 0)} more "
            "fit; delete models or run a smaller sweep (no model was created)"
        )
    made: list[TrainingClient] = []
    try:
        for spec in runs:
            made.append(
                service.create_lora_training_client(
                    base_model, rank=spec.rank, seed=spec.seed, alpha=spec.alpha
                )
            )
    except ResourceExhaustedError as err:
        for trainer in made:
            service.delete_model(trainer.model_id)
        raise ResourceExhaustedError(
            f"a sweep of {len(runs)} runs needs {len(runs)} models; none was kept: {err.message}",
            retry_after_s=err.retry_after_s,
        ) from None
    return made


def sweep_loop(
    trainers: Sequence[TrainingClient],
    prompts: Iterable[Prompt],
    reward_fn: RewardFn,
    *,
    steps: int,
    groups_per_step: int,
    group_size: int,
    sampling_params: SamplingParams | None = None,
    train_steps: TrainStep | Sequence[TrainStep] | None = None,
    timeout: float = 300.0,
) -> Iterator[list[StepStats]]:
    """Yield, each step, one :class:`StepStats` per run (in ``trainers`` order).

    ``train_steps``: one for all runs, or one per run (e.g.
    ``[rl.grpo_train_step(adam=AdamParams(learning_rate=lr)) for lr in lrs]``).
    A step with a ``submit`` method (``grpo_train_step``'s) has every run's
    calls in flight together; any other callable runs the runs' steps in turn.
    """
    _check_common(groups_per_step, group_size, steps, timeout)
    if not trainers:
        raise InvalidArgumentError("trainers: a sweep needs at least one run")
    if train_steps is None or callable(train_steps):
        per_run = [train_steps or grpo_train_step()] * len(trainers)
    else:
        per_run = list(train_steps)
        if len(per_run) != len(trainers):
            raise InvalidArgumentError(
                f"train_steps: one per run, got {len(per_run)} for {len(trainers)} runs"
            )
    source = iter(prompts)
    samplers = _sync_all(trainers, timeout)
    versions = [t.get_info().version for t in trainers]
    for step in range(1, steps + 1):
        t0 = time.perf_counter()
        occupancy = _occupancy(trainers[0])  # one base model: one sampler to ask about
        batch = [next(source) for _ in range(groups_per_step)]
        futures = [[_submit(s, p, group_size, sampling_params) for p in batch] for s in samplers]
        groups = [
            [_group(p, f, reward_fn, timeout) for p, f in zip(batch, fs, strict=True)]
            for fs in futures
        ]
        wait_data = time.perf_counter() - t0
        t_train = time.perf_counter()
        finishes = _submit_steps(per_run, trainers, groups)
        metrics = [finish() for finish in finishes]
        samplers = _sync_all(trainers, timeout)
        new_versions = [_version(t, m) for t, m in zip(trainers, metrics, strict=True)]
        sampler_wait = time.perf_counter() - t_train
        yield [
            _stats(step, v, nv, g, 0, wait_data, sampler_wait, t0, occupancy, m)
            for v, nv, g, m in zip(versions, new_versions, groups, metrics, strict=True)
        ]
        versions = new_versions


def _submit_steps(
    train_steps: Sequence[TrainStep],
    trainers: Sequence[TrainingClient],
    groups: Sequence[list[Group]],
) -> list[Callable[[], dict[str, float]]]:
    """Every run's train step sent, in three kinds: a step that ``prepare`` s and
    ``send`` s (``grpo_train_step``'s) has all its client work done before any
    run's call goes out, so the calls reach the engine together (and share its
    passes); one that ``submit`` s is sent in turn; any other runs in turn."""
    prepared = [
        (fn, fn.prepare(g)) if hasattr(fn, "prepare") and hasattr(fn, "send") else (fn, None)
        for fn, g in zip(train_steps, groups, strict=True)
    ]
    finishes: list[Callable[[], dict[str, float]]] = []
    for (fn, plan), trainer, g in zip(prepared, trainers, groups, strict=True):
        if plan is not None:
            finishes.append(fn.send(trainer, plan))  # type: ignore[attr-defined]
        elif hasattr(fn, "submit"):
            finishes.append(fn.submit(trainer, g))
        else:
            finishes.append(_done(fn(trainer, g)))
    return finishes


def _done(metrics: dict[str, float]) -> Callable[[], dict[str, float]]:
    return lambda: metrics


def _sync_all(trainers: Sequence[TrainingClient], timeout: float) -> list[SamplingClient]:
    """Every run's ``sync_weights`` in flight, then each waited for."""
    samplers = [t.sync_weights() for t in trainers]
    deadline = time.monotonic() + timeout
    for sampler in samplers:
        try:
            sampler._info.result(max(0.0, deadline - time.monotonic()))
        except TimeoutError as err:
            raise TimeoutError(f"sync_weights did not land within {timeout} s") from err
    return samplers
