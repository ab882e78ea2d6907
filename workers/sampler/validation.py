"""What a sample request must satisfy before a torch sampler queues it.

Each refusal is INVALID_ARGUMENT with a message that starts with the field it
is about (``prompt``, ``num_samples``, ``max_tokens``, ``temperature``,
``top_p``, ``top_k``, ``token_budget``, ``stop``, ``topk_prompt_logprobs``,
``prompt_logprobs``), as every backend answers.
"""

from __future__ import annotations

import math

from treadle.common.engine.domain import SampleOp
from treadle.common.engine.sampling_limits import check_stop
from treadle.errors import InvalidArgumentError


def validate(
    op: SampleOp, *, vocab_size: int, max_len: int, num_slots: int, has_tokenizer: bool
) -> None:
    """Refuse ``op`` (INVALID_ARGUMENT naming the field) unless a sampler with a
    context of ``max_len`` and ``num_slots`` rows over a vocabulary of
    ``vocab_size`` can run it; stop strings need the base's tokenizer."""
    p = op.params
    prompt = op.prompt
    if prompt.ndim != 1 or prompt.size == 0:
        raise InvalidArgumentError("prompt: must be a non-empty 1-D token sequence")
    if prompt.dtype.kind not in "iu":
        raise InvalidArgumentError("prompt: token ids must be integers")
    bad = (prompt < 0) | (prompt >= vocab_size)
    if bad.any():
        raise InvalidArgumentError(
            f"prompt: token id {int(prompt[bad][0])} is outside the vocabulary [0, {vocab_size})"
        )
    if prompt.size >= max_len:
        raise InvalidArgumentError(
            f"prompt: {prompt.size} tokens leave no room in the context of {max_len}"
        )
    if not 1 <= op.num_samples <= num_slots:
        raise InvalidArgumentError(f"num_samples: must be in 1..{num_slots}, got {op.num_samples}")
    if p.token_budget < 0:
        raise InvalidArgumentError(f"token_budget: must be >= 0 (0 = none), got {p.token_budget}")
    if p.max_tokens < 0:
        raise InvalidArgumentError(f"max_tokens: must be >= 0, got {p.max_tokens}")
    if prompt.size + p.max_tokens > max_len:
        raise InvalidArgumentError(
            f"max_tokens: prompt ({prompt.size}) + max_tokens ({p.max_tokens}) exceeds the context of {max_len}"
        )
    if not (math.isfinite(p.temperature) and p.temperature >= 0):
        raise InvalidArgumentError(
            f"temperature: must be >= 0 (0 = greedy; unset = 1), got {p.temperature}"
        )
    if not (0 < p.top_p <= 1):
        raise InvalidArgumentError(
            f"top_p: must be in (0, 1], got {p.top_p}; leave it unset (or 1) for no "
            "nucleus truncation"
        )
    if p.top_k < -1:
        raise InvalidArgumentError(f"top_k: must be >= 0 (0 or -1 = off, as unset), got {p.top_k}")
    check_stop(p.stop_strings, p.stop_token_ids)
    if p.stop_strings and not has_tokenizer:
        raise InvalidArgumentError(
            "stop: this base model has no tokenizer.json; use stop token ids"
        )
    for t in p.stop_token_ids:
        if not 0 <= t < vocab_size:
            raise InvalidArgumentError(f"stop: stop token id {t} is outside the vocabulary")
    k = op.topk_prompt_logprobs
    if not 0 <= k <= vocab_size:
        raise InvalidArgumentError(
            f"topk_prompt_logprobs: must be in 0..{vocab_size} (0 = none), got {k}"
        )
    if op.scores_prompt and p.max_tokens < 1:
        field = "prompt_logprobs" if op.prompt_logprobs else "topk_prompt_logprobs"
        raise InvalidArgumentError(
            f"{field}: needs max_tokens >= 1 (the prompt is scored in the prefill that "
            "draws the first token)"
        )
