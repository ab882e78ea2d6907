"""Bad loss input (issue 3; DESIGN invariant 3, "nothing is lost silently").

A loss that needs an input the datum lacks, a config key the loss does not know, a
NaN or infinite advantage, weights of another length than the targets: each
answers INVALID_ARGUMENT with a message naming the key, through SDK -> gRPC ->
engine, and the gradient accumulated so far is unchanged. "Unchanged" is checked
by twins (float64, same seed): one model gets valid call, the bad calls, valid
call, optim_step; the other the valid calls only. Both steps must see the same
gradient norm and end at the same weights.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

import treadle
from treadle import rl

PPO = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}


def _rollout_data(tokenizer: treadle.Tokenizer, shift: int) -> list[treadle.Datum]:
    rollouts = []
    for i, (prompt, completion) in enumerate((("1+2=", "3"), ("4+5=", "9\n"), ("7*8=", "56"))):
        p, c = tokenizer.encode(prompt), tokenizer.encode(completion)
        rollouts.append(rl.Rollout(p, c, [-4.0 - 0.1 * (i + shift)] * len(c), reward=float(i)))
    return rl.build_datums(rollouts, rl.group_advantages([r.reward for r in rollouts], 3))


def _with(datum: treadle.Datum, **inputs: np.ndarray | None) -> treadle.Datum:
    """``datum`` with some inputs replaced (or removed, with None)."""
    changed = dict(datum.loss_fn_inputs)
    for key, value in inputs.items():
        if value is None:
            changed.pop(key)
        else:
            changed[key] = value
    return treadle.Datum(datum.model_input, changed)


def _nan_at(values: np.ndarray, index: int, bad: float) -> np.ndarray:
    out = np.array(values, dtype=np.float32)
    out[index] = bad
    return out


BadCall = tuple[str, Callable[[list[treadle.Datum]], list[treadle.Datum]], str, dict | None]

BAD_CALLS: list[BadCall] = [
    # (what, how the data is spoiled, loss, config) -> the error must name `what`
    ("loss_fn_inputs.advantages", lambda d: [_with(x, advantages=None) for x in d], "ppo", PPO),
    ("loss_fn_inputs.logprobs", lambda d: [_with(x, logprobs=None) for x in d], "ppo", PPO),
    (
        "loss_fn_inputs.weights",
        lambda d: [_with(x, weights=None) for x in d],
        "cross_entropy",
        None,
    ),
    ("loss_fn_config.clip_epsilon", lambda d: d, "ppo", {"clip_epsilon": 0.2}),
    (  # TRL's epsilon typed as ratio thresholds: would clip every token (issue 21)
        "loss_fn_config.clip_high_threshold",
        lambda d: d,
        "ppo",
        {"clip_low_threshold": 0.2, "clip_high_threshold": 0.2},
    ),
    ("loss_fn_config.kl_beta", lambda d: d, "cross_entropy", {"kl_beta": 0.1}),
    (
        "loss_fn_inputs.advantages",  # NaN on a completion token
        lambda d: [
            d[0],
            _with(d[1], advantages=_nan_at(d[1].loss_fn_inputs["advantages"], -1, np.nan)),
        ],
        "ppo",
        PPO,
    ),
    (
        "loss_fn_inputs.advantages",  # +inf, even on a prompt token whose weight is 0
        lambda d: [
            _with(d[0], advantages=_nan_at(d[0].loss_fn_inputs["advantages"], 0, np.inf)),
            *d[1:],
        ],
        "ppo",
        PPO,
    ),
    (
        "loss_fn_inputs.advantages",
        lambda d: [
            _with(x, advantages=_nan_at(x.loss_fn_inputs["advantages"], -1, -np.inf)) for x in d
        ],
        "importance_sampling",
        None,
    ),
    (
        "loss_fn_inputs.weights",  # one weight fewer than targets
        lambda d: [_with(d[0], weights=d[0].loss_fn_inputs["weights"][:-1]), *d[1:]],
        "ppo",
        PPO,
    ),
    (
        "loss_fn_inputs.weights",  # one weight more, for cross_entropy
        lambda d: [_with(d[0], weights=np.append(d[0].loss_fn_inputs["weights"], 0.5)), *d[1:]],
        "cross_entropy",
        None,
    ),
]


@pytest.mark.parametrize("mode", ["lora", "full"])
def test_bad_input_is_rejected_and_leaves_the_gradient(
    service: treadle.ServiceClient, mode: str
) -> None:
    def create() -> treadle.TrainingClient:
        if mode == "lora":
            return service.create_lora_training_client("tiny", rank=4, seed=9, dtype="float64")
        return service.create_training_client("tiny", seed=9, dtype="float64")

    spoiled, clean = create(), create()
    tokenizer = spoiled.get_tokenizer()
    first, second = _rollout_data(tokenizer, 0), _rollout_data(tokenizer, 1)

    outputs = [tc.forward_backward(first, "ppo", PPO).result() for tc in (spoiled, clean)]
    assert outputs[0].metrics["loss:sum"] == outputs[1].metrics["loss:sum"]
    for field, spoil, loss_fn, config in BAD_CALLS:
        with pytest.raises(treadle.InvalidArgumentError) as info:
            spoiled.forward_backward(spoil(first), loss_fn, config).result(timeout=30)
        assert info.value.code == "INVALID_ARGUMENT"
        assert field in str(info.value), (field, str(info.value))
    for tc in (spoiled, clean):
        tc.forward_backward(second, "ppo", PPO).result()

    adam = treadle.AdamParams(learning_rate=1e-2)
    step_spoiled, step_clean = spoiled.optim_step(adam).result(), clean.optim_step(adam).result()
    assert step_clean.metrics["grad_norm:value"] > 0
    assert step_spoiled.metrics["grad_norm:value"] == pytest.approx(
        step_clean.metrics["grad_norm:value"], rel=1e-12
    )
    probe = [_with(d, weights=None, advantages=None, logprobs=None) for d in first + second]
    after = [tc.forward_logprobs(probe).result().loss_fn_outputs for tc in (spoiled, clean)]
    for a, b in zip(*after, strict=True):
        np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=0, atol=1e-12)
    # the model is still usable and its seq_ids contiguous: every rejected call took one
    assert spoiled.get_info().next_seq_id == clean.get_info().next_seq_id + len(BAD_CALLS)
