"""What the logprob-agreement suites share (the torch samplers' and vLLM's): a few
SFT steps, rollouts sampled from the prompts, and the largest gap between the
sampler's logprobs and the trainer's ``forward_logprobs`` over them."""

from __future__ import annotations

import numpy as np

import treadle
from treadle import rl

PROMPTS = ("12+3=", "4*5=", "Hello", "x")
GROUP = 4


def sft_steps(tc: treadle.TrainingClient, steps: int, lr: float) -> list[int]:
    """``steps`` SFT steps on three short texts, so the adapter (or the full copy)
    differs from the base; the steps the optimizer reports."""
    tok = tc.get_tokenizer()
    seqs = [tok.encode(t) for t in ("12+3=15", "4*5=20", "Hello world")]
    data = [
        treadle.Datum(
            model_input=treadle.ModelInput.from_ints(s[:-1]),
            loss_fn_inputs={"target_tokens": s[1:], "weights": [1.0 / 20] * (len(s) - 1)},
        )
        for s in seqs
    ]
    futures = []
    for _ in range(steps):
        tc.forward_backward(data, "cross_entropy")
        futures.append(tc.optim_step(treadle.AdamParams(learning_rate=lr)))
    return [f.result().step for f in futures]


def rollouts(
    sampler: treadle.SamplingClient,
    tok: treadle.Tokenizer,
    temperature: float,
    top_p: float | None = None,
) -> list[rl.Rollout]:
    """GROUP samples of every prompt (16 tokens at most, seed 3); rewards alternate
    0, 1 within a group."""
    params = treadle.SamplingParams(max_tokens=16, temperature=temperature, top_p=top_p, seed=3)
    futures = [(p, sampler.sample(tok.encode(p), GROUP, params)) for p in PROMPTS]
    out = []
    for prompt, fut in futures:
        for i, seq in enumerate(fut.result().sequences):
            assert seq.tokens, "empty completion"
            out.append(rl.Rollout.from_sequence(tok.encode(prompt), seq, reward=float(i % 2)))
    return out


def max_diff(
    tc: treadle.TrainingClient,
    rollouts: list[rl.Rollout],
    temperature: float,
    *,
    reference: bool = False,
) -> float:
    """Largest |sampler logprob - forward_logprobs| over every sampled token."""
    datums = rl.build_datums(rollouts, [0.0] * len(rollouts), include_logprobs=False)
    probe = [
        treadle.Datum(d.model_input, {"target_tokens": d.loss_fn_inputs["target_tokens"]})
        for d in datums
    ]
    out = tc.forward_logprobs(probe, reference=reference, temperature=temperature).result()
    worst = 0.0
    for rollout, output in zip(rollouts, out.loss_fn_outputs, strict=True):
        n = len(rollout.completion_tokens)
        got = np.asarray(rollout.completion_logprobs)
        worst = max(worst, float(np.abs(output.logprobs[-n:] - got).max()))
    return worst
