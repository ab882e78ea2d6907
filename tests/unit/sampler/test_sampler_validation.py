"""What a sample request must satisfy; each refusal names its field
(``workers.sampler.validation``)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from treadle.common.engine.domain import SampleOp, SamplingConfig
from treadle.errors import InvalidArgumentError
from treadle.workers.sampler.validation import validate

GOOD = SampleOp(np.arange(3, 10), 2, SamplingConfig(max_tokens=8))


def _check(op: SampleOp, *, has_tokenizer: bool = True) -> None:
    validate(op, vocab_size=100, max_len=32, num_slots=4, has_tokenizer=has_tokenizer)


def test_a_good_request_passes() -> None:
    _check(GOOD)
    _check(replace(GOOD, params=SamplingConfig(max_tokens=0, temperature=0.0, top_k=-1)))


@pytest.mark.parametrize(
    ("op", "field"),
    [
        (replace(GOOD, prompt=np.zeros(0, np.int64)), "prompt"),
        (replace(GOOD, prompt=np.array([1.5, 2.0])), "prompt"),
        (replace(GOOD, prompt=np.array([3, 100])), "prompt"),
        (replace(GOOD, prompt=np.arange(32)), "prompt"),
        (replace(GOOD, num_samples=0), "num_samples"),
        (replace(GOOD, num_samples=5), "num_samples"),
        (replace(GOOD, params=SamplingConfig(max_tokens=-1)), "max_tokens"),
        (replace(GOOD, params=SamplingConfig(max_tokens=26)), "max_tokens"),
        (replace(GOOD, params=SamplingConfig(temperature=-0.5)), "temperature"),
        (replace(GOOD, params=SamplingConfig(temperature=float("nan"))), "temperature"),
        (replace(GOOD, params=SamplingConfig(top_p=0.0)), "top_p"),
        (replace(GOOD, params=SamplingConfig(top_p=1.5)), "top_p"),
        (replace(GOOD, params=SamplingConfig(top_k=-2)), "top_k"),
        (replace(GOOD, params=SamplingConfig(token_budget=-1)), "token_budget"),
        (replace(GOOD, params=SamplingConfig(stop_strings=("",))), "stop"),
        (replace(GOOD, params=SamplingConfig(stop_token_ids=(100,))), "stop"),
    ],
)
def test_bad_input_names_the_field(op: SampleOp, field: str) -> None:
    with pytest.raises(InvalidArgumentError, match=f"^INVALID_ARGUMENT: {field}: "):
        _check(op)


def test_stop_strings_need_a_tokenizer() -> None:
    op = replace(GOOD, params=SamplingConfig(stop_strings=("\n",)))
    _check(op)
    with pytest.raises(
        InvalidArgumentError, match="^INVALID_ARGUMENT: stop: this base model has no tokenizer"
    ):
        _check(op, has_tokenizer=False)
