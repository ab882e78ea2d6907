"""Sampling knobs mean what the docs say (issue 21, items 4 and 8).

* ``stop="xy"`` is ONE stop string, never its characters; ``stopped_by`` tells an
  EOS from a stop string from a stop token, and nothing is cut from the tokens.
* Unset differs from an explicit value on the wire: unset T = 1, top_p off, top_k
  off; an explicit ``top_p=0`` is INVALID_ARGUMENT naming ``top_p``; ``top_k=0`` is
  off like unset; ``temperature=0`` is greedy with logprobs at T = 1, and the RL
  loops refuse it.
"""

from __future__ import annotations

import numpy as np
import pytest

import treadle
from treadle import rl

BASE = "tiny"
TIMEOUT = 60.0
P = treadle.SamplingParams


@pytest.fixture(scope="module")
def tok(service: treadle.ServiceClient) -> treadle.Tokenizer:
    return service.get_tokenizer(BASE)


@pytest.fixture(scope="module")
def sampler(service: treadle.ServiceClient) -> treadle.SamplingClient:
    return service.create_sampling_client(base_model=BASE)


def _greedy(sampler: treadle.SamplingClient, prompt: list[int], n: int) -> list[int]:
    seq = sampler.sample(prompt, 1, P(max_tokens=n, temperature=0)).result(TIMEOUT).sequences[0]
    assert seq.stop_reason == "length", "the precondition: greedy runs to max_tokens"
    return seq.tokens


def test_a_string_is_one_stop_string(
    sampler: treadle.SamplingClient, tok: treadle.Tokenizer
) -> None:
    prompt = tok.encode("Hello, world! 12+34=")
    g = _greedy(sampler, prompt, 30)
    text = tok.decode(g)
    assert len(text) == len(g)  # the character tokenizer: one token per character
    # a two-character string whose first character already came earlier, alone:
    # read as characters, it would stop there
    j = next(
        j
        for j in range(1, len(text) - 1)
        if text[j] in text[:j] and text[j : j + 2] not in text[: j + 1]
    )
    stop = text[j : j + 2]
    seq = sampler.sample(prompt, 1, P(max_tokens=30, temperature=0, stop=stop)).result(TIMEOUT)
    (s,) = seq.sequences
    assert s.tokens == g[: j + 2], (stop, tok.decode(s.tokens))
    assert s.stop_reason == "stop" and s.stopped_by == "stop_string"
    assert tok.decode(s.tokens).endswith(stop)  # the stop text is in the output, as tokens

    # a stop token id: the token is the last one returned
    i = next(i for i in range(3, len(g)) if g[i] not in g[:i])
    (t,) = (
        sampler.sample(prompt, 1, P(max_tokens=30, temperature=0, stop=[g[i]]))
        .result(TIMEOUT)
        .sequences
    )
    assert t.tokens == g[: i + 1] and t.stop_reason == "stop" and t.stopped_by == "stop_token"
    (n,) = sampler.sample(prompt, 1, P(max_tokens=5, temperature=0)).result(TIMEOUT).sequences
    assert n.stop_reason == "length" and n.stopped_by is None


def test_eos_is_told_apart(sampler: treadle.SamplingClient, tok: treadle.Tokenizer) -> None:
    params = P(max_tokens=40, temperature=1.5, seed=3)
    seqs = sampler.sample(tok.encode("12+3="), 16, params).result(TIMEOUT).sequences
    eos = [s for s in seqs if s.stop_reason == "stop"]
    assert eos, "the precondition: EOS stops some of them"
    for s in eos:
        assert s.stopped_by == "eos" and s.tokens[-1] == tok.eos_token_id


def test_unset_is_the_default_and_explicit_top_p_zero_is_refused(
    sampler: treadle.SamplingClient, tok: treadle.Tokenizer
) -> None:
    prompt = tok.encode("7*8=")

    def tokens(params: treadle.SamplingParams) -> list[list[int]]:
        return [s.tokens for s in sampler.sample(prompt, 3, params).result(TIMEOUT).sequences]

    unset = tokens(P(max_tokens=12, seed=5))
    assert unset == tokens(P(max_tokens=12, seed=5, temperature=1.0, top_p=1.0, top_k=-1))
    assert unset == tokens(P(max_tokens=12, seed=5, top_k=0))  # top_k 0: off, as unset
    assert unset != tokens(P(max_tokens=12, seed=5, temperature=0.5))
    with pytest.raises(treadle.InvalidArgumentError, match="top_p"):
        sampler.sample(prompt, 1, P(max_tokens=4, top_p=0.0)).result(TIMEOUT)


def test_temperature_zero_is_greedy_with_logprobs_at_t1(
    service: treadle.ServiceClient, tok: treadle.Tokenizer
) -> None:
    trainer = service.create_lora_training_client(BASE, rank=4, seed=1)
    sampler = trainer.sync_weights()
    prompt = tok.encode("9*9=")
    seqs = sampler.sample(prompt, 3, P(max_tokens=10, temperature=0)).result(TIMEOUT).sequences
    assert len({tuple(s.tokens) for s in seqs}) == 1  # greedy: the samples are identical
    full = prompt + seqs[0].tokens
    datum = treadle.Datum(
        model_input=treadle.ModelInput.from_ints(full[:-1]),
        loss_fn_inputs={"target_tokens": full[1:]},
    )
    lp = trainer.forward_logprobs([datum], temperature=1.0).result(TIMEOUT)
    np.testing.assert_allclose(
        seqs[0].logprobs, lp.loss_fn_outputs[0].logprobs[len(prompt) - 1 :], atol=1e-4, rtol=0
    )


def test_rl_loops_refuse_greedy_rollouts(service: treadle.ServiceClient) -> None:
    trainer = service.create_lora_training_client(BASE, rank=4, seed=2)
    prompts = iter([rl.Prompt([5, 6, 7])] * 4)
    # refused when the loop is made (before anything is sampled)
    with pytest.raises(treadle.InvalidArgumentError, match="sampling_params.temperature"):
        rl.sync_loop(
            trainer,
            prompts,
            lambda task, seq: 1.0,
            steps=1,
            groups_per_step=1,
            group_size=2,
            sampling_params=P(max_tokens=2, temperature=0),
        )
