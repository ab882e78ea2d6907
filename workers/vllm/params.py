"""treadle's sampling parameters as vLLM's, and what the vLLM backend refuses.

The mapping is exact where vLLM can keep treadle's contracts and a refusal
(INVALID_ARGUMENT naming the field, with why) where it cannot; a value that
silently means something else must never reach a loss.

* The behaviour logprob. The engine runs with ``logprobs_mode=
  "processed_logprobs"``: the sampled token's logprob is taken after vLLM's
  logits processors and temperature, before top-k/top-p, i.e.
  ``log_softmax(logits / T)``, the contract (measured: 6e-7 from the
  reference on fp32). With top-k or top-p on, vLLM reports the logprob of the
  *truncated, renormalised* distribution instead, and no public setting gives
  the untruncated one beside it, so a request at T > 0 with truncation is
  refused. Greedy (T = 0) ignores truncation and reports the logprob at T = 1,
  as the torch backend does.
* Stops. EOS and stop token ids both go to vLLM as ``stop_token_ids`` (with
  ``ignore_eos`` always on in vLLM): the EOS set is the model config's, as the
  torch sampler's, not vLLM's guess from the tokenizer, and the stop reason is
  decided from the last token the same way ("stop_token" when it is one of the
  request's stop ids, else "stop").
* Seeds. Each sample is its own vLLM request seeded with that sample's stream
  key (``sampling.row_keys``), so a seeded request reproduces its tokens
  whatever else shares the batch (vLLM's per-request generators).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from treadle.common.engine.domain import SampleOp, SamplingConfig
from treadle.errors import InvalidArgumentError

#: the logprobs_mode the engine runs with (see the module docstring)
LOGPROBS_MODE = "processed_logprobs"
#: vLLM's seeds are signed 64-bit
_SEED_MASK = 2**63 - 1


def truncates(params: SamplingConfig, vocab_size: int) -> bool:
    """Whether the request asks for top-k or top-p truncation that changes sampling."""
    return params.temperature > 0 and (0 < params.top_k < vocab_size or params.top_p < 1.0)


def check_supported(
    params: SamplingConfig, vocab_size: int, lora_rank: int = 0, max_lora_rank: int = 0
) -> None:
    """INVALID_ARGUMENT for what the vLLM backend cannot do under treadle's contracts
    (``lora_rank``: the model's, 0 for none; ``max_lora_rank``: the engine's)."""
    if lora_rank > max_lora_rank > 0:
        raise InvalidArgumentError(
            f"rank: the model's LoRA rank {lora_rank} is above the vLLM engine's max LoRA "
            f"rank {max_lora_rank} (--vllm-max-lora-rank)"
        )
    if not truncates(params, vocab_size):
        return
    field = "top_p" if params.top_p < 1.0 else "top_k"
    value = params.top_p if field == "top_p" else params.top_k
    raise InvalidArgumentError(
        f"{field}: {value} is not supported by the vllm sampler backend: with top-k/top-p "
        "truncation vLLM reports the logprob of the truncated, renormalised distribution, "
        "not log_softmax(logits / T) before truncation (the behaviour logprob the losses "
        "need); leave top_k/top_p off, sample at temperature 0, or use --sampler torch"
    )


def check_prompt_scores(op: SampleOp) -> None:
    """Prompt logprobs are refused on the vLLM backend (INVALID_ARGUMENT naming the
    field). vLLM 0.32 computes prompt logits under LoRA with one adapter index per
    request, not per prompt token: the first such request under an adapter fails its
    engine, taking every request in flight with it. Its prompt scores are also taken from the raw
    logits, which is the temperature contract at T = 1 only."""
    if not op.scores_prompt:
        return
    field = "prompt_logprobs" if op.prompt_logprobs else "topk_prompt_logprobs"
    raise InvalidArgumentError(
        f"{field}: not supported by the vllm sampler backend (vLLM cannot score prompt "
        "tokens under LoRA adapters); score prompts on a worker started with --sampler "
        "torch, or use forward_logprobs"
    )


def sampling_kwargs(
    params: SamplingConfig,
    *,
    max_tokens: int,
    seed: int,
    stop_ids: Iterable[int],
    detokenize: bool,
) -> dict[str, Any]:
    """Keyword arguments of ``vllm.SamplingParams`` for one sample (n = 1) of a request.

    ``max_tokens``: this vLLM request's tokens (a resumed or in-flight-updated
    sample asks for what is left); ``stop_ids``: EOS (unless ``ignore_eos``) and
    the request's stop token ids."""
    greedy = params.temperature <= 0
    kw: dict[str, Any] = {
        "n": 1,
        "max_tokens": max_tokens,
        "temperature": 0.0 if greedy else float(params.temperature),
        "top_p": 1.0,
        "top_k": 0 if greedy else max(params.top_k, 0),
        "seed": seed & _SEED_MASK,
        "stop_token_ids": sorted(set(stop_ids)),
        "ignore_eos": True,  # EOS is among stop_token_ids unless the request ignores it
        "logprobs": 0,  # the sampled token's logprob only
        "detokenize": detokenize,
        "skip_special_tokens": False,
        "spaces_between_special_tokens": False,
    }
    if not greedy and params.top_p < 1.0:
        kw["top_p"] = float(params.top_p)
    if params.stop_strings:
        kw["stop"] = list(params.stop_strings)
        kw["include_stop_str_in_output"] = True
    return kw


def stop_reason_of(
    finish_reason: str | None,
    last_token: int | None,
    stop_detail: int | str | None,
    params: SamplingConfig,
    *,
    reached_max: bool,
    sampled_this_call: int,
    budget: int,
) -> str:
    """treadle's stop reason for a vLLM sample that finished.

    Same order as the torch sampler: a stop id, then a stop string, then the
    length cap; a length stop that only the ``token_budget`` caused is a
    partial rollout."""
    if finish_reason == "stop":
        if isinstance(stop_detail, str):
            return "stop_string"
        return "stop_token" if last_token in params.stop_token_ids else "stop"
    if finish_reason == "abort":
        return "cancelled"
    if not reached_max and budget and sampled_this_call >= budget:
        return "partial"
    return "length"
