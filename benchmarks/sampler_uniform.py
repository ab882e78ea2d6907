"""Uniform batch: treadle's torch sampler vs HF ``generate``, and this machine's limits.

32 prompts of 32 tokens, 128 new tokens each (EOS suppressed on both sides, so
every sequence has the same length), batch 32, on the 110M-parameter
Llama-style model built locally (``build_tiny_model(dir, preset="110m")``:
hidden 768, 12 layers, vocab 32k, tied embeddings, 109.5M params). treadle runs
at engine level (``TorchSampler``: continuous batching, preallocated KV cache);
HF runs ``LlamaForCausalLM.generate`` with sdpa attention and sampling at
temperature 1 (no top-k/top-p on either side). The two sides alternate, and
each reports its best round, since this shared 2-core machine is noisy.

The 2N-FLOP bound: decoding costs 2N FLOP per token, so this machine's measured
fp32 matmul rate (same run) caps decode at ``GFLOP/s / 2N`` tokens/s. The
weight-read bound (batch x bandwidth / weight bytes) is printed too.

usage: .venv/bin/python benchmarks/sampler_uniform.py [--rounds 2] [--dtype float32]
       [--batch 32] [--new-tokens 128] [--model-dir DIR]
Thread budget: 2 (fixed). Runs in about 2-4 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import time
from concurrent.futures import Future
from dataclasses import replace

import _common  # sets the thread budget before torch starts its pools
import numpy as np
import torch

from treadle.common.engine.domain import SampleOp, SampleResult, SamplingConfig
from treadle.workers.engine.base_models import BaseModelRegistry, parse_dtype
from treadle.workers.engine.versions import WeightSnapshot
from treadle.workers.model import prepack
from treadle.workers.sampler.backend import SampleJob
from treadle.workers.sampler.torch_sampler import SamplerLimits, TorchSampler


def run_treadle(
    sampler: TorchSampler, snap: WeightSnapshot, prompts: np.ndarray, lengths: list[int]
) -> tuple[float, int]:
    t0 = time.perf_counter()
    futures: list[Future[SampleResult]] = []
    for i, (prompt, n) in enumerate(zip(prompts, lengths, strict=True)):
        fut: Future[SampleResult] = Future()
        params = SamplingConfig(max_tokens=n, seed=i, ignore_eos=True)
        sampler.submit(SampleJob(sampler.base, SampleOp(prompt, 1, params), snap), fut)
        futures.append(fut)
    while sampler.has_work():
        sampler.step()
    seconds = time.perf_counter() - t0
    got = [len(s.tokens) for f in futures for s in f.result().sequences]
    assert got == lengths, "every sequence must run to its forced length"
    return seconds, sum(got)


def run_hf(model: torch.nn.Module, prompts: np.ndarray, new_tokens: int, eos: int) -> float:
    ids = torch.from_numpy(prompts)
    t0 = time.perf_counter()
    _common.hf_generate(model, ids, new_tokens, eos)
    seconds = time.perf_counter() - t0
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--preset", default="110m")
    ap.add_argument("--model-dir", default=None)
    args = ap.parse_args()

    from transformers import LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    dtype = parse_dtype(args.dtype)
    path = _common.model_dir(args.preset, args.model_dir)
    base = BaseModelRegistry({"m": path}).get("m", dtype)
    n_params = base.cfg.num_params()
    eos = base.cfg.eos_token_ids[0]
    hf = LlamaForCausalLM.from_pretrained(path, attn_implementation="sdpa", dtype=dtype).eval()

    rng = np.random.default_rng(0)
    B, P, N = args.batch, args.prompt_tokens, args.new_tokens
    prompts = rng.integers(3, base.cfg.vocab_size, size=(B, P)).astype(np.int64)
    lengths = [N] * B
    limits = SamplerLimits(num_slots=B, max_len=P + N + 1)
    snap = WeightSnapshot(None, 0, base.params, None)

    gflops = _common.matmul_gflops(dtype)
    gbs = _common.memory_gbs()
    # the prepacking method is measured once per process (before any timed round)
    method = prepack.method_for(base.params, B) if prepack.available(base.params) else "none"
    hf_runs, plain_runs, tr_runs = [], [], []
    for r in range(args.rounds):
        hf_runs.append(B * N / run_hf(hf, prompts, N, eos))
        # treadle without prepacked weights (its own baseline): drop the packed copies
        # an earlier round attached, or its plain products would use them
        prepack.unpack(base.params)
        sampler = TorchSampler(base, limits=replace(limits, prepack=False))
        seconds, tokens = run_treadle(sampler, snap, prompts, lengths)
        plain_runs.append(tokens / seconds)
        sampler = TorchSampler(base, limits=limits)
        seconds, tokens = run_treadle(sampler, snap, prompts, lengths)
        tr_runs.append(tokens / seconds)
        print(
            f"round {r + 1}: HF {hf_runs[-1]:.1f} tok/s, treadle {tr_runs[-1]:.1f} tok/s "
            f"(plain weights {plain_runs[-1]:.1f})"
        )
    gflops = max(gflops, _common.matmul_gflops(dtype))  # the machine's best in this run

    flop_bound = gflops * 1e9 / (2 * n_params)
    bytes_per_param = torch.finfo(dtype).bits // 8
    read_bound = B * gbs * 1e9 / (n_params * bytes_per_param)
    hf_best, plain_best, tr_best = max(hf_runs), max(plain_runs), max(tr_runs)
    print()
    print(
        f"model {args.preset}: {n_params / 1e6:.1f}M params, {args.dtype}, batch {B}, "
        f"{P}-token prompts, {N} new tokens, {_common.THREADS} threads"
    )
    print(
        f"machine: matmul {gflops:.0f} GFLOP/s ({args.dtype}), copy {gbs:.1f} GB/s -> "
        f"2N-FLOP bound {flop_bound:.0f} tok/s, weight-read bound {read_bound:.0f} tok/s at batch {B}"
    )
    print()
    print(
        _common.table(
            ["engine", "tok/s (best)", "all rounds", "x HF", "of 2N-FLOP bound"],
            [
                [
                    "HF generate (sdpa)",
                    hf_best,
                    " ".join(f"{x:.0f}" for x in hf_runs),
                    1.0,
                    f"{hf_best / flop_bound:.0%}",
                ],
                [
                    "treadle, plain weights",
                    plain_best,
                    " ".join(f"{x:.0f}" for x in plain_runs),
                    plain_best / hf_best,
                    f"{plain_best / flop_bound:.0%}",
                ],
                [
                    "treadle TorchSampler",
                    tr_best,
                    " ".join(f"{x:.0f}" for x in tr_runs),
                    tr_best / hf_best,
                    f"{tr_best / flop_bound:.0%}",
                ],
            ],
        )
    )
    print()
    print(
        f"speedup {tr_best / hf_best:.2f}x (target >= 1.5x at fp32); prepacked weights ({method}) "
        f"{tr_best / plain_best:.2f}x plain ones"
    )


if __name__ == "__main__":
    main()
