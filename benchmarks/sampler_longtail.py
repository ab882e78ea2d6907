"""Long-tail lengths: treadle's continuous batching vs HF ``generate`` in static batches.

32 prompts x G = 8 samples = 256 sequences whose lengths come from one seeded
long-tail list (most around 1/16 of the 512-token cap, a few at the cap), the
shape of RL rollouts. The same lengths are forced on both sides with EOS
suppressed: treadle through each sequence's ``max_tokens`` (``ignore_eos``),
HF by running each static batch of 32 (4 prompts x 8 samples, like
``num_return_sequences=8``) for its longest member's length, which is exactly
what a static batch does. "Useful" tokens are the forced lengths; HF's tokens
beyond a sequence's length are waste. treadle also runs at most 32 rows at
once (32 KV slots), so the batch sizes match.

treadle submits each of the G samples as its own request (its own length);
the prompt's KV is prefilled once and the other 7 copy it from the prefix
cache, so the group still shares one prefill.

The model is the "5m" preset (4.6M params) by default: HF needs 8 x 512 batch
steps, which at 110M params would take over ten minutes on 2 cores. Use
``--preset 110m`` to run it anyway.

usage: .venv/bin/python benchmarks/sampler_longtail.py [--preset 5m] [--rounds 2]
       [--model-dir DIR]
Thread budget: 2 (fixed). Runs in about 1-3 minutes on 2 cores (5m).
"""

from __future__ import annotations

import argparse
import time
from concurrent.futures import Future

import _common  # sets the thread budget before torch starts its pools
import numpy as np
import torch

from treadle.common.engine.domain import SampleOp, SampleResult, SamplingConfig
from treadle.workers.engine.base_models import BaseModelRegistry
from treadle.workers.engine.versions import WeightSnapshot
from treadle.workers.sampler.backend import SampleJob
from treadle.workers.sampler.torch_sampler import SamplerLimits, TorchSampler

CAP = 512
PROMPTS, G, BATCH, PROMPT_TOKENS = 32, 8, 32, 32


def long_tail_lengths(n: int, seed: int = 0) -> list[int]:
    """Most sequences near CAP/16 (log-normal), about 1 in 16 runs to the cap."""
    rng = np.random.default_rng(seed)
    body = np.clip(rng.lognormal(np.log(CAP / 16), 0.6, size=n), 4, CAP - 1).astype(int)
    at_cap = rng.random(n) < 1 / 16
    return [CAP if c else int(b) for b, c in zip(body, at_cap, strict=True)]


def run_treadle(
    sampler: TorchSampler, snap: WeightSnapshot, prompts: np.ndarray, lengths: list[int]
) -> float:
    t0 = time.perf_counter()
    futures: list[Future[SampleResult]] = []
    for i, n in enumerate(lengths):
        fut: Future[SampleResult] = Future()
        params = SamplingConfig(max_tokens=n, seed=i, ignore_eos=True)
        sampler.submit(SampleJob(sampler.base, SampleOp(prompts[i // G], 1, params), snap), fut)
        futures.append(fut)
    while sampler.has_work():
        sampler.step()
    seconds = time.perf_counter() - t0
    got = [len(f.result().sequences[0].tokens) for f in futures]
    assert got == lengths, "every sequence must run to its forced length"
    return seconds


def run_hf(model: torch.nn.Module, prompts: np.ndarray, lengths: list[int], eos: int) -> float:
    per_batch = BATCH // G
    t0 = time.perf_counter()
    for start in range(0, PROMPTS, per_batch):
        ids = torch.from_numpy(prompts[start : start + per_batch])
        longest = max(lengths[start * G : (start + per_batch) * G])
        _common.hf_generate(model, ids, longest, eos, n=G)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--preset", default="5m")
    ap.add_argument("--model-dir", default=None)
    args = ap.parse_args()

    from transformers import LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    path = _common.model_dir(args.preset, args.model_dir)
    base = BaseModelRegistry({"m": path}).get("m", torch.float32)
    eos = base.cfg.eos_token_ids[0]
    hf = LlamaForCausalLM.from_pretrained(path, attn_implementation="sdpa").eval()

    rng = np.random.default_rng(0)
    prompts = rng.integers(3, base.cfg.vocab_size, size=(PROMPTS, PROMPT_TOKENS))
    lengths = long_tail_lengths(PROMPTS * G)
    useful = sum(lengths)
    hf_generated = sum(BATCH * max(lengths[s : s + BATCH]) for s in range(0, len(lengths), BATCH))
    limits = SamplerLimits(num_slots=BATCH, max_len=PROMPT_TOKENS + CAP + 1)
    snap = WeightSnapshot(None, 0, base.params, None)

    hf_runs, tr_runs = [], []
    for r in range(args.rounds):
        hf_runs.append(useful / run_hf(hf, prompts, lengths, eos))
        sampler = TorchSampler(base, limits=limits)
        tr_runs.append(useful / run_treadle(sampler, snap, prompts, lengths))
        reused = sampler.stats().prefix_reused_tokens
        print(f"round {r + 1}: HF {hf_runs[-1]:.0f}, treadle {tr_runs[-1]:.0f} useful tok/s")

    hf_best, tr_best = max(hf_runs), max(tr_runs)
    print()
    print(
        f"model {args.preset}: {base.cfg.num_params() / 1e6:.1f}M params, float32, "
        f"{PROMPTS} prompts x G={G}, {PROMPT_TOKENS}-token prompts, {_common.THREADS} threads"
    )
    print(
        f"lengths: {len(lengths)} sequences, median {int(np.median(lengths))}, "
        f"mean {np.mean(lengths):.0f}, {sum(n == CAP for n in lengths)} at the {CAP} cap; "
        f"{useful} useful tokens; HF static batches generate {hf_generated} "
        f"({useful / hf_generated:.0%} useful); treadle reused {reused} prompt tokens"
    )
    print()
    print(
        _common.table(
            ["engine", "useful tok/s (best)", "all rounds", "x HF"],
            [
                [
                    "HF generate, static batches of 32",
                    hf_best,
                    " ".join(f"{x:.0f}" for x in hf_runs),
                    1.0,
                ],
                [
                    "treadle, continuous batching (32 slots)",
                    tr_best,
                    " ".join(f"{x:.0f}" for x in tr_runs),
                    tr_best / hf_best,
                ],
            ],
        )
    )
    print()
    print(f"speedup {tr_best / hf_best:.2f}x (target >= 3x)")


if __name__ == "__main__":
    main()
