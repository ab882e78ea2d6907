"""The async-RL ladder (treadle.rl.loops) against the embedded engine, tiny model.

Every loop runs with a short ``timeout`` on each wait, and the test itself is
run in a thread with a deadline, so a deadlock fails the test instead of
hanging it.
"""

from __future__ import annotations

import inspect
import itertools
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

import pytest

import treadle
from tests.helpers import next_token_datum
from treadle.futures import APIFuture
from treadle.rl import (
    Group,
    Prompt,
    Rollout,
    StepStats,
    async_loop,
    grpo_train_step,
    one_step_stale_loop,
    sync_loop,
)
from treadle.rl import loops as loops_mod

PARAMS = treadle.SamplingParams(max_tokens=3, temperature=1.0)
DEADLINE_S = 120.0


def prompts() -> Iterator[Prompt]:
    for i in itertools.count():
        yield Prompt(tokens=[1, 5 + i % 7, 9], task=i % 2)


def reward(task: Any, seq: treadle.SampledSequence) -> float:
    return float(sum(seq.tokens) % 2 == task)  # noise, but varied within a group


def run_with_deadline(fn: Callable[[], list[StepStats]]) -> list[StepStats]:
    out: list[Any] = []

    def target() -> None:
        try:
            out.append(fn())
        except BaseException as err:
            out.append(err)

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(DEADLINE_S)
    assert not t.is_alive(), "the loop deadlocked"
    if isinstance(out[0], BaseException):
        raise out[0]
    return out[0]


@pytest.fixture(scope="module")
def trainer(service: treadle.ServiceClient) -> treadle.TrainingClient:
    return service.create_lora_training_client("tiny", rank=4, seed=0)


def latest(service: treadle.ServiceClient, trainer: treadle.TrainingClient):
    trainer.sync_weights().sampler_id  # noqa: B018 - a published version to follow
    return service.create_sampling_client(weights=f"treadle://{trainer.model_id}/latest")


def test_sync_and_one_step_stale_loops_run(trainer: treadle.TrainingClient) -> None:
    kw = dict(steps=2, groups_per_step=2, group_size=4, sampling_params=PARAMS, timeout=30.0)
    v0 = trainer.get_info().version
    sync = run_with_deadline(lambda: list(sync_loop(trainer, prompts(), reward, **kw)))
    assert [s.step for s in sync] == [1, 2]
    assert all(s.staleness == {0: 8} for s in sync)  # on-policy
    assert all(s.rollouts == 8 and s.trained_tokens > 0 for s in sync)
    stale = run_with_deadline(lambda: list(one_step_stale_loop(trainer, prompts(), reward, **kw)))
    assert [s.step for s in stale] == [1, 2]
    # batch 1 was sampled before any step of this loop; batch 2 one train step earlier
    assert stale[0].staleness == {0: 8}
    assert set(stale[1].staleness) == {stale[0].version - sync[-1].version}, stale
    assert trainer.get_info().version >= v0


def test_step_metrics_use_the_servers_names(trainer: treadle.TrainingClient) -> None:
    """A loop's StepStats.metrics are keyed as forward_backward's and optim_step's
    (``loss:sum``, ``clip_frac:mean``, ``ratio:*``, ``kl_ref:mean``, ``grad_norm:value``)."""
    config = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.28, "kl_beta": 0.01}
    step = grpo_train_step(loss_config=config, minibatches=2)
    kw = dict(steps=2, groups_per_step=2, group_size=4, sampling_params=PARAMS, timeout=30.0)
    stats = run_with_deadline(
        lambda: list(sync_loop(trainer, prompts(), reward, train_step=step, **kw))
    )
    trained = [s.metrics for s in stats if s.metrics["trained_rollouts"] > 0]
    assert trained, "no step had a group whose rewards disagree"
    for m in trained:
        for key in ("loss:sum", "ntokens:sum", "clip_frac:mean", "kl_ref:mean", "grad_norm:value"):
            assert key in m, (key, sorted(m))
        assert {"ratio:mean", "ratio:min", "ratio:max"} <= set(m)
        assert m["ratio:min"] <= m["ratio:mean"] <= m["ratio:max"]
        assert "loss" not in m and "clip_frac" not in m  # one name per quantity


@pytest.mark.parametrize("buffer_groups", [1, 3])
def test_async_loop_tiny_buffers_never_deadlock(
    service: treadle.ServiceClient, trainer: treadle.TrainingClient, buffer_groups: int
) -> None:
    sampler = latest(service, trainer)
    # buffer of 1 with 2 groups a step: the trainer empties it every take, the
    # producer is blocked on a full buffer most of the time
    stats = run_with_deadline(
        lambda: list(
            async_loop(
                trainer,
                sampler,
                prompts(),
                reward,
                steps=3,
                groups_per_step=2,
                group_size=2,
                buffer_groups=buffer_groups,
                max_staleness=8,
                sync_every=1,
                sampling_params=PARAMS,
                timeout=30.0,
            )
        )
    )
    assert [s.step for s in stats] == [1, 2, 3]
    assert all(s.groups == 2 and s.rollouts == 4 for s in stats)
    assert all(max(s.staleness) <= 8 for s in stats)
    assert all(s.wait_data_s >= 0 and s.sampler_wait_s >= 0 for s in stats)


def test_async_loop_with_decoupled_ppo(
    service: treadle.ServiceClient, trainer: treadle.TrainingClient
) -> None:
    sampler = latest(service, trainer)
    step = grpo_train_step(proximal=True, adam=treadle.AdamParams(learning_rate=1e-3))
    v0 = trainer.get_info().version
    stats = run_with_deadline(
        lambda: list(
            async_loop(
                trainer, sampler, prompts(), reward, steps=2, groups_per_step=1, group_size=4,
                buffer_groups=2, max_staleness=4, sync_every=2, sampling_params=PARAMS,
                train_step=step, timeout=30.0,
            )
        )
    )  # fmt: skip
    assert [s.step for s in stats] == [1, 2]
    assert all(s.groups == 1 and s.rollouts == 4 for s in stats)
    assert all(max(s.staleness) <= 4 for s in stats)
    # a step that trained took one optimizer step and brought its PPO metrics back;
    # one whose group's rewards all agree trains on nothing and leaves the version
    version = v0
    for s in stats:
        if s.metrics.get("trained_rollouts", 0) > 0:
            version += 1
            assert {"loss:sum", "ratio:mean", "clip_frac:mean"} <= set(s.metrics), sorted(s.metrics)
        assert s.version == version
    assert trainer.get_info().version == version


def _rollout(version: int) -> Rollout:
    return Rollout([1, 2], [3, 4], [-1.0, -1.0], reward=1.0, versions=[version, version])


def test_async_loop_drops_exactly_the_stale_groups(
    service: treadle.ServiceClient, trainer: treadle.TrainingClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Groups whose oldest token is more than max_staleness versions old are dropped, only them."""
    v = trainer.get_info().version
    # the producer's groups come back with these versions, in order
    versions = iter([v, v - 3, v - 2, v - 1, v - 5, v, v - 2, v, v])
    real_group = loops_mod._group

    def fake_group(prompt: Prompt, fut: Any, reward_fn: Any, timeout: float) -> Group:
        real_group(prompt, fut, reward_fn, timeout)
        ver = next(versions)
        return Group(prompt, [_rollout(ver), _rollout(ver)])

    monkeypatch.setattr(loops_mod, "_group", fake_group)
    seen: list[list[Group]] = []

    def train_step(trainer: treadle.TrainingClient, groups: list[Group]) -> dict[str, float]:
        seen.append(groups)
        return {"version": float(v)}  # no optimizer step: the version stays at v

    sampler = latest(service, trainer)
    stats = run_with_deadline(
        lambda: list(
            async_loop(
                trainer, sampler, prompts(), reward, steps=3, groups_per_step=2, group_size=2,
                buffer_groups=2, max_staleness=2, sampling_params=PARAMS, train_step=train_step,
                timeout=30.0,
            )
        )
    )  # fmt: skip
    # step 1: v (kept), v-3 (dropped), v-2 (kept); step 2: v-1, v-5 (dropped), v;
    # step 3: v-2, v
    assert [s.dropped_stale for s in stats] == [2, 2, 0]
    assert [s.staleness for s in stats] == [{0: 2, 2: 2}, {0: 2, 1: 2}, {0: 2, 2: 2}]
    assert [[g.rollouts[0].token_versions()[0] for g in gs] for gs in seen] == [
        [v, v - 2],
        [v - 1, v],
        [v - 2, v],
    ]


def test_bad_input(service: treadle.ServiceClient, trainer: treadle.TrainingClient) -> None:
    sampler = latest(service, trainer)
    kw = dict(steps=1, groups_per_step=1, group_size=2, buffer_groups=2, timeout=5.0)
    with pytest.raises(treadle.InvalidArgumentError, match="max_staleness"):
        next(async_loop(trainer, sampler, prompts(), reward, max_staleness=-1, **kw))
    with pytest.raises(treadle.InvalidArgumentError, match="sync_every"):
        next(async_loop(trainer, sampler, prompts(), reward, max_staleness=1, sync_every=0, **kw))
    with pytest.raises(treadle.InvalidArgumentError, match="on_stale"):
        next(async_loop(trainer, sampler, prompts(), reward, max_staleness=1, on_stale="x", **kw))
    with pytest.raises(treadle.InvalidArgumentError, match="buffer_groups"):
        kw0 = {**kw, "buffer_groups": 0}
        next(async_loop(trainer, sampler, prompts(), reward, max_staleness=1, **kw0))
    pinned = trainer.sync_weights()
    with pytest.raises(treadle.InvalidArgumentError, match="latest"):
        next(async_loop(trainer, pinned, prompts(), reward, max_staleness=1, **kw))
    with pytest.raises(treadle.InvalidArgumentError, match="group_size"):
        next(sync_loop(trainer, prompts(), reward, steps=1, groups_per_step=1, group_size=0))
    with pytest.raises(treadle.InvalidArgumentError, match="minibatches"):
        grpo_train_step(minibatches=0)


def test_async_loop_timeout_fails_instead_of_hanging(
    service: treadle.ServiceClient, trainer: treadle.TrainingClient
) -> None:
    """A prompt source that runs dry leaves the trainer with nothing: TimeoutError, not a hang."""
    sampler = latest(service, trainer)
    two = [Prompt([1, 5, 9], 0), Prompt([1, 6, 9], 1)]
    with pytest.raises(TimeoutError, match="producer failed"):
        run_with_deadline(
            lambda: list(
                async_loop(
                    trainer, sampler, two, reward, steps=2, groups_per_step=2, group_size=2,
                    buffer_groups=4, max_staleness=4, sampling_params=PARAMS, timeout=3.0,
                )
            )
        )  # fmt: skip


@pytest.mark.skipif(
    "inflight" not in inspect.signature(treadle.TrainingClient.sync_weights).parameters,
    reason="sync_weights(inflight=True) not in this SDK yet",
)
def test_async_loop_with_inflight_updates(
    service: treadle.ServiceClient, trainer: treadle.TrainingClient
) -> None:
    """Syncs land while rollouts decode: some rollout is written by two versions
    (its later tokens under the newer weights), one version a train step."""
    sampler = latest(service, trainer)
    grpo = grpo_train_step()
    seen: list[Group] = []
    filler = next_token_datum([1, 5, 9, 13])

    def train_step(trainer: treadle.TrainingClient, groups: list[Group]) -> dict[str, float]:
        seen.extend(groups)
        out = grpo(trainer, groups)
        if not out["trained_rollouts"]:  # rewards agreed: still move the weights a step
            trainer.forward_backward([filler]).result()
            out["version"] = float(trainer.optim_step().result().step)
        return out

    # long answers (no early EOS), so a group is still decoding when a step's sync lands
    long = treadle.SamplingParams(max_tokens=48, temperature=1.0, ignore_eos=True)
    v0 = trainer.get_info().version
    stats = run_with_deadline(
        lambda: list(
            async_loop(
                trainer, sampler, prompts(), reward, steps=4, groups_per_step=1, group_size=2,
                buffer_groups=3, max_staleness=8, inflight=True, sampling_params=long,
                train_step=train_step, timeout=30.0,
            )
        )
    )  # fmt: skip
    assert [s.step for s in stats] == [1, 2, 3, 4]
    assert [s.version for s in stats] == [v0 + 1, v0 + 2, v0 + 3, v0 + 4]
    assert all(s.groups == 1 and s.rollouts == 2 and s.dropped_stale == 0 for s in stats)
    rollouts = [r for g in seen for r in g.rollouts]
    assert len(rollouts) == 8 and all(len(r.completion_tokens) == 48 for r in rollouts)
    spans = [r.token_versions() for r in rollouts]
    assert all(v == sorted(v) and v0 <= v[0] and v[-1] <= v0 + 4 for v in spans), spans
    mixed = [v for v in spans if len(set(v)) > 1]
    assert mixed, f"no rollout spans two versions: {[sorted(set(v)) for v in spans]}"


@pytest.mark.parametrize("on_stale", ["drop", "wait"])
def test_async_loop_waits_for_a_slow_group_instead_of_dropping_it(
    service: treadle.ServiceClient,
    trainer: treadle.TrainingClient,
    monkeypatch: pytest.MonkeyPatch,
    on_stale: str,
) -> None:
    """The first group is held back (a long answer) while the trainer steps on,
    one optimizer step a train step, max_staleness 2 (the buffer holds it and one
    more group, so it is the only one that can go stale). "drop" trains without
    it and drops it once it comes back too stale; "wait" stops before the step
    that would make it too stale (the third), waits for it and trains on it."""
    release = threading.Event()
    held: list[Prompt] = []
    asked_after_steps: list[int] = []  # train steps done when the loop asked for it
    trained: list[list[Prompt]] = []
    real_submit = loops_mod._submit

    class Held(APIFuture[Any]):
        def result(self, timeout: float | None = None) -> Any:
            asked_after_steps.append(len(trained))
            release.set()  # the loop waits for it: let it finish
            return super().result(timeout)

    def submit(sampler: Any, prompt: Prompt, group_size: int, params: Any) -> APIFuture:
        fut = real_submit(sampler, prompt, group_size, params)
        if held:
            return fut
        held.append(prompt)
        slow: Future[Any] = Future()

        def finish_when_released() -> None:
            release.wait(30)
            slow.set_result(fut.result(30))

        threading.Thread(target=finish_when_released, daemon=True).start()
        return Held(slow)

    monkeypatch.setattr(loops_mod, "_submit", submit)

    def train_step(tr: treadle.TrainingClient, groups: list[Group]) -> dict[str, float]:
        trained.append([g.prompt for g in groups])
        if len(trained) == 4:
            release.set()  # "drop": the held group comes back after step 4, 4 versions old
        step = tr.optim_step(treadle.AdamParams(learning_rate=1e-9)).result(30).step
        return {"version": float(step)}

    stats = run_with_deadline(
        lambda: list(
            async_loop(
                trainer, latest(service, trainer), prompts(), reward, steps=7,
                groups_per_step=1, group_size=2, buffer_groups=2, max_staleness=2,
                on_stale=on_stale, sampling_params=PARAMS, train_step=train_step,
                timeout=30.0,
            )
        )
    )  # fmt: skip
    steps_with_it = [i + 1 for i, ps in enumerate(trained) if held[0] in ps]
    if on_stale == "wait":
        assert steps_with_it == [3]
        assert asked_after_steps == [2]  # waited for before step 3, not found finished
        assert sum(s.dropped_stale for s in stats) == 0
        assert all(max(s.staleness) <= 2 for s in stats)
    else:
        assert steps_with_it == []
        assert asked_after_steps and asked_after_steps[0] >= 4  # taken after it finished
        assert sum(s.dropped_stale for s in stats) == 2  # its two rollouts
