"""Episodes as training data: the mask (observations weight 0), versions, advantages."""

from __future__ import annotations

import pytest

from treadle.errors import InvalidArgumentError
from treadle.rl import (
    Episode,
    EpisodeLimits,
    EpisodeTurn,
    Group,
    Prompt,
    build_datums,
    grpo_train_step,
    rollout_staleness,
)


def turn(obs: list[int], toks: list[int], version: int, reward: float = 0.0) -> EpisodeTurn:
    return EpisodeTurn(
        observation=tuple(obs),
        tokens=tuple(toks),
        logprobs=tuple(-0.5 - 0.1 * i for i in range(len(toks))),
        versions=(version,) * len(toks),
        stop_reason="stop",
        reward=reward,
    )


def episode(reward: float = 1.0) -> Episode:
    # obs0=[1,2,3] act0=[4,5] obs1=[6,7,8] act1=[9]
    return Episode(
        "episode 0.0",
        [turn([1, 2, 3], [4, 5], 3), turn([6, 7, 8], [9], 4, reward)],
        done=True,
    )


def test_observation_tokens_carry_weight_zero() -> None:
    ep = episode()
    assert ep.tokens() == [1, 2, 3, 4, 5, 6, 7, 8, 9]
    rollout = ep.to_rollout()
    assert rollout.prompt_tokens == (1, 2, 3)
    assert rollout.mask == (1.0, 1.0, 0.0, 0.0, 0.0, 1.0)
    assert rollout.trained_tokens == 3
    (datum,) = build_datums([rollout], [2.0])
    targets = datum.loss_fn_inputs["target_tokens"]
    weights = datum.loss_fn_inputs["weights"]
    adv = datum.loss_fn_inputs["advantages"]
    logprobs = datum.loss_fn_inputs["logprobs"]
    assert list(datum.model_input.tokens) == [1, 2, 3, 4, 5, 6, 7, 8]
    assert list(targets) == [2, 3, 4, 5, 6, 7, 8, 9]
    model_targets = {4, 5, 9}
    for t, w, a, lp in zip(targets, weights, adv, logprobs, strict=True):
        if t in model_targets:  # token mean over the 3 model tokens
            assert w == pytest.approx(1 / 3) and a == 2.0 and lp < 0
        else:  # the prompt and the tool's output: nothing trained on
            assert w == 0.0 and a == 0.0 and lp == 0.0
    # the sampler's logprobs land on the model's tokens, in order
    assert list(logprobs[[2, 3, 7]]) == pytest.approx([-0.5, -0.6, -0.5])


def test_versions_per_token_and_staleness_follow_the_turns() -> None:
    rollout = episode().to_rollout()
    # act0 by version 3, obs1 answers act0 (3), act1 by version 4
    assert rollout.token_versions() == [3, 3, 3, 3, 3, 4]
    assert rollout_staleness(rollout, 5) == 2  # its oldest model token


def test_group_advantages_over_episodes_of_unequal_groups() -> None:
    ok = [episode(1.0), episode(0.0), episode(0.0)]
    two = [episode(1.0), episode(0.0)]  # a group whose third episode failed
    groups = [
        Group(Prompt(()), [e.to_rollout() for e in ok], episodes=ok),
        Group(Prompt(()), [e.to_rollout() for e in two], episodes=two),
    ]
    prepared = grpo_train_step(minibatches=1).prepare(groups)
    (datums, n) = prepared[0]
    assert n == 5
    inputs = [d.loss_fn_inputs for d in datums]
    advs = sorted(float(x["advantages"][x["weights"] > 0][0]) for x in inputs)
    assert advs == pytest.approx(sorted([2 / 3, -1 / 3, -1 / 3, 0.5, -0.5]))


def test_a_failed_episode_is_not_a_rollout() -> None:
    failed = Episode(
        "episode 2.1", [turn([1], [4], 0)], error="turns[1].reward: nan is not a finite number"
    )
    with pytest.raises(InvalidArgumentError, match=r"episode 2.1: turns\[1\].reward"):
        failed.to_rollout()
    with pytest.raises(InvalidArgumentError, match="has no turns"):
        Episode("episode 0.0").to_rollout()


def test_mask_must_be_zero_or_one() -> None:
    from treadle.rl import Rollout

    with pytest.raises(InvalidArgumentError, match="rollout.mask"):
        Rollout([1], [2, 3], [-1.0, -1.0], mask=[1.0, 0.5])
    with pytest.raises(InvalidArgumentError, match="rollout.mask"):
        Rollout([1], [2, 3], [-1.0, -1.0], mask=[1.0])


def test_limits_are_checked() -> None:
    with pytest.raises(InvalidArgumentError, match="limits.max_turns"):
        EpisodeLimits(max_turns=0)
    with pytest.raises(InvalidArgumentError, match="limits.context_limit"):
        EpisodeLimits(context_limit=-1)
