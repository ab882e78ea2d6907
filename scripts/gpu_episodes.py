"""``gpu_check.py``'s agent-episode row: a turn of an episode prefills only its new
observation (the previous turns' KV kept, ``SamplingConfig.cache_completion``),
and what it samples is what a fresh prefill of the whole history samples.

Three turns on one torch sampler: a 120-token first observation, 16 tokens
sampled and 8 observed a turn; each turn's prompt is the history so far. The
same turns are then sampled again, each by a new sampler with nothing kept.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from treadle.common.engine.domain import SampleOp, SampleResult, SamplingConfig
from treadle.workers.engine.base_models import BaseModelRegistry
from treadle.workers.engine.versions import WeightSnapshot
from treadle.workers.sampler.backend import SampleJob
from treadle.workers.sampler.torch_sampler import TorchSampler

PROMPT, SAMPLED, OBSERVED, TURNS = 120, 16, 8, 3


@dataclass
class EpisodeProbe:
    reused: float  # prompt positions reused / all, turns >= 2
    tokens_equal: bool  # every turn's tokens equal to the fresh prefill's
    logprob_diff: float  # max |logprob - fresh logprob| over the turns


def _turn(s: TorchSampler, prompt: np.ndarray, snap: WeightSnapshot, seed: int) -> SampleResult:
    params = SamplingConfig(max_tokens=SAMPLED, ignore_eos=True, seed=seed, cache_completion=True)
    fut: Future[SampleResult] = Future()
    s.submit(SampleJob(s.base, SampleOp(prompt, 1, params), snap), fut)
    while s.has_work():
        s.step()
    return fut.result(0)


def probe(model_dir: Path, device: str, dtype: torch.dtype) -> EpisodeProbe:
    base = BaseModelRegistry({"m": model_dir}, torch.device(device)).get("m", dtype)
    snap = WeightSnapshot(None, 0, base.params, None)
    max_len = PROMPT + TURNS * (SAMPLED + OBSERVED) + 8
    kept = TorchSampler(base, num_slots=4, max_len=max_len)
    vocab = min(base.cfg.vocab_size, 30_000)
    rng = np.random.default_rng(0)
    prompts, results, computed, reused = [], [], 0, 0
    prompt = rng.integers(3, vocab, PROMPT)
    for k in range(TURNS):
        before = (kept.prompt_tokens, kept.prefix_reused_tokens)
        res = _turn(kept, prompt, snap, seed=k)
        if k:
            computed += kept.prompt_tokens - before[0]
            reused += kept.prefix_reused_tokens - before[1]
        prompts.append(prompt)
        results.append(res)
        prompt = np.concatenate([prompt, res.sequences[0].tokens, rng.integers(3, vocab, OBSERVED)])
    equal, diff = True, 0.0
    for k, (p, res) in enumerate(zip(prompts, results, strict=True)):
        fresh = _turn(TorchSampler(base, num_slots=4, max_len=max_len), p, snap, seed=k)
        a, b = res.sequences[0], fresh.sequences[0]
        equal = equal and list(a.tokens) == list(b.tokens)
        n = min(len(a.logprobs), len(b.logprobs))
        diff = max(diff, float(np.abs(np.asarray(a.logprobs[:n]) - b.logprobs[:n]).max()))
    return EpisodeProbe(reused / max(computed + reused, 1), equal, diff)
