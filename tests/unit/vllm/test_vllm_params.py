"""The vLLM backend's parameter mapping and refusals, without vLLM: what treadle
asks vLLM for, and how vLLM's finish reasons become treadle's stop reasons."""

from __future__ import annotations

import numpy as np
import pytest

from treadle.common.engine.domain import SampleOp, SamplingConfig
from treadle.errors import InvalidArgumentError
from treadle.workers.vllm.params import (
    check_prompt_scores,
    check_supported,
    sampling_kwargs,
    stop_reason_of,
)
from treadle.workers.vllm.settings import VllmSettings

V = 100


def test_truncation_at_positive_temperature_is_refused_naming_the_field() -> None:
    with pytest.raises(
        InvalidArgumentError, match=r"INVALID_ARGUMENT: top_p: 0.9 is not supported"
    ):
        check_supported(SamplingConfig(top_p=0.9), V)
    with pytest.raises(InvalidArgumentError, match=r"INVALID_ARGUMENT: top_k: 5 is not supported"):
        check_supported(SamplingConfig(top_k=5, temperature=0.7), V)
    check_supported(SamplingConfig(top_k=5, top_p=0.5, temperature=0.0), V)  # greedy
    check_supported(SamplingConfig(top_k=V), V)  # keeps every token: no truncation
    check_supported(SamplingConfig(top_k=-1, top_p=1.0, temperature=0.7), V)


def test_prompt_logprobs_are_refused_naming_the_field() -> None:
    """vLLM 0.32 fails its engine on prompt logprobs under an adapter: never sent."""
    prompt = np.arange(1, 6)
    with pytest.raises(InvalidArgumentError, match=r"INVALID_ARGUMENT: prompt_logprobs: "):
        check_prompt_scores(SampleOp(prompt, 1, SamplingConfig(), prompt_logprobs=True))
    with pytest.raises(InvalidArgumentError, match=r"INVALID_ARGUMENT: topk_prompt_logprobs: "):
        check_prompt_scores(SampleOp(prompt, 1, SamplingConfig(), topk_prompt_logprobs=2))
    check_prompt_scores(SampleOp(prompt, 1, SamplingConfig()))


def test_sampling_kwargs_map_every_field() -> None:
    p = SamplingConfig(
        max_tokens=30, temperature=0.7, stop_strings=("</a>",), stop_token_ids=(7,), seed=1
    )
    kw = sampling_kwargs(p, max_tokens=12, seed=2**64 - 1, stop_ids={2, 7}, detokenize=True)
    assert kw["n"] == 1 and kw["max_tokens"] == 12 and kw["temperature"] == 0.7
    assert kw["stop_token_ids"] == [2, 7] and kw["ignore_eos"] is True  # EOS: ours, in stop ids
    assert kw["stop"] == ["</a>"] and kw["include_stop_str_in_output"] is True
    assert kw["logprobs"] == 0 and 0 <= kw["seed"] < 2**63
    assert (kw["top_p"], kw["top_k"]) == (1.0, 0)
    greedy = sampling_kwargs(
        SamplingConfig(temperature=0, top_k=5), max_tokens=1, seed=0, stop_ids=(), detokenize=False
    )
    assert (greedy["temperature"], greedy["top_k"]) == (0.0, 0)


@pytest.mark.parametrize(
    ("finish", "last", "detail", "reached_max", "sampled", "budget", "want"),
    [
        ("stop", 2, 2, False, 5, 0, "stop"),  # EOS
        ("stop", 7, 7, False, 5, 0, "stop_token"),  # a requested stop token id
        ("stop", 9, "</a>", False, 5, 0, "stop_string"),
        ("length", 9, None, True, 8, 0, "length"),
        ("length", 9, None, False, 4, 4, "partial"),  # the budget stopped it
        ("length", 9, None, True, 4, 4, "length"),  # both: the cap wins, as on torch
        ("abort", 9, None, False, 3, 0, "cancelled"),
    ],
)
def test_stop_reasons(
    finish: str,
    last: int,
    detail: int | str | None,
    reached_max: bool,
    sampled: int,
    budget: int,
    want: str,
) -> None:
    p = SamplingConfig(stop_token_ids=(7,), stop_strings=("</a>",), token_budget=budget)
    got = stop_reason_of(
        finish, last, detail, p, reached_max=reached_max, sampled_this_call=sampled, budget=budget
    )
    assert got == want


def test_settings_are_checked() -> None:
    assert VllmSettings.from_options({}).max_lora_rank == 16
    with pytest.raises(InvalidArgumentError, match="vllm_max_lora_rank: vLLM takes one of"):
        VllmSettings.from_options({"max_lora_rank": 4})
    with pytest.raises(InvalidArgumentError, match="vllm_gpu_memory_utilization"):
        VllmSettings.from_options({"gpu_memory_utilization": 1.5})
    with pytest.raises(InvalidArgumentError, match="unknown settings"):
        VllmSettings.from_options({"tensor_parallel": 2})
