"""Custom losses without shipping code (issue 3): ``forward_backward_custom(data, loss_fn)``.

The SDK runs ``forward_logprobs``, evaluates the user's torch function on the
client and sends ``cross_entropy`` with weights ``-dL/dlogprob``. Checked here by
twins: two models created alike (same seed, float64), one trained with a
built-in loss or with hand-computed weights, the other with the same loss written
as a torch function; after ``optim_step`` both must hold the same weights (their
logprobs agree to 1e-10), and the optimizer saw the same gradient norm.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

import treadle
from treadle import rl

ADAM = treadle.AdamParams(learning_rate=1e-2)
TEXTS = ("12+3=15", "4+4=8", "20-7=13", "6*7=42")


def _twins(
    service: treadle.ServiceClient, seed: int
) -> tuple[treadle.TrainingClient, treadle.TrainingClient]:
    return tuple(  # type: ignore[return-value]
        service.create_lora_training_client("tiny", rank=4, seed=seed, dtype="float64")
        for _ in range(2)
    )


def _sft_data(tokenizer: treadle.Tokenizer) -> list[treadle.Datum]:
    data = []
    for text in TEXTS:
        seq = tokenizer.encode(text)
        weights = np.zeros(len(seq) - 1)
        weights[text.index("=") :] = 0.25
        data.append(
            treadle.Datum(
                model_input=treadle.ModelInput.from_ints(seq[:-1]),
                loss_fn_inputs={"target_tokens": seq[1:], "weights": weights},
            )
        )
    return data


def _probe(tc: treadle.TrainingClient, data: list[treadle.Datum]) -> np.ndarray:
    """The model's logprobs on ``data``: equal weights give equal logprobs."""
    targets = [
        treadle.Datum(d.model_input, {"target_tokens": d.loss_fn_inputs["target_tokens"]})
        for d in data
    ]
    out = tc.forward_logprobs(targets).result()
    return np.concatenate([o.logprobs for o in out.loss_fn_outputs])


def _assert_same_step(
    a: treadle.TrainingClient, b: treadle.TrainingClient, data: list[treadle.Datum]
) -> None:
    step_a, step_b = a.optim_step(ADAM).result(), b.optim_step(ADAM).result()
    assert step_a.metrics["grad_norm:value"] > 0
    assert step_b.metrics["grad_norm:value"] == pytest.approx(
        step_a.metrics["grad_norm:value"], rel=1e-10
    )
    np.testing.assert_allclose(_probe(b, data), _probe(a, data), rtol=0, atol=1e-10)


def test_custom_cross_entropy_equals_builtin(service: treadle.ServiceClient) -> None:
    a, b = _twins(service, seed=3)
    data = _sft_data(a.get_tokenizer())
    builtin = a.forward_backward(data, "cross_entropy").result()

    def nll(batch: list[treadle.Datum], logprobs: list[torch.Tensor]) -> tuple:
        loss = sum(
            -(torch.as_tensor(d.loss_fn_inputs["weights"]) * lp).sum()
            for d, lp in zip(batch, logprobs, strict=True)
        )
        return loss, {"tokens:sum": float(sum(len(lp) for lp in logprobs))}

    custom = b.forward_backward_custom(data, nll).result()
    assert custom.metrics["loss:sum"] == pytest.approx(builtin.metrics["loss:sum"], rel=1e-12)
    assert custom.metrics["tokens:sum"] == sum(len(d.model_input) for d in data)
    for out_a, out_b in zip(builtin.loss_fn_outputs, custom.loss_fn_outputs, strict=True):
        assert out_b.logprobs.dtype == np.float64
        np.testing.assert_allclose(out_b.logprobs, out_a.logprobs, rtol=0, atol=1e-12)
    _assert_same_step(a, b, data)


def _ppo_data(
    tc: treadle.TrainingClient, seed: int
) -> tuple[list[treadle.Datum], dict[str, float]]:
    """Sampled rollouts whose behaviour logprobs are moved off the current policy, so
    that the ratio leaves the clip range on some tokens (both branches of the min)."""
    tokenizer = tc.get_tokenizer()
    sampler = tc.sync_weights()
    params = treadle.SamplingParams(max_tokens=8, seed=seed)
    rng = np.random.default_rng(seed)
    rollouts = []
    for prompt in ("1+2=", "34+5="):
        prompt_tokens = tokenizer.encode(prompt)
        for seq in sampler.sample(prompt_tokens, 4, params).result().sequences:
            behaviour = np.asarray(seq.logprobs) + rng.normal(0.0, 0.3, len(seq.logprobs))
            rollouts.append(
                rl.Rollout(prompt_tokens, seq.tokens, behaviour, reward=float(rng.normal()))
            )
    advantages = rl.group_advantages([r.reward for r in rollouts], 4)
    return rl.build_datums(rollouts, advantages), {
        "clip_low_threshold": 0.8,
        "clip_high_threshold": 1.28,
    }


def test_custom_ppo_equals_builtin_ppo(service: treadle.ServiceClient) -> None:
    """A nonlinear loss (exp, clip, min) written in torch trains exactly like the
    server's ``ppo`` (docs/losses.md); the loss function reads the datums' own inputs."""
    a, b = _twins(service, seed=4)
    data, config = _ppo_data(a, seed=5)
    low, high = config["clip_low_threshold"], config["clip_high_threshold"]
    builtin = a.forward_backward(data, "ppo", config).result()
    assert 0 < builtin.metrics["clip_frac:mean"] < 1

    def ppo(batch: list[treadle.Datum], logprobs: list[torch.Tensor]) -> tuple:
        total, clipped, counted = torch.zeros((), dtype=torch.float64), 0, 0
        for d, lp in zip(batch, logprobs, strict=True):
            inputs = {
                k: torch.as_tensor(v, dtype=torch.float64) for k, v in d.loss_fn_inputs.items()
            }
            w, adv = inputs["weights"], inputs["advantages"]
            carries = w != 0
            ratio = torch.exp(torch.where(carries, lp - inputs["logprobs"], torch.zeros_like(lp)))
            total = total - (w * torch.minimum(ratio * adv, ratio.clamp(low, high) * adv)).sum()
            clipped += int(((ratio < low) | (ratio > high))[carries].sum())
            counted += int(carries.sum())
        return total, {"my_clip_frac:mean": clipped / counted}

    custom = b.forward_backward_custom(data, ppo).result()
    assert custom.metrics["loss:sum"] == pytest.approx(builtin.metrics["loss:sum"], rel=1e-10)
    assert custom.metrics["my_clip_frac:mean"] == pytest.approx(builtin.metrics["clip_frac:mean"])
    _assert_same_step(a, b, data)


def test_sequence_level_loss(service: treadle.ServiceClient) -> None:
    """A loss that is no per-token sum: L = Σ_i c_i·S_i²/2 with S_i the masked sum of
    sequence i's logprobs, so dL/dlogp_it = c_i·S_i·m_it. The twin gets the same
    gradient from cross_entropy with those weights, computed by hand."""
    a, b = _twins(service, seed=6)
    tokenizer = a.get_tokenizer()
    coef = [0.5, -0.25, 1.0, 0.125]
    data = []
    for text in TEXTS:
        seq = tokenizer.encode(text)
        mask = np.zeros(len(seq) - 1)
        mask[text.index("=") :] = 1.0
        # "mask" is an input no server loss knows: it stays on the client
        data.append(
            treadle.Datum(
                model_input=treadle.ModelInput.from_ints(seq[:-1]),
                loss_fn_inputs={"target_tokens": seq[1:], "mask": mask},
            )
        )

    def seq_loss(batch: list[treadle.Datum], logprobs: list[torch.Tensor]) -> tuple:
        sums = [
            (torch.as_tensor(d.loss_fn_inputs["mask"]) * lp).sum()
            for d, lp in zip(batch, logprobs, strict=True)
        ]
        loss = sum(c * s**2 / 2 for c, s in zip(coef, sums, strict=True))
        return loss, {"seq_logprob:mean": torch.stack(sums).mean()}

    custom = b.forward_backward_custom(data, seq_loss).result()

    lp = [o.logprobs for o in a.forward_logprobs(data).result().loss_fn_outputs]
    sums = [float((d.loss_fn_inputs["mask"] * p).sum()) for d, p in zip(data, lp, strict=True)]
    expected_loss = sum(c * s**2 / 2 for c, s in zip(coef, sums, strict=True))
    assert custom.metrics["loss:sum"] == pytest.approx(expected_loss, rel=1e-12)
    assert custom.metrics["seq_logprob:mean"] == pytest.approx(np.mean(sums), rel=1e-12)
    hand = [
        treadle.Datum(
            d.model_input,
            {
                "target_tokens": d.loss_fn_inputs["target_tokens"],
                "weights": -c * s * d.loss_fn_inputs["mask"],
            },
        )
        for d, c, s in zip(data, coef, sums, strict=True)
    ]
    a.forward_backward(hand, "cross_entropy").result()
    _assert_same_step(a, b, data)


def test_async_alias_and_temperature(service: treadle.ServiceClient) -> None:
    """``forward_backward_custom_async`` gives what the blocking call gives; the
    temperature reaches both the forward and the backward."""
    a, b = _twins(service, seed=7)
    data = _sft_data(a.get_tokenizer())

    def nll(batch: list[treadle.Datum], logprobs: list[torch.Tensor]) -> tuple:
        loss = sum(
            -(torch.as_tensor(d.loss_fn_inputs["weights"]) * lp).sum()
            for d, lp in zip(batch, logprobs, strict=True)
        )
        return loss, {}

    builtin = a.forward_backward(data, "cross_entropy", temperature=0.7).result()
    custom = asyncio.run(b.forward_backward_custom_async(data, nll, temperature=0.7))
    assert custom.metrics["loss:sum"] == pytest.approx(builtin.metrics["loss:sum"], rel=1e-12)
    _assert_same_step(a, b, data)


def test_failing_loss_fn_leaves_no_gap(service: treadle.ServiceClient) -> None:
    """A loss_fn that raises, or returns no scalar, fails the call on the client; the
    backward was never sent, so no seq_id is left missing and no gradient is added."""
    a, b = _twins(service, seed=8)
    data = _sft_data(a.get_tokenizer())

    def broken(batch: list[treadle.Datum], logprobs: list[torch.Tensor]) -> tuple:
        raise ZeroDivisionError("user bug")

    def not_scalar(batch: list[treadle.Datum], logprobs: list[torch.Tensor]) -> tuple:
        return torch.cat(logprobs), {}

    with pytest.raises(ZeroDivisionError):
        b.forward_backward_custom(data, broken)
    with pytest.raises(treadle.InvalidArgumentError, match="loss_fn"):
        b.forward_backward_custom(data, not_scalar)
    with pytest.raises(treadle.InvalidArgumentError, match="target_tokens"):
        b.forward_backward_custom([treadle.Datum(data[0].model_input, {})], not_scalar)

    a.forward_backward(data, "cross_entropy").result()
    t0 = time.monotonic()
    b.forward_backward(data, "cross_entropy").result(timeout=20)
    assert time.monotonic() - t0 < 10  # not stuck behind a missing seq_id
    _assert_same_step(a, b, data)


def test_sdk_imports_without_torch() -> None:
    """torch is needed for this call only: the SDK imports without it, and the call
    says what is missing."""
    code = """
import sys
sys.modules["torch"] = None  # import torch now raises ImportError
import numpy as np
import treadle
from treadle import custom_loss
out = treadle.ForwardBackwardOutput([treadle.LossFnOutput(np.zeros(2))], {})
try:
    custom_loss.evaluate([], out, lambda d, lp: (0, {}))
except ImportError as err:
    assert "torch" in str(err), err
    print("ok")
"""
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
