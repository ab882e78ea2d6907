"""The async-RL ladder as three small loops: copy one and change it.

Each loop is a generator: it yields one :class:`StepStats` per training step,
so the caller prints, logs, evaluates or stops (``break``) between steps. The
user supplies three hooks:

* a **prompt source**: an iterator of :class:`Prompt` (tokens, the task the
  reward reads, optional per-prompt :class:`~treadle.types.SamplingParams`);
* a **reward function** ``reward_fn(task, sequence) -> float``;
* a **train step** ``train_step(trainer, groups) -> metrics`` that applies
  one or more optimizer steps; :func:`grpo_train_step` builds the usual one
  (group-centred advantages, a policy loss, minibatches) and its ``loss`` /
  ``loss_config`` / ``proximal`` arguments pick importance sampling, PPO or
  decoupled PPO.

The rungs of overlapping generation and training (docs/async_rl.md):

* :func:`sync_loop` (rung 0): generate a batch, train on it, sync, repeat.
  Strictly on-policy; the sampler idles while the trainer works and the
  trainer waits for the slowest answer of the batch.
* :func:`one_step_stale_loop` (rung 2): batch k+1 is sampled (by the weights
  before step k) while the trainer trains on batch k.
* :func:`async_loop` (rung 3): requests run continuously on a ``latest``
  sampler into a bounded buffer (back-pressure: at most ``buffer_groups``
  groups are in flight or waiting); the trainer takes finished groups in
  completion order, drops those older than ``max_staleness`` versions (or,
  with ``on_stale="wait"``, waits for them before they get that old) and
  syncs every ``sync_every`` steps.

Staleness is in optimizer steps (a model's weight version counts the optimizer
steps applied to it): a group is as stale as its oldest token. Every wait has a timeout, so a stuck
server fails the loop with ``TimeoutError`` instead of hanging it.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from treadle.errors import InvalidArgumentError
from treadle.rl.datums import Rollout
from treadle.rl.staleness import rollout_staleness
from treadle.rl.train_step import (
    Group,
    Prompt,
    RewardFn,
    StepStats,
    TrainStep,
    grpo_train_step,
)
from treadle.types import SamplingParams

if TYPE_CHECKING:
    from treadle.futures import APIFuture
    from treadle.sampling_client import SamplingClient
    from treadle.training_client import TrainingClient

# ---- shared pieces ---------------------------------------------------------------------


def _check_common(groups_per_step: int, group_size: int, steps: int, timeout: float) -> None:
    for name, value in (("groups_per_step", groups_per_step), ("group_size", group_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InvalidArgumentError(f"{name}: must be an integer >= 1, got {value!r}")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise InvalidArgumentError(f"steps: must be an integer >= 0, got {steps!r}")
    if not timeout > 0:
        raise InvalidArgumentError(f"timeout: must be > 0 seconds, got {timeout!r}")


def _check_sampling(params: SamplingParams | None, name: str) -> None:
    """Refuse greedy sampling for training: temperature 0 gives G identical samples
    per group, hence identical rewards and zero advantage everywhere, so every
    step would learn nothing while looking like it ran."""
    if params is not None and params.temperature == 0:
        raise InvalidArgumentError(
            f"{name}.temperature: 0 is greedy sampling: the samples of a group are identical, "
            "so every advantage is 0 and nothing is learned; sample RL rollouts at a "
            "temperature > 0 (e.g. 1.0, or leave it unset)"
        )


def _submit(
    sampler: SamplingClient, prompt: Prompt, group_size: int, params: SamplingParams | None
) -> APIFuture:
    _check_sampling(prompt.sampling_params, "prompt.sampling_params")
    return sampler.sample(prompt.tokens, group_size, prompt.sampling_params or params)


def _group(prompt: Prompt, fut: APIFuture, reward_fn: RewardFn, timeout: float) -> Group:
    try:
        response = fut.result(timeout)
    except TimeoutError as err:  # concurrent.futures.TimeoutError is TimeoutError (3.11+)
        raise TimeoutError(f"a sample request did not finish within {timeout} s") from err
    return Group(
        prompt,
        [
            Rollout.from_sequence(prompt.tokens, seq, reward=float(reward_fn(prompt.task, seq)))
            for seq in response.sequences
        ],
    )


def _version(trainer: TrainingClient, metrics: Mapping[str, float]) -> int:
    if "version" in metrics:
        return int(metrics["version"])
    return trainer.get_info().version


def _occupancy(trainer: TrainingClient) -> Callable[[], float | None]:
    """Ask the server for its metrics now (no waiting); the returned function gives
    the trainer's base model sampler's occupancy from them, if reported."""
    try:
        fut = trainer._service.get_server_info_async()
    except Exception:  # a signal, never a reason to fail the loop
        return lambda: None

    def occupancy() -> float | None:
        try:
            info = fut.result(10.0)
        except Exception:
            return None
        values = [m.occupancy for m in info.sampler_metrics if m.base_model == trainer.base_model]
        return float(max(values)) if values else None

    return occupancy


def _stats(
    step: int,
    version_before: int,
    version: int,
    groups: list[Group],
    dropped: int,
    wait_data_s: float,
    sampler_wait_s: float,
    t0: float,
    occupancy: Callable[[], float | None],
    metrics: dict[str, float],
) -> StepStats:
    rollouts = [r for g in groups for r in g.rollouts]
    staleness = Counter(rollout_staleness(r, version_before) for r in rollouts)
    return StepStats(
        step=step,
        version=version,
        groups=len(groups),
        rollouts=len(rollouts),
        trained_tokens=sum(r.trained_tokens for r in rollouts),
        reward=float(np.mean([r.reward for r in rollouts])) if rollouts else 0.0,
        staleness=dict(sorted(staleness.items())),
        dropped_stale=dropped,
        wait_data_s=wait_data_s,
        sampler_wait_s=sampler_wait_s,
        step_s=time.perf_counter() - t0,
        occupancy=occupancy(),
        metrics=metrics,
        failed_episodes=sum(1 for g in groups for e in g.episodes if not e.ok),
    )


def _sync(trainer: TrainingClient, timeout: float, inflight: bool = False) -> SamplingClient:
    # inflight is passed only when asked for, so the loops run on servers without it
    sync: Any = trainer.sync_weights  # Any: `inflight` is newer than some servers' SDKs
    sampler: SamplingClient = sync(inflight=True) if inflight else sync()
    done = threading.Event()
    sampler._info.add_done_callback(lambda _: done.set())
    if not done.wait(timeout):
        raise TimeoutError(f"sync_weights did not land within {timeout} s")
    sampler._info.result()  # raises the sync's error, if any
    return sampler


# ---- what a loop launches: one group, pending ------------------------------------------


@dataclass(frozen=True, eq=False)
class PendingGroup:
    """One group in flight: a sample request (prompts) or G episodes (env groups).

    ``future`` finishes when the group has; ``group(timeout)`` waits for it and
    gives the :class:`Group` (rewards scored, failed episodes left out)."""

    future: Future[Any]
    group: Callable[[float], Group]


#: ``launch(sampler, item) -> PendingGroup``: sends one item of the source.
Launch = Callable[["SamplingClient", Any], PendingGroup]


def _prompt_launch(group_size: int, params: SamplingParams | None, reward_fn: RewardFn) -> Launch:
    def launch(sampler: SamplingClient, prompt: Prompt) -> PendingGroup:
        fut = _submit(sampler, prompt, group_size, params)
        return PendingGroup(fut.concurrent, lambda timeout: _group(prompt, fut, reward_fn, timeout))

    return launch


def _wait_group(pending: PendingGroup, timeout: float) -> Group:
    done = wait_futures([pending.future], timeout=timeout).done
    if not done:
        raise TimeoutError(f"a rollout group did not finish within {timeout} s")
    return pending.group(timeout)


# ---- rung 0 ----------------------------------------------------------------------------


def sync_loop(
    trainer: TrainingClient,
    prompts: Iterable[Prompt],
    reward_fn: RewardFn,
    *,
    steps: int,
    groups_per_step: int,
    group_size: int,
    sampling_params: SamplingParams | None = None,
    train_step: TrainStep | None = None,
    timeout: float = 300.0,
) -> Iterator[StepStats]:
    """Rung 0: sample a batch from the current weights, train on it, sync, repeat."""
    _check_common(groups_per_step, group_size, steps, timeout)
    _check_sampling(sampling_params, "sampling_params")
    launch = _prompt_launch(group_size, sampling_params, reward_fn)
    return run_sync(trainer, prompts, launch, steps, groups_per_step, train_step, timeout)


def run_sync(
    trainer: TrainingClient,
    source_items: Iterable[Any],
    launch: Launch,
    steps: int,
    groups_per_step: int,
    train_step: TrainStep | None,
    timeout: float,
) -> Iterator[StepStats]:
    """Rung 0 over any source of groups (prompts or env groups)."""
    train_step = train_step or grpo_train_step()
    source = iter(source_items)
    sampler = _sync(trainer, timeout)
    version = trainer.get_info().version
    for step in range(1, steps + 1):
        t0 = time.perf_counter()
        occupancy = _occupancy(trainer)  # while this batch samples
        pending = [launch(sampler, next(source)) for _ in range(groups_per_step)]
        groups = [_wait_group(p, timeout) for p in pending]
        wait_data = time.perf_counter() - t0  # the trainer idles while the whole batch samples
        t_train = time.perf_counter()
        metrics = train_step(trainer, groups)
        sampler = _sync(trainer, timeout)
        new_version = _version(trainer, metrics)
        sampler_wait = time.perf_counter() - t_train  # the sampler idles while the trainer works
        yield _stats(
            step, version, new_version, groups, 0, wait_data, sampler_wait, t0, occupancy, metrics
        )
        version = new_version


# ---- rung 2 ----------------------------------------------------------------------------


def one_step_stale_loop(
    trainer: TrainingClient,
    prompts: Iterable[Prompt],
    reward_fn: RewardFn,
    *,
    steps: int,
    groups_per_step: int,
    group_size: int,
    sampling_params: SamplingParams | None = None,
    train_step: TrainStep | None = None,
    timeout: float = 300.0,
) -> Iterator[StepStats]:
    """Rung 2: batch k+1 samples (weights before step k) while the trainer trains on batch k.

    Batch k+1 is one train step stale when it is trained on; the ratio to the
    behaviour logprobs (and the clip) absorbs it. The sampler still waits for
    the sync at the end of each step before the next batch starts.
    """
    _check_common(groups_per_step, group_size, steps, timeout)
    _check_sampling(sampling_params, "sampling_params")
    launch = _prompt_launch(group_size, sampling_params, reward_fn)
    return run_one_step_stale(trainer, prompts, launch, steps, groups_per_step, train_step, timeout)


def run_one_step_stale(
    trainer: TrainingClient,
    source_items: Iterable[Any],
    launch: Launch,
    steps: int,
    groups_per_step: int,
    train_step: TrainStep | None,
    timeout: float,
) -> Iterator[StepStats]:
    """Rung 2 over any source of groups (prompts or env groups)."""
    train_step = train_step or grpo_train_step()
    source = iter(source_items)
    sampler = _sync(trainer, timeout)
    version = trainer.get_info().version

    def start(sampler: SamplingClient) -> tuple[list[PendingGroup], list[float]]:
        pending = [launch(sampler, next(source)) for _ in range(groups_per_step)]
        done_at: list[float] = []  # when each group finished (the sampler's idle starts after)
        for p in pending:
            p.future.add_done_callback(lambda _: done_at.append(time.perf_counter()))
        return pending, done_at

    nxt = start(sampler)
    for step in range(1, steps + 1):
        t0 = time.perf_counter()
        pending, _ = nxt
        groups = [_wait_group(p, timeout) for p in pending]
        wait_data = time.perf_counter() - t0
        nxt = start(sampler) if step < steps else ([], [])  # overlaps with this step
        occupancy = _occupancy(trainer)  # while the next batch samples
        metrics = train_step(trainer, groups)
        sampler = _sync(trainer, timeout)
        t_synced = time.perf_counter()
        new_version = _version(trainer, metrics)
        # the next batch's sampling idled from its last answer until these weights landed
        done_at = nxt[1]
        sampler_wait = (
            max(0.0, t_synced - max(done_at)) if nxt[0] and len(done_at) == len(nxt[0]) else 0.0
        )
        yield _stats(
            step, version, new_version, groups, 0, wait_data, sampler_wait, t0, occupancy, metrics
        )
        version = new_version


# ---- rung 3 ----------------------------------------------------------------------------


def async_loop(
    trainer: TrainingClient,
    sampler: SamplingClient,
    prompts: Iterable[Prompt],
    reward_fn: RewardFn,
    *,
    steps: int,
    groups_per_step: int,
    group_size: int,
    buffer_groups: int,
    max_staleness: int,
    sync_every: int = 1,
    inflight: bool = False,
    on_stale: str = "drop",
    sampling_params: SamplingParams | None = None,
    train_step: TrainStep | None = None,
    timeout: float = 300.0,
) -> Iterator[StepStats]:
    """Rung 3: continuous sampling into a bounded buffer; the trainer takes what is finished.

    ``sampler`` must follow the model's ``latest`` weights
    (``service.create_sampling_client(weights=f"treadle://{model_id}/latest")``).
    At most ``buffer_groups`` requests are in flight or finished-but-untaken:
    when the buffer is full the producer waits (back-pressure); when it is
    empty the trainer waits. Groups older than ``max_staleness`` versions when
    taken are dropped and counted. Default train step: ``ppo`` against the
    sampler's behaviour logprobs, which corrects staleness by importance
    sampling (pass ``grpo_train_step(proximal=True)`` for decoupled PPO).
    ``inflight=True`` syncs with ``sync_weights(inflight=True)`` (PipelineRL):
    sequences still generating continue under the new weights, so a long
    answer's later tokens are fresh (its staleness is still its oldest token's).

    ``on_stale="wait"`` keeps the bound without dropping: before a step, the
    trainer waits for every group still generating that this step would make
    staler than ``max_staleness`` (counted from the version it was sent
    under, which its first token cannot predate) and trains on it in this
    step, oldest first, up to ``groups_per_step``. A long answer then costs
    the trainer a wait instead of costing the sampler all the tokens it
    generated; with a long tail that is most of them. The default, "drop",
    never waits.
    """
    _check_common(groups_per_step, group_size, steps, timeout)
    _check_sampling(sampling_params, "sampling_params")
    check_async(
        trainer,
        sampler,
        max_staleness=max_staleness,
        sync_every=sync_every,
        buffer_groups=buffer_groups,
        on_stale=on_stale,
        name="async_loop",
    )
    launch = _prompt_launch(group_size, sampling_params, reward_fn)
    return run_async(
        trainer,
        sampler,
        prompts,
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


def check_async(
    trainer: TrainingClient,
    sampler: SamplingClient,
    *,
    max_staleness: int,
    sync_every: int,
    buffer_groups: int,
    on_stale: str,
    name: str,
) -> None:
    if on_stale not in ("drop", "wait"):
        raise InvalidArgumentError(f"on_stale: 'drop' or 'wait', got {on_stale!r}")
    if isinstance(max_staleness, bool) or not isinstance(max_staleness, int) or max_staleness < 0:
        raise InvalidArgumentError(f"max_staleness: must be an integer >= 0, got {max_staleness!r}")
    if isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 1:
        raise InvalidArgumentError(f"sync_every: must be an integer >= 1, got {sync_every!r}")
    if isinstance(buffer_groups, bool) or not isinstance(buffer_groups, int) or buffer_groups < 1:
        raise InvalidArgumentError(f"buffer_groups: must be an integer >= 1, got {buffer_groups!r}")
    if sampler.version is not None or sampler.model_id != trainer.model_id:
        raise InvalidArgumentError(
            f"sampler: {name} needs a sampler following this model's latest weights "
            f"(treadle://{trainer.model_id}/latest); a pinned sampler never sees the updates"
        )


def run_async(
    trainer: TrainingClient,
    sampler: SamplingClient,
    source_items: Iterable[Any],
    launch: Launch,
    *,
    steps: int,
    groups_per_step: int,
    buffer_groups: int,
    max_staleness: int,
    sync_every: int,
    inflight: bool,
    on_stale: str,
    train_step: TrainStep | None,
    timeout: float,
) -> Iterator[StepStats]:
    """Rung 3 over any source of groups (prompts or env groups)."""
    train_step = train_step or grpo_train_step()
    source = iter(source_items)
    slots = threading.Semaphore(buffer_groups)  # requests in flight + finished, not yet taken
    finished: queue.Queue[PendingGroup] = queue.Queue()
    stop = threading.Event()
    in_flight: set[PendingGroup] = set()
    #: sent and not yet taken by the trainer (in flight or finished): -> version when sent
    untaken: dict[PendingGroup, int] = {}
    taken_early: set[PendingGroup] = set()  # taken out of order ("wait"): skip when queued
    lock = threading.Lock()
    sampler_wait = [0.0]  # producer time blocked on back-pressure, since the last step
    errors: list[BaseException] = []
    version = trainer.get_info().version
    synced = [version]  # the weights a request sent now samples with, at least

    def produce() -> None:
        try:
            while not stop.is_set():
                t = time.perf_counter()
                if not slots.acquire(timeout=0.05):
                    with lock:
                        sampler_wait[0] += time.perf_counter() - t
                    continue
                with lock:
                    sampler_wait[0] += time.perf_counter() - t
                item = next(source)
                with lock:
                    sent_at = synced[0]
                pending = launch(sampler, item)
                with lock:
                    in_flight.add(pending)
                    untaken[pending] = sent_at

                def done(_: Future[Any], pending: PendingGroup = pending) -> None:
                    with lock:
                        in_flight.discard(pending)
                    finished.put(pending)

                pending.future.add_done_callback(done)
        except BaseException as err:  # StopIteration of the prompt source included
            errors.append(err)

    producer = threading.Thread(target=produce, name="treadle-rollouts", daemon=True)
    producer.start()
    dropped = 0
    advance = 1  # optimizer steps a train step takes (minibatches), as last seen

    def take(pending: PendingGroup, groups: list[Group]) -> None:
        nonlocal dropped
        with lock:
            untaken.pop(pending, None)
        slots.release()  # taken from the buffer: the producer may send another
        group = _wait_group(pending, timeout)
        if max((rollout_staleness(r, version) for r in group.rollouts), default=0) > max_staleness:
            dropped += len(group.rollouts)
        else:
            groups.append(group)

    try:
        for step in range(1, steps + 1):
            t0 = time.perf_counter()
            groups: list[Group] = []
            if on_stale == "wait":
                # groups (in flight or finished) this step would push past
                # max_staleness: take them now, waiting for those still generating
                with lock:
                    at_risk = sorted(
                        (sent, id(p), p)
                        for p, sent in untaken.items()
                        if version + advance - sent > max_staleness
                    )[:groups_per_step]
                for _, _, pending in at_risk:
                    taken_early.add(pending)
                    take(pending, groups)
            while len(groups) < groups_per_step:
                try:
                    pending = finished.get(timeout=timeout)
                except queue.Empty:
                    raise TimeoutError(
                        f"no rollout finished within {timeout} s"
                        + (f" (the producer failed: {errors[0]!r})" if errors else "")
                    ) from None
                if pending in taken_early:
                    taken_early.discard(pending)
                    continue
                take(pending, groups)
            wait_data = time.perf_counter() - t0
            occupancy = _occupancy(trainer)  # while this step trains
            metrics = train_step(trainer, groups)
            new_version = _version(trainer, metrics)
            advance = max(1, new_version - version)
            if step % sync_every == 0:
                _sync(trainer, timeout, inflight)
                with lock:
                    synced[0] = new_version
            with lock:
                s_wait, sampler_wait[0] = sampler_wait[0], 0.0
            yield _stats(
                step,
                version,
                new_version,
                groups,
                dropped,
                wait_data,
                s_wait,
                t0,
                occupancy,
                metrics,
            )
            version, dropped = new_version, 0
    finally:
        stop.set()
        slots.release()  # wake the producer if it waits for a slot
        producer.join(timeout)
        with lock:
            left = list(in_flight)
        # let requests already sent finish, so the next user of the sampler starts clean
        wait_futures([p.future for p in left], timeout=timeout)
