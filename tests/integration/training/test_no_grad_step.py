"""An optim_step with no gradient since the previous one is not silent (issue 21, item 7).

Adam's momentum moves the weights even with no new gradient (DESIGN's formula,
kept); the step says so: ``no_grad:value`` = 1 in its metrics and a
``treadle.NoGradientWarning`` in the SDK.
"""

from __future__ import annotations

import warnings

import pytest

import treadle
from tests.helpers import next_token_datum

TIMEOUT = 60.0


def _datum(tok: treadle.Tokenizer, text: str) -> treadle.Datum:
    return next_token_datum(tok.encode(text))


def test_a_step_without_gradient_warns_and_reports_it(service: treadle.ServiceClient) -> None:
    tc = service.create_lora_training_client("tiny", rank=4, seed=3)
    data = [_datum(tc.get_tokenizer(), "12+3=15")]
    adam = treadle.AdamParams(learning_rate=1e-2)
    probe = tc.forward_logprobs(data).result(TIMEOUT).loss_fn_outputs[0].logprobs

    tc.forward_backward(data).result(TIMEOUT)
    with warnings.catch_warnings():
        warnings.simplefilter("error", treadle.NoGradientWarning)  # a real gradient: no warning
        first = tc.optim_step(adam).result(TIMEOUT)
    assert first.metrics["no_grad:value"] == 0.0 and first.metrics["grad_norm:value"] > 0
    after_first = tc.forward_logprobs(data).result(TIMEOUT).loss_fn_outputs[0].logprobs
    assert (after_first != probe).any()

    with pytest.warns(treadle.NoGradientWarning, match="no gradient since the previous optim_step"):
        empty = tc.optim_step(adam).result(TIMEOUT)
    assert empty.metrics["no_grad:value"] == 1.0
    assert empty.metrics["grad_norm:value"] == 0.0
    # the numbers are Adam's: the momentum of the first step still moved the weights
    assert empty.metrics["update_norm:value"] > 0
    after_empty = tc.forward_logprobs(data).result(TIMEOUT).loss_fn_outputs[0].logprobs
    assert (after_empty != after_first).any()
    assert tc.get_info().version == 2
