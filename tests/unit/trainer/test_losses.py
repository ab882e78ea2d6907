"""The loss registry against numbers worked out by hand.

Each example picks the current log-probs ``logp`` and the ratios ``r`` it
wants, and sets the behaviour log-probs to ``logp - ln r``; the expected
losses and gradients below are written out, not recomputed with the formulas
under test.
"""

from __future__ import annotations

import math

import pytest
import torch

from treadle.errors import InvalidArgumentError
from treadle.workers.trainer.losses import (
    LOSSES,
    LossBatch,
    compute_loss,
    needs_reference,
    validate_loss_request,
)

F64 = torch.float64


def t(values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=F64)


def leaf(values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=F64, requires_grad=True)


def behaviour(logp: torch.Tensor, ratios: list[float]) -> torch.Tensor:
    """Behaviour log-probs that make ``exp(logp - behaviour)`` equal ``ratios``."""
    return logp.detach() - torch.log(t(ratios))


def run(name: str, logp: torch.Tensor, inputs: dict[str, torch.Tensor], config=None, entropy=None):
    result = compute_loss(name, LossBatch(logp, inputs, entropy), config or {})
    result.loss.backward()
    return result


# --------------------------------------------------------------------------- values


def test_registry_names_and_tinker_defaults() -> None:
    assert set(LOSSES) == {"cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "gspo"}
    assert LOSSES["ppo"].config_defaults["clip_low_threshold"] == 0.8
    assert LOSSES["ppo"].config_defaults["clip_high_threshold"] == 1.2
    assert LOSSES["cispo"].config_defaults["clip_low_threshold"] == 0.0
    assert LOSSES["cispo"].config_defaults["clip_high_threshold"] == 4.0
    assert LOSSES["dro"].config_defaults["beta"] == 0.05
    for name in ("importance_sampling", "ppo", "cispo", "dro", "gspo"):
        assert LOSSES[name].config_defaults["kl_beta"] == 0.0


def test_cross_entropy() -> None:
    logp = leaf([-1.0, -2.0, -0.5])
    res = run("cross_entropy", logp, {"weights": t([1.0, 0.0, 2.0])}, entropy=t([0.3, 9.0, 0.5]))
    assert res.loss.item() == pytest.approx(2.0)  # 1·1 + 0·2 + 2·0.5
    assert logp.grad.tolist() == pytest.approx([-1.0, 0.0, -2.0])
    assert res.metrics["loss:sum"] == pytest.approx(2.0)
    assert res.metrics["ntokens:sum"] == 2.0
    assert res.metrics["entropy:mean"] == pytest.approx(0.4)  # the weight-0 token is excluded


def test_cross_entropy_signed_weights_count_as_tokens() -> None:
    # forward_backward_custom sends weights = -dLoss/dlogprob, which can be negative.
    res = run("cross_entropy", leaf([-1.0, -2.0]), {"weights": t([0.5, -1.0])})
    assert res.loss.item() == pytest.approx(0.5 - 2.0)
    assert res.metrics["ntokens:sum"] == 2.0


def test_importance_sampling() -> None:
    logp = leaf([-0.5, -1.0, -2.0])
    inputs = {"logprobs": behaviour(logp, [1.5, 0.5, 1.0]), "advantages": t([2.0, -1.0, 3.0])}
    res = run("importance_sampling", logp, inputs)
    # -(1.5·2) - (0.5·-1) - (1·3) = -3 + 0.5 - 3
    assert res.loss.item() == pytest.approx(-5.5)
    assert logp.grad.tolist() == pytest.approx([-3.0, 0.5, -3.0])  # d(-r·A)/dlogp = -r·A
    m = res.metrics
    assert (m["ratio:mean"], m["ratio:min"], m["ratio:max"]) == pytest.approx((1.0, 0.5, 1.5))
    # k3 = r - 1 - ln r: 0.0945348919, 0.1931471806, 0
    assert m["approx_kl:mean"] == pytest.approx(0.0958940242)
    assert "clip_frac:mean" not in m


def test_importance_sampling_ratio_cap_bounds_but_keeps_gradient() -> None:
    logp = leaf([-0.5, -1.0, -2.0])
    inputs = {"logprobs": behaviour(logp, [1.5, 0.5, 1.0]), "advantages": t([2.0, -1.0, 3.0])}
    res = run("importance_sampling", logp, inputs, {"ratio_cap": 1.2})
    # value -min(r, 1.2)·A: -2.4 + 0.5 - 3
    assert res.loss.item() == pytest.approx(-4.9)
    # gradient -min(r, 1.2)·A: the capped token keeps coefficient 1.2, not 0
    assert logp.grad.tolist() == pytest.approx([-2.4, 0.5, -3.0])
    assert res.metrics["clip_frac:mean"] == pytest.approx(1 / 3)


def test_ppo_clipped_surrogate() -> None:
    logp = leaf([-0.5, -1.0, -2.0, -0.3])
    inputs = {
        "logprobs": behaviour(logp, [1.5, 0.5, 1.0, 1.5]),
        "advantages": t([2.0, -1.0, 3.0, -1.0]),
    }
    res = run("ppo", logp, inputs)
    # token 0: min(3, 1.2·2=2.4) = 2.4        -> -2.4, clipped branch, grad 0
    # token 1: min(-0.5, 0.8·-1=-0.8) = -0.8  ->  0.8, clipped branch, grad 0
    # token 2: r = 1 inside                   -> -3,   grad -r·A = -3
    # token 3: min(-1.5, 1.2·-1=-1.2) = -1.5  ->  1.5, unclipped branch, grad 1.5
    assert res.loss.item() == pytest.approx(-2.4 + 0.8 - 3.0 + 1.5)
    assert logp.grad.tolist() == pytest.approx([0.0, 0.0, -3.0, 1.5])
    # tokens 0, 1, 3 have a ratio outside [0.8, 1.2] (token 3 although its gradient survives)
    assert res.metrics["clip_frac:mean"] == pytest.approx(0.75)


def test_ppo_clip_fraction_asymmetric_bounds() -> None:
    logp = leaf([-1.0, -1.0, -1.0, -1.0])
    inputs = {"logprobs": behaviour(logp, [1.25, 1.3, 0.79, 0.81]), "advantages": t([1.0] * 4)}
    dapo = compute_loss("ppo", LossBatch(logp, inputs), {"clip_high_threshold": 1.28})
    assert dapo.metrics["clip_frac:mean"] == pytest.approx(0.5)  # 1.3 and 0.79 are out
    symmetric = compute_loss("ppo", LossBatch(logp, inputs), {})
    assert symmetric.metrics["clip_frac:mean"] == pytest.approx(0.75)  # 1.25 is out too


def test_clip_fraction_ignores_prompt_tokens() -> None:
    logp = leaf([-1.0, -1.0, -1.0])
    inputs = {
        "logprobs": behaviour(logp, [5.0, 1.0, 1.5]),
        "advantages": t([0.0, 1.0, 1.0]),
        "weights": t([0.0, 1.0, 1.0]),
    }
    res = compute_loss("ppo", LossBatch(logp, inputs), {})
    assert res.metrics["clip_frac:mean"] == pytest.approx(0.5)
    assert res.metrics["ratio:max"] == pytest.approx(1.5)
    assert res.metrics["ntokens:sum"] == 2.0


@pytest.mark.parametrize("name", ["importance_sampling", "ppo", "cispo", "dro", "gspo"])
def test_without_weights_metrics_count_the_tokens_with_an_advantage(name: str) -> None:
    """As the tinker SDK sends a policy loss: no weights; the prompt positions carry
    advantage 0 and a placeholder sampler logprob 0. The ratio, KL, clip and
    entropy metrics describe the two completion tokens only (ratios 1.0 and 1.1),
    not the prompt's exp(-3) ratios; the loss still sums over every token."""
    logp = leaf([-3.0, -3.0, -1.0, -2.0])
    completion = behaviour(logp, [1.0, 1.0, 1.0, 1.1])[2:]
    inputs = {
        "logprobs": torch.cat([t([0.0, 0.0]), completion]),
        "advantages": t([0.0, 0.0, 1.0, -1.0]),
    }
    entropy = t([9.0, 9.0, 2.0, 4.0])
    res = run(name, logp, inputs, entropy=entropy)
    ratio = 1.1 if name != "gspo" else math.sqrt(1.1)  # GSPO: the sequence's ratio
    if name != "gspo":
        assert res.metrics["ratio:mean"] == pytest.approx((1.0 + ratio) / 2)
        assert res.metrics["ratio:min"] == pytest.approx(1.0)
    assert res.metrics["ratio:max"] == pytest.approx(ratio, rel=1e-6)
    assert res.metrics["entropy:mean"] == pytest.approx(3.0)
    assert res.metrics["ntokens:sum"] == 4.0
    if name != "gspo":
        k3 = 1.1 - math.log(1.1) - 1  # exp(x) - x - 1, x = log(current / behaviour)
        assert res.metrics["approx_kl:mean"] == pytest.approx(k3 / 2, rel=1e-6)
    if "clip_frac:mean" in res.metrics:  # GSPO's clip range (1 +- 4e-4) holds no 1.049
        assert res.metrics["clip_frac:mean"] == (1.0 if name == "gspo" else 0.0)
    # With weights given, the weights decide (here: every token counts).
    weighted = run(name, leaf([-3.0, -3.0, -1.0, -2.0]), {**inputs, "weights": t([1.0] * 4)})
    assert weighted.metrics["ratio:min"] < 0.5


def test_cispo() -> None:
    logp = leaf([-0.5, -1.0, -2.0, -0.25])
    inputs = {
        "logprobs": behaviour(logp, [1.5, 0.5, 1.0, 5.0]),
        "advantages": t([2.0, -1.0, 3.0, 1.0]),
    }
    res = run("cispo", logp, inputs)
    # coef = clip(r, 0, 4) = [1.5, 0.5, 1, 4]; -coef·A·logp = 1.5, -0.5, 6, 1
    assert res.loss.item() == pytest.approx(8.0)
    # the clipped ratio is a constant: d/dlogp = -coef·A, never zero
    assert logp.grad.tolist() == pytest.approx([-3.0, 0.5, -3.0, -4.0])
    assert res.metrics["clip_frac:mean"] == pytest.approx(0.25)


def test_dro() -> None:
    logp = leaf([-0.5, -1.0, -2.0])
    inputs = {"logprobs": logp.detach() - t([0.5, -1.0, 0.0]), "advantages": t([2.0, -1.0, 3.0])}
    res = run("dro", logp, inputs)
    # -(logp·A - 0.025·(logp - logprobs)²): 1.00625, -0.975, 6
    assert res.loss.item() == pytest.approx(6.03125)
    # -A + beta·(logp - logprobs)
    assert logp.grad.tolist() == pytest.approx([-1.975, 0.95, -3.0])
    beta_half = compute_loss("dro", LossBatch(logp, inputs), {"beta": 0.5})
    assert beta_half.loss.item() == pytest.approx(1.0625 - 0.75 + 6.0)


@pytest.mark.parametrize("name", ["importance_sampling", "ppo", "cispo", "dro"])
def test_k3_kl_penalty(name: str) -> None:
    logp = leaf([-1.0, -1.0, -1.0])
    inputs = {
        "logprobs": logp.detach().clone(),
        "advantages": t([0.0, 0.0, 0.0]),  # isolate the penalty
        "ref_logprobs": logp.detach() + t([math.log(2.0), 0.0, -math.log(2.0)]),
    }
    res = run(name, logp, inputs, {"kl_beta": 0.1})
    # k3 = e^x - x - 1 at x = ln 2, 0, -ln 2: 0.3068528, 0, 0.1931472 (sum 0.5)
    assert res.metrics["kl_ref:mean"] == pytest.approx(0.5 / 3)
    assert res.loss.item() == pytest.approx(0.05)
    # d k3/d logp = 1 - e^x = -1, 0, 0.5; times kl_beta
    assert logp.grad.tolist() == pytest.approx([-0.1, 0.0, 0.05])


def test_reference_metric_without_penalty() -> None:
    logp = leaf([-1.0])
    inputs = {
        "logprobs": t([-1.0]),
        "advantages": t([1.0]),
        "ref_logprobs": t([-1.0 + math.log(2.0)]),
    }
    res = run("ppo", logp, inputs)
    assert res.loss.item() == pytest.approx(-1.0)
    assert res.metrics["kl_ref:mean"] == pytest.approx(1.0 - math.log(2.0))


def test_decoupled_ppo_by_hand() -> None:
    logp = leaf([-1.0, -1.0])
    proximal = logp.detach() - torch.log(t([1.5, 1.0]))  # trust-region ratios 1.5, 1.0
    inputs = {
        "logprobs": proximal - torch.log(t([2.0, 0.5])),  # behaviour weights 2, 0.5
        "proximal_logprobs": proximal,
        "advantages": t([1.0, 1.0]),
    }
    res = run("ppo", logp, inputs)
    # token 0: -2·min(1.5, 1.2) = -2.4 (clipped, no grad); token 1: -0.5·1 = -0.5, grad -0.5
    assert res.loss.item() == pytest.approx(-2.9)
    assert logp.grad.tolist() == pytest.approx([0.0, -0.5])
    assert res.metrics["clip_frac:mean"] == pytest.approx(0.5)
    assert res.metrics["behav_weight:mean"] == pytest.approx(1.25)


def test_decoupled_cispo_by_hand() -> None:
    logp = leaf([-0.5])
    proximal = logp.detach() - math.log(5.0)  # ratio 5 -> clipped to 4
    inputs = {
        "logprobs": proximal - math.log(0.5),
        "proximal_logprobs": proximal,
        "advantages": t([1.0]),
    }
    res = run("cispo", logp, inputs)
    assert res.loss.item() == pytest.approx(-0.5 * 4.0 * 1.0 * -0.5)
    assert logp.grad.tolist() == pytest.approx([-2.0])


@pytest.mark.parametrize("name", ["ppo", "cispo"])
def test_decoupled_reduces_to_plain_when_proximal_is_behaviour(name: str) -> None:
    base = [-0.5, -1.0, -2.0, -0.3]
    ratios = [1.5, 0.5, 1.0, 1.5]
    adv = t([2.0, -1.0, 3.0, -1.0])
    plain_logp, decoupled_logp = leaf(base), leaf(base)
    sampler = behaviour(plain_logp, ratios)
    plain = run(name, plain_logp, {"logprobs": sampler, "advantages": adv})
    decoupled = run(
        name,
        decoupled_logp,
        {"logprobs": sampler, "proximal_logprobs": sampler.clone(), "advantages": adv},
    )
    assert decoupled.loss.item() == pytest.approx(plain.loss.item())
    assert decoupled_logp.grad.tolist() == pytest.approx(plain_logp.grad.tolist())
    assert decoupled.metrics["clip_frac:mean"] == plain.metrics["clip_frac:mean"]


# --------------------------------------------------------------------------- structure


def _inputs_for(name: str, logp: torch.Tensor) -> dict[str, torch.Tensor]:
    n = logp.shape[0]
    gen = torch.Generator().manual_seed(0)
    weights = torch.rand(n, generator=gen, dtype=F64) + 0.1
    if name == "cross_entropy":
        return {"weights": weights}
    return {
        "weights": weights,
        "logprobs": logp.detach() + 0.3 * torch.randn(n, generator=gen, dtype=F64),
        "advantages": torch.randn(n, generator=gen, dtype=F64),
        "ref_logprobs": logp.detach() + 0.3 * torch.randn(n, generator=gen, dtype=F64),
    }


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_sums_not_means(name: str) -> None:
    """Two half-batches, summed, give the whole batch's loss and gradient (plain accumulation).

    The halves split at a datum boundary (datum 0: tokens 0-1, datum 1: 2-5), as
    calls do: GSPO's ratio is per datum.
    """
    values = torch.linspace(-2.0, -0.2, 6, dtype=F64).tolist()
    whole_logp = leaf(values)
    inputs = _inputs_for(name, whole_logp)
    config = {} if name == "cross_entropy" else {"kl_beta": 0.05}
    datum = torch.tensor([0, 0, 1, 1, 1, 1])
    whole = compute_loss(name, LossBatch(whole_logp, inputs, None, datum), config)
    whole.loss.backward()

    halves_logp = leaf(values)
    total = 0.0
    for part in (slice(0, 2), slice(2, 6)):
        sub = compute_loss(
            name,
            LossBatch(
                halves_logp[part],
                {k: v[part] for k, v in inputs.items()},
                None,
                datum[part] - datum[part][0],
            ),
            config,
        )
        sub.loss.backward()
        total += sub.metrics["loss:sum"]
    assert total == pytest.approx(whole.loss.item())
    assert halves_logp.grad.tolist() == pytest.approx(whole_logp.grad.tolist())


@pytest.mark.parametrize(
    ("name", "config"),
    [
        ("cross_entropy", {}),
        ("importance_sampling", {"kl_beta": 0.1}),
        ("ppo", {"kl_beta": 0.1}),
        ("dro", {"beta": 0.3, "kl_beta": 0.1}),
    ],
)
def test_gradcheck(name: str, config: dict[str, float]) -> None:
    """Where the loss value is differentiable (no stop-gradient), autograd matches finite differences.

    CISPO and the capped IS loss deliberately detach a coefficient, so their
    gradients are checked by hand above instead.
    """
    logp0 = leaf([-0.7, -1.3, -0.2, -2.1])
    inputs = _inputs_for(name, logp0)
    if name == "ppo":  # keep ratios away from the clip kinks at 0.8/1.2
        inputs["logprobs"] = logp0.detach() - torch.log(t([1.5, 0.5, 1.05, 0.95]))

    def loss_of(logp: torch.Tensor) -> torch.Tensor:
        return compute_loss(name, LossBatch(logp, inputs), config).loss

    assert torch.autograd.gradcheck(loss_of, (logp0,), eps=1e-6, atol=1e-5)


@pytest.mark.parametrize("name", ["importance_sampling", "ppo", "cispo", "dro"])
def test_prompt_tokens_never_produce_nan(name: str) -> None:
    """Weight-0 tokens carry 0 behaviour/reference log-probs by convention; exp of the gap must not overflow."""
    logp = torch.tensor([-200.0, -1.0], requires_grad=True)  # float32: exp(200) is inf
    inputs = {
        "weights": torch.tensor([0.0, 1.0]),
        "logprobs": torch.tensor([0.0, -1.0]),
        "advantages": torch.tensor([0.0, 1.0]),
        "ref_logprobs": torch.tensor([0.0, -1.0]),
    }
    res = compute_loss(name, LossBatch(logp, inputs), {"kl_beta": 0.1})
    res.loss.backward()
    assert torch.isfinite(res.loss)
    assert torch.isfinite(logp.grad).all()
    assert logp.grad[0].item() == 0.0
    assert all(math.isfinite(v) for v in res.metrics.values())


def test_no_tokens_gives_zero_loss_and_no_means() -> None:
    logp = leaf([-1.0, -2.0])
    inputs = {"weights": t([0.0, 0.0]), "logprobs": t([-1.0, -1.0]), "advantages": t([1.0, 1.0])}
    res = run("ppo", logp, inputs)
    assert res.loss.item() == 0.0
    assert res.metrics == {"loss:sum": 0.0, "ntokens:sum": 0.0}


def test_weights_default_to_one_for_policy_losses() -> None:
    logp = leaf([-1.0, -1.0])
    inputs = {"logprobs": t([-1.0, -1.0]), "advantages": t([1.0, 2.0])}
    res = run("importance_sampling", logp, inputs)
    assert res.loss.item() == pytest.approx(-3.0)
    assert res.metrics["ntokens:sum"] == 2.0


# --------------------------------------------------------------------------- errors


RL_KEYS = ["target_tokens", "logprobs", "advantages"]


@pytest.mark.parametrize(
    ("name", "keys", "config", "field"),
    [
        ("reinforce", RL_KEYS, {}, "loss_fn"),
        ("ppo", RL_KEYS, {"clip_ratio": 0.2}, "loss_fn_config.clip_ratio"),
        ("cross_entropy", ["target_tokens", "weights"], {"kl_beta": 0.1}, "loss_fn_config.kl_beta"),
        ("ppo", RL_KEYS, {"clip_low_threshold": 1.3}, "loss_fn_config.clip_low_threshold"),
        (
            "ppo",
            RL_KEYS,
            {"clip_high_threshold": float("nan")},
            "loss_fn_config.clip_high_threshold",
        ),
        ("ppo", RL_KEYS, {"kl_beta": -1.0}, "loss_fn_config.kl_beta"),
        ("dro", RL_KEYS, {"beta": "big"}, "loss_fn_config.beta"),
        ("ppo", ["target_tokens", "logprobs"], {}, "loss_fn_inputs.advantages"),
        ("cross_entropy", ["target_tokens"], {}, "loss_fn_inputs.weights"),
        ("ppo", ["logprobs", "advantages"], {}, "loss_fn_inputs.target_tokens"),
        ("ppo", [*RL_KEYS, "advantage"], {}, "loss_fn_inputs.advantage"),
    ],
)
def test_validate_loss_request_names_the_field(name, keys, config, field) -> None:
    with pytest.raises(InvalidArgumentError) as err:
        validate_loss_request(name, keys, config)
    assert str(err.value).startswith(f"INVALID_ARGUMENT: {field}:")


@pytest.mark.parametrize(
    ("name", "config", "field", "hint"),
    [
        # TRL's epsilon typed as a threshold: [0.2, 0.2] clips every token
        (
            "ppo",
            {"clip_low_threshold": 0.2, "clip_high_threshold": 0.2},
            "clip_high_threshold",
            "TRL's epsilon=0.2 is clip_low_threshold=0.8, clip_high_threshold=1.2",
        ),
        (
            "ppo",
            {"clip_low_threshold": 0.2, "clip_high_threshold": 0.28},
            "clip_high_threshold",
            "epsilon_high=0.28 is clip_low_threshold=0.8, clip_high_threshold=1.28",
        ),
        ("cispo", {"clip_high_threshold": 0.5}, "clip_high_threshold", "excludes ratio 1"),
        (
            "ppo",
            {"clip_low_threshold": 1.1, "clip_high_threshold": 1.3},
            "clip_low_threshold",
            "clip_low_threshold=0.8",
        ),
        ("ppo", {"clip_low_threshold": 1.3}, "clip_low_threshold", "exceeds"),
        ("ppo", {"clip_low_threshold": -0.2}, "clip_low_threshold", ">= 0"),
        ("cispo", {"clip_high_threshold": float("nan")}, "clip_high_threshold", "finite"),
        ("importance_sampling", {"ratio_cap": 0.2}, "ratio_cap", "above 1"),
    ],
)
def test_ratio_thresholds_that_exclude_ratio_one_are_refused(name, config, field, hint) -> None:
    """Issue 21 item 6: thresholds no one means answer INVALID_ARGUMENT naming the key,
    with TRL's equivalent; the usual ones (PPO 0.8/1.2, DAPO 0.8/1.28, CISPO 0/4,
    a cap of 2) pass."""
    with pytest.raises(InvalidArgumentError) as err:
        validate_loss_request(name, RL_KEYS, config)
    assert str(err.value).startswith(f"INVALID_ARGUMENT: loss_fn_config.{field}:"), err.value
    assert hint in str(err.value), err.value
    for ok_name, ok in [
        ("ppo", {"clip_low_threshold": 0.8, "clip_high_threshold": 1.28}),
        ("ppo", {"clip_low_threshold": 1.0, "clip_high_threshold": 1.0}),
        ("cispo", {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0}),
        ("importance_sampling", {"ratio_cap": 2.0}),
        ("importance_sampling", {"ratio_cap": 0.0}),
    ]:
        validate_loss_request(ok_name, RL_KEYS, ok)


def test_validate_loss_request_resolves_defaults() -> None:
    assert validate_loss_request("ppo", RL_KEYS, {"clip_high_threshold": 1.28}) == {
        "clip_low_threshold": 0.8,
        "clip_high_threshold": 1.28,
        "kl_beta": 0.0,
    }
    # an input another loss reads is ignored, not an error
    assert validate_loss_request("cross_entropy", [*RL_KEYS, "weights"], None) == {}


def test_needs_reference() -> None:
    assert not needs_reference("ppo", {})
    assert needs_reference("ppo", {"kl_beta": 0.1})
    assert not needs_reference("ppo", {"kl_beta": 0.1}, [*RL_KEYS, "ref_logprobs"])
    assert not needs_reference("cross_entropy", None)


@pytest.mark.parametrize("key", ["advantages", "logprobs", "weights"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_inputs_name_the_key(key: str, bad: float) -> None:
    inputs = {"logprobs": t([-1.0, -1.0]), "advantages": t([1.0, 1.0]), "weights": t([1.0, 1.0])}
    inputs[key] = t([0.5, bad])
    with pytest.raises(InvalidArgumentError, match=f"loss_fn_inputs.{key}: contains NaN or inf"):
        compute_loss("ppo", LossBatch(leaf([-1.0, -1.0]), inputs), {})


def test_compute_loss_errors() -> None:
    logp = leaf([-1.0, -1.0])
    ok = {"logprobs": t([-1.0, -1.0]), "advantages": t([1.0, 1.0])}
    with pytest.raises(InvalidArgumentError, match="loss_fn_inputs.ref_logprobs: required"):
        compute_loss("ppo", LossBatch(logp, ok), {"kl_beta": 0.1})
    with pytest.raises(InvalidArgumentError, match="loss_fn_inputs.advantages: length"):
        compute_loss("ppo", LossBatch(logp, {**ok, "advantages": t([1.0])}), {})
    with pytest.raises(InvalidArgumentError, match="loss_fn_inputs.advantages: required"):
        compute_loss("ppo", LossBatch(logp, {"logprobs": ok["logprobs"]}), {})
    with pytest.raises(InvalidArgumentError, match="^INVALID_ARGUMENT: loss_fn:"):
        compute_loss("grpo", LossBatch(logp, ok), {})


def test_registry_covers_the_wire_enum() -> None:
    """DESIGN.md invariant 5: the proto enum and the registry name the same losses."""
    common_pb2 = pytest.importorskip("treadle.v1.common_pb2")
    names = [value.name for value in common_pb2.LossFn.DESCRIPTOR.values]
    wire = {name.lower() for name in names if name != "LOSS_FN_UNSPECIFIED"}
    assert wire == set(LOSSES)


def test_unserved_sdk_loss_is_refused_with_why() -> None:
    """A loss the tinker SDK can send but treadle does not serve (its objective is
    not public) is refused before any work, on every path, saying why and what is
    served; an unknown name still gets the plain refusal."""
    from treadle.workers.trainer.losses import UNSERVED

    assert set(UNSERVED) == {"stable_reinforce"}
    assert not set(UNSERVED) & set(LOSSES)
    with pytest.raises(InvalidArgumentError) as err:
        validate_loss_request("stable_reinforce", RL_KEYS, {})
    message = str(err.value)
    assert message.startswith("INVALID_ARGUMENT: loss_fn: 'stable_reinforce' is not served")
    assert "not public" in message and "record_stability_info" in message
    assert str(sorted(LOSSES)) in message
    logp = leaf([-1.0])
    with pytest.raises(InvalidArgumentError, match="'stable_reinforce' is not served"):
        compute_loss("stable_reinforce", LossBatch(logp, {"advantages": t([1.0])}), {})
    with pytest.raises(InvalidArgumentError, match="unknown loss 'grpo'"):
        validate_loss_request("grpo", RL_KEYS, {})
