"""Prompt logprobs: the score of every prompt token (and the k most likely tokens
at each prompt position), as the tinker SDK's ``compute_logprobs`` asks for.

The torch sampler scores the prompt from the prefill it runs anyway (no second
forward): each prefill chunk's hidden states go through the head here, so the
logits of position ``i`` score prompt token ``i + 1``. Position 0 has nothing
before it and no score (NaN; tinker's ``None``). The score is the temperature
contract's ``log_softmax(logits / T)`` at the request's temperature (T = 1 when
it samples greedily, as the sampled token's logprob), which is what
``forward_logprobs`` computes at the same T for the same weights.

A request that scores its prompt computes it from position 0: a cached prefix
holds K/V but no logits (``prefix_cache`` gives such a request no prefix).

The vLLM backend refuses prompt logprobs (``vllm_params.check_prompt_scores``
says why).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from treadle.common.engine.domain import PromptLogprobs, SampleOp
from treadle.common.engine.model_config import ModelConfig
from treadle.workers.model.llama import LlamaParams, lm_logits
from treadle.workers.model.lora import LoraAdapter, LoraRows

#: prompt positions whose logits are held at once ([BLOCK, V] float32)
BLOCK = 128


def empty(op: SampleOp) -> PromptLogprobs:
    P, k = op.prompt.size, op.topk_prompt_logprobs
    return PromptLogprobs(
        logprobs=np.full(P, np.nan, dtype=np.float32) if op.prompt_logprobs else None,
        topk_ids=np.full((P, k), -1, dtype=np.int64),
        topk_logprobs=np.full((P, k), np.nan, dtype=np.float32),
    )


class PromptScorer:
    """Collects one request's prompt scores, chunk by chunk, as it is prefilled."""

    def __init__(self, op: SampleOp) -> None:
        self.prompt_P = torch.from_numpy(np.ascontiguousarray(op.prompt, dtype=np.int64))
        self.k = op.topk_prompt_logprobs
        t = op.params.temperature
        self.temperature = t if t > 0 else 1.0
        self.out = empty(op)

    def add(
        self,
        cfg: ModelConfig,
        params: LlamaParams,
        hidden_N_H: Tensor,
        start: int,
        lora: LoraAdapter | LoraRows | None,
    ) -> None:
        """``hidden_N_H``: the final hidden states of prompt positions
        ``start .. start + N - 1``; their logits score positions ``start + 1 ..``
        (the last prompt position's logits choose the first sampled token, not here)."""
        P = self.prompt_P.numel()
        n = min(hidden_N_H.shape[0], P - 1 - start)
        for b0 in range(0, n, BLOCK):
            b = min(BLOCK, n - b0)
            hidden_1_B_H = hidden_N_H[b0 : b0 + b][None]
            logits_B_V = lm_logits(cfg, params, hidden_1_B_H, lora=lora)[0].float()
            if self.temperature != 1.0:
                logits_B_V = logits_B_V / self.temperature
            logp_B_V = torch.log_softmax(logits_B_V, dim=-1)
            first = start + b0 + 1  # the prompt position the first row scores
            targets_B = self.prompt_P[first : first + b].to(logp_B_V.device)
            if self.out.logprobs is not None:
                lp_B = logp_B_V.gather(-1, targets_B[:, None]).squeeze(-1)
                self.out.logprobs[first : first + b] = lp_B.cpu().numpy()
            if self.k:
                vals_B_K, ids_B_K = logp_B_V.topk(self.k, dim=-1)
                self.out.topk_ids[first : first + b] = ids_B_K.cpu().numpy()
                self.out.topk_logprobs[first : first + b] = vals_B_K.cpu().numpy()

    def result(self) -> PromptLogprobs:
        return self.out
