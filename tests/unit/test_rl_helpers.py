"""treadle.rl against hand-checked values: advantages, datums, aggregation, staleness, KL."""

from __future__ import annotations

import math
import subprocess
import sys

import numpy as np
import pytest

from treadle.errors import InvalidArgumentError
from treadle.rl import (
    Rollout,
    build_datums,
    drop_stale,
    effective_group_rate,
    group_advantages,
    informative_groups,
    kl_k3,
    rollout_staleness,
    staleness_histogram,
    token_staleness,
)
from treadle.types import Datum, ModelInput, SampledSequence, VersionSpan

# --------------------------------------------------------------------------- advantages


def test_group_advantages_mean_baseline() -> None:
    assert group_advantages([1, 0, 1, 0], 4).tolist() == [0.5, -0.5, 0.5, -0.5]


def test_group_advantages_std_normalised() -> None:
    # population std of [1, 0, 1, 0] is 0.5: 0.5 / (0.5 + 1e-6) = 0.999998
    adv = group_advantages([1, 0, 1, 0], 4, normalize_std=True)
    assert adv.tolist() == pytest.approx([0.999998, -0.999998, 0.999998, -0.999998], abs=1e-9)
    assert np.abs(adv) == pytest.approx(np.ones(4), abs=1e-5)


@pytest.mark.parametrize("normalize_std", [False, True])
def test_group_advantages_uniform_group_is_zero(normalize_std: bool) -> None:
    assert group_advantages([1, 1, 1, 1], 4, normalize_std).tolist() == [0.0] * 4


def test_group_advantages_per_group() -> None:
    adv = group_advantages([3, 1, 2, 2], 2)
    assert adv.tolist() == [1.0, -1.0, 0.0, 0.0]


def test_informative_groups_and_rate() -> None:
    rewards = [1, 0, 1, 0, 1, 1, 1, 1, 0, 0, 0, 0]
    assert informative_groups(rewards, 4).tolist() == [True, False, False]
    assert effective_group_rate(rewards, 4) == pytest.approx(1 / 3)
    assert effective_group_rate([], 4) == 0.0


@pytest.mark.parametrize(
    ("rewards", "group_size", "field"),
    [([1, 0, 1], 2, "rewards"), ([1, 0], 0, "group_size"), ([1, float("nan")], 2, "rewards")],
)
def test_advantage_errors_name_the_field(rewards, group_size, field) -> None:
    with pytest.raises(InvalidArgumentError, match=f"^INVALID_ARGUMENT: {field}:"):
        group_advantages(rewards, group_size)


# --------------------------------------------------------------------------- datums


def test_build_datums_shift_and_mask_by_hand() -> None:
    rollout = Rollout(
        prompt_tokens=[10, 11, 12], completion_tokens=[20, 21], completion_logprobs=[-0.5, -0.25]
    )
    (datum,) = build_datums([rollout], [2.0], aggregation="sum")
    # full sequence 10 11 12 20 21: inputs drop the last token, targets drop the first
    assert datum.model_input.to_ints() == [10, 11, 12, 20]
    inputs = datum.loss_fn_inputs
    assert inputs["target_tokens"].tolist() == [11, 12, 20, 21]
    assert inputs["weights"].tolist() == [0.0, 0.0, 1.0, 1.0]
    assert inputs["logprobs"].tolist() == [0.0, 0.0, -0.5, -0.25]
    assert inputs["advantages"].tolist() == [0.0, 0.0, 2.0, 2.0]
    assert "ref_logprobs" not in inputs


def test_build_datums_one_token_prompt_and_ref_logprobs() -> None:
    rollout = Rollout([1], [7, 8, 9], [-1.0, -2.0, -3.0], ref_logprobs=[-1.5, -2.5, -3.5])
    (datum,) = build_datums([rollout], [-1.0], aggregation="sum", include_logprobs=False)
    assert datum.model_input.to_ints() == [1, 7, 8]
    assert datum.loss_fn_inputs["target_tokens"].tolist() == [7, 8, 9]
    assert datum.loss_fn_inputs["weights"].tolist() == [1.0, 1.0, 1.0]
    assert datum.loss_fn_inputs["ref_logprobs"].tolist() == [-1.5, -2.5, -3.5]
    assert "logprobs" not in datum.loss_fn_inputs


def _two_rollouts() -> list[Rollout]:
    return [
        Rollout([1, 2], [3, 4], [-0.1, -0.2]),  # 2 completion tokens
        Rollout([1], [5, 6, 7, 8], [-0.3, -0.4, -0.5, -0.6]),  # 4 completion tokens
    ]


def _completion_weights(datums: list[Datum]) -> list[list[float]]:
    return [d.loss_fn_inputs["weights"][d.loss_fn_inputs["weights"] != 0].tolist() for d in datums]


@pytest.mark.parametrize(
    ("aggregation", "loss_constant", "expected"),
    [
        ("token_mean", None, [[1 / 6] * 2, [1 / 6] * 4]),  # 6 tokens in the step
        ("seq_mean_token_mean", None, [[1 / 4] * 2, [1 / 8] * 4]),  # 1/(C_i · 2 sequences)
        ("token_sum_constant", 8.0, [[1 / 8] * 2, [1 / 8] * 4]),
        ("sum", None, [[1.0] * 2, [1.0] * 4]),
    ],
)
def test_aggregation_weights(aggregation, loss_constant, expected) -> None:
    datums = build_datums(
        _two_rollouts(), [1.0, -1.0], aggregation=aggregation, loss_constant=loss_constant
    )
    got = _completion_weights(datums)
    for row, want in zip(got, expected, strict=True):
        assert row == pytest.approx(want)
    # advantages are never scaled: the denominator lives in the weights only
    assert (
        datums[1].loss_fn_inputs["advantages"].tolist() == [-1.0] * 4
    )  # 1-token prompt: all completion


def _summed_loss(datums: list[Datum], per_token_loss: dict[int, np.ndarray]) -> float:
    """What the server does: Σ_t w_t · ℓ_t, no denominator."""
    return float(
        sum(
            (d.loss_fn_inputs["weights"].astype(np.float64) * per_token_loss[i]).sum()
            for i, d in enumerate(datums)
        )
    )


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean", "sum"])
def test_minibatches_sum_to_the_single_batch(aggregation: str) -> None:
    rollouts = [Rollout([1, 2], [3] * n, [-0.5] * n) for n in (1, 2, 3, 6)]
    datums = build_datums(rollouts, [1.0, 0.0, -1.0, 2.0], aggregation=aggregation)
    rng = np.random.default_rng(0)
    loss_T = {i: rng.normal(size=len(d.model_input)) for i, d in enumerate(datums)}
    whole = _summed_loss(datums, loss_T)
    first = _summed_loss(datums[:1], {0: loss_T[0]})
    rest = _summed_loss(datums[1:], {i - 1: loss_T[i] for i in range(1, 4)})
    assert first + rest == pytest.approx(whole)


def test_token_mean_is_the_mean_over_all_completion_tokens_of_the_step() -> None:
    rollouts = _two_rollouts()
    datums = build_datums(rollouts, [1.0, 1.0])
    per_token = {0: np.array([0.0, 1.0, 2.0]), 1: np.array([3.0, 4.0, 5.0, 6.0])}
    # completion positions hold 1, 2 (rollout 0) and 3, 4, 5, 6 (rollout 1): mean 21 / 6
    assert _summed_loss(datums, per_token) == pytest.approx(21 / 6)
    # whereas normalising each minibatch on its own weighs the short one more: (1.5 + 4.5) != 3.5
    separately = build_datums(rollouts[:1], [1.0]) + build_datums(rollouts[1:], [1.0])
    assert _summed_loss(separately, per_token) == pytest.approx(6.0)


def test_minibatches_through_the_ppo_loss_match_one_call() -> None:
    torch = pytest.importorskip("torch")
    from treadle.workers.trainer.losses import LossBatch, compute_loss

    rollouts = [Rollout([1, 2], [3] * n, [-0.7] * n) for n in (1, 2, 5)]
    datums = build_datums(rollouts, [1.0, -0.5, 2.0])
    rng = np.random.default_rng(1)
    current = [torch.tensor(rng.normal(-0.7, 0.3, len(d.model_input))) for d in datums]

    def call(indices: list[int]) -> float:
        logp = torch.cat([current[i] for i in indices])
        inputs = {
            k: torch.cat(
                [torch.tensor(datums[i].loss_fn_inputs[k], dtype=torch.float64) for i in indices]
            )
            for k in ("weights", "logprobs", "advantages")
        }
        return compute_loss("ppo", LossBatch(logp, inputs), {}).loss.item()

    assert call([0]) + call([1, 2]) == pytest.approx(call([0, 1, 2]))


def test_rollout_from_sequence_carries_versions() -> None:
    seq = SampledSequence(
        tokens=[5, 6, 7],
        logprobs=[-0.1, -0.2, -0.3],
        stop_reason="stop",
        versions=[VersionSpan(0, 2, 3), VersionSpan(2, 1, 4)],
    )
    rollout = Rollout.from_sequence(ModelInput.from_ints([1, 2]), seq, reward=1.0)
    assert rollout.prompt_tokens == (1, 2)
    assert rollout.token_versions() == [3, 3, 4]
    assert rollout.reward == 1.0


@pytest.mark.parametrize(
    ("build", "field"),
    [
        (lambda: build_datums([Rollout([1], [2], [-0.1])], [1.0, 2.0]), "advantages"),
        (lambda: build_datums([Rollout([1], [2], [-0.1])], [float("nan")]), "advantages"),
        (lambda: build_datums([Rollout([], [2], [-0.1])], [1.0]), r"rollouts\[0\].prompt_tokens"),
        (
            lambda: build_datums([Rollout([1], [2], [-0.1])], [1.0], aggregation="mean"),
            "aggregation",
        ),
        (
            lambda: build_datums(
                [Rollout([1], [2], [-0.1])], [1.0], aggregation="token_sum_constant"
            ),
            "loss_constant",
        ),
        (
            lambda: build_datums([Rollout([1], [2], [-0.1])], [1.0], loss_constant=4.0),
            "loss_constant",
        ),
        (
            lambda: build_datums(
                [Rollout([1], [2], [-0.1], ref_logprobs=[-0.2]), Rollout([1], [2], [-0.1])],
                [1.0, 1.0],
            ),
            r"rollouts\[1\].ref_logprobs",
        ),
        (lambda: Rollout([1], [2, 3], [-0.1]), "rollout.completion_logprobs"),
        (lambda: Rollout([1], [2, 3], [-0.1, -0.2], versions=[4]), "rollout.versions"),
        (lambda: Rollout([1], [2], [-0.1], ref_logprobs=[float("inf")]), "rollout.ref_logprobs"),
    ],
)
def test_datum_errors_name_the_field(build, field) -> None:
    with pytest.raises(InvalidArgumentError, match=f"^INVALID_ARGUMENT: {field}"):
        build()


# --------------------------------------------------------------------------- staleness


def _rollout(versions) -> Rollout:
    n = (
        sum(s.length for s in versions)
        if versions and isinstance(versions[0], VersionSpan)
        else len(versions)
    )
    return Rollout([1], [2] * n, [-0.1] * n, versions=versions)


R0 = _rollout([VersionSpan(0, 2, 5)])  # staleness 2 at version 7
R1 = _rollout([VersionSpan(0, 1, 3), VersionSpan(1, 2, 6)])  # tokens 4, 1, 1 -> 4
R2 = _rollout([7, 7])  # 0


def test_token_and_rollout_staleness() -> None:
    assert token_staleness(R1.versions, 7).tolist() == [4, 1, 1]
    assert token_staleness([7, 6, 5], 7).tolist() == [0, 1, 2]
    assert [rollout_staleness(r, 7) for r in (R0, R1, R2)] == [2, 4, 0]
    assert rollout_staleness(Rollout([1], [], []), 7) == 0


@pytest.mark.parametrize(
    ("max_staleness", "kept", "dropped"),
    [(0, [R2], 2), (1, [R2], 2), (2, [R0, R2], 1), (3, [R0, R2], 1), (4, [R0, R1, R2], 0)],
)
def test_drop_stale_exact(max_staleness: int, kept: list[Rollout], dropped: int) -> None:
    assert drop_stale([R0, R1, R2], 7, max_staleness) == (kept, dropped)


def test_drop_stale_rejects_negative_bound() -> None:
    with pytest.raises(InvalidArgumentError, match="^INVALID_ARGUMENT: max_staleness:"):
        drop_stale([R0], 7, -1)


def test_staleness_histogram() -> None:
    assert staleness_histogram([R0, R1, R2], 7) == {0: 1, 2: 1, 4: 1}
    assert staleness_histogram([R0, R1, R2], 7, per_token=True) == {0: 2, 1: 2, 2: 2, 4: 1}


@pytest.mark.parametrize(
    ("call", "field"),
    [
        (lambda: token_staleness([8], 7), "versions"),
        (
            lambda: token_staleness([VersionSpan(0, 1, 1), VersionSpan(2, 1, 1)], 7),
            r"versions\[1\]",
        ),
        (lambda: token_staleness([1], -1), "current_version"),
        (lambda: rollout_staleness(Rollout([1], [2], [-0.1]), 7), "rollout.versions"),
    ],
)
def test_staleness_errors_name_the_field(call, field) -> None:
    with pytest.raises(InvalidArgumentError, match=f"^INVALID_ARGUMENT: {field}"):
        call()


# --------------------------------------------------------------------------- kl


def test_kl_k3_values() -> None:
    logp = np.array([-1.0, -1.0, -1.0])
    ref = logp + np.array([math.log(2.0), 0.0, -math.log(2.0)])
    # e^x - x - 1 at x = ln 2, 0, -ln 2
    assert kl_k3(logp, ref).tolist() == pytest.approx([0.3068528194, 0.0, 0.1931471806])


def test_rl_does_not_import_torch() -> None:
    code = "import sys, treadle.rl; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_merge_metrics_combines_calls_by_their_reduction() -> None:
    from treadle.rl import merge_metrics

    calls = [
        {"loss:sum": 1.0, "ntokens:sum": 1.0, "clip_frac:mean": 0.0, "ratio:max": 1.1},
        {"loss:sum": 2.0, "ntokens:sum": 3.0, "clip_frac:mean": 0.4, "ratio:max": 1.3},
        {"grad_norm:value": 0.5},
        {"grad_norm:value": 0.7, "ratio:min": 0.9},
    ]
    m = merge_metrics(calls)
    assert m["loss:sum"] == 3.0 and m["ntokens:sum"] == 4.0
    assert m["clip_frac:mean"] == pytest.approx(0.3)  # a token mean over the step: (0*1 + .4*3)/4
    assert m["ratio:max"] == 1.3 and m["ratio:min"] == 0.9
    assert m["grad_norm:value"] == 0.7  # the last call's
    assert merge_metrics([]) == {}
