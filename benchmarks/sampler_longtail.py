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

treadle's sampler is stepped as the engine steps it (``TorchSamplers``: each
step on the torch threads the engine measures for it, one or all of the 2,
``--sampler-thread-policy measure``, the default). HF ``generate`` runs as a
user runs it, on all 2 threads (the headline's baseline), and on 1 thread
(``HF, 1 thread``: the baseline tuned the way treadle tunes itself); "x HF" is
against the faster of the two. ``--busy N`` runs the same with N busy processes
beside it (a contended host).

The model is the "5m" preset (4.6M params) by default: HF needs 8 x 512 batch
steps, which at 110M params would take over ten minutes on 2 cores. Use
``--preset 110m`` to run it anyway; ``--preset tiny`` (64-wide) is the one where
per-step overhead decides.

usage: .venv/bin/python benchmarks/sampler_longtail.py [--preset 5m] [--rounds 2]
       [--model-dir DIR]
Thread budget: 2 (fixed). Runs in about 1-3 minutes on 2 cores (5m).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import Future

import _common  # sets the thread budget before torch starts its pools
import numpy as np
import torch
from _procs import busy_processes, cpu_share_slowdown

from treadle.common.engine.domain import SampleOp, SampleResult, SamplingConfig
from treadle.workers.engine.base_models import BaseModel, BaseModelRegistry
from treadle.workers.engine.versions import WeightSnapshot
from treadle.workers.sampler.backend import SampleJob
from treadle.workers.sampler.torch_backend import TorchSamplers
from treadle.workers.sampler.torch_sampler import SamplerLimits

CAP = 512
PROMPTS, G, BATCH, PROMPT_TOKENS = 32, 8, 32, 32


def long_tail_lengths(n: int, seed: int = 0) -> list[int]:
    """Most sequences near CAP/16 (log-normal), about 1 in 16 runs to the cap."""
    rng = np.random.default_rng(seed)
    body = np.clip(rng.lognormal(np.log(CAP / 16), 0.6, size=n), 4, CAP - 1).astype(int)
    at_cap = rng.random(n) < 1 / 16
    return [CAP if c else int(b) for b, c in zip(body, at_cap, strict=True)]


def run_treadle(
    samplers: TorchSamplers,
    base: BaseModel,
    snap: WeightSnapshot,
    prompts: np.ndarray,
    lengths: list[int],
) -> float:
    t0 = time.perf_counter()
    futures: list[Future[SampleResult]] = []
    for i, n in enumerate(lengths):
        fut: Future[SampleResult] = Future()
        params = SamplingConfig(max_tokens=n, seed=i, ignore_eos=True)
        samplers.submit(SampleJob(base, SampleOp(prompts[i // G], 1, params), snap), fut)
        futures.append(fut)
    while samplers.has_work():
        samplers.step_all()
    seconds = time.perf_counter() - t0
    got = [len(f.result().sequences[0].tokens) for f in futures]
    assert got == lengths, "every sequence must run to its forced length"
    return seconds


def run_hf(
    model: torch.nn.Module, prompts: np.ndarray, lengths: list[int], eos: int, threads: int
) -> float:
    per_batch = BATCH // G
    torch.set_num_threads(threads)
    try:
        t0 = time.perf_counter()
        for start in range(0, PROMPTS, per_batch):
            ids = torch.from_numpy(prompts[start : start + per_batch])
            longest = max(lengths[start * G : (start + per_batch) * G])
            _common.hf_generate(model, ids, longest, eos, n=G)
        return time.perf_counter() - t0
    finally:
        torch.set_num_threads(_common.THREADS)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--preset", default="5m")
    ap.add_argument("--model-dir", default=None)
    ap.add_argument(
        "--contended",
        action="store_true",
        help="also run the rows with one busy process per core beside them (HF on all "
        "threads left out there: it slowed 8x and more, many minutes a round)",
    )
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

    engines = {
        f"HF generate, static batches of 32, {_common.THREADS} threads": lambda: run_hf(
            hf, prompts, lengths, eos, _common.THREADS
        ),
        "HF generate, static batches of 32, 1 thread": lambda: run_hf(hf, prompts, lengths, eos, 1),
        "treadle, continuous batching (32 slots), engine's threads": lambda: run_treadle(
            TorchSamplers(limits), base, snap, prompts, lengths
        ),
    }
    loads = [0, os.cpu_count() or 2] if args.contended else [0]
    runs: dict[tuple[str, int], list[float]] = {}
    for busy in loads:
        with busy_processes(busy):
            for r in range(args.rounds):
                for name, fn in engines.items():
                    if busy and name.endswith(f"{_common.THREADS} threads"):
                        continue  # HF on all threads of a busy host: many minutes a round
                    runs.setdefault((name, busy), []).append(useful / fn())
                print(
                    f"busy {busy}, round {r + 1}: "
                    + ", ".join(f"{runs[(n, busy)][-1]:.0f}" for n in engines if (n, busy) in runs)
                    + " useful tok/s",
                    file=sys.stderr,
                )

    best = {k: max(v) for k, v in runs.items()}
    print()
    print(
        f"model {args.preset}: {base.cfg.num_params() / 1e6:.1f}M params, float32, "
        f"{PROMPTS} prompts x G={G}, {PROMPT_TOKENS}-token prompts, {_common.THREADS} threads"
    )
    print(
        f"lengths: {len(lengths)} sequences, median {int(np.median(lengths))}, "
        f"mean {np.mean(lengths):.0f}, {sum(n == CAP for n in lengths)} at the {CAP} cap; "
        f"{useful} useful tokens; HF static batches generate {hf_generated} "
        f"({useful / hf_generated:.0%} useful)"
    )
    print()
    rows = []
    for busy in loads:
        baseline = max(best[(n, busy)] for n in engines if n.startswith("HF") and (n, busy) in best)
        for name in engines:
            if (name, busy) not in best:
                continue
            rows.append(
                [
                    name,
                    busy,
                    best[(name, busy)],
                    " ".join(f"{x:.0f}" for x in runs[(name, busy)]),
                    best[(name, busy)] / baseline,
                    best[(name, 0)] / best[(name, busy)],
                ]
            )
    print(
        _common.table(
            ["engine", "busy", "useful tok/s (best)", "all rounds", "x faster HF", "time x idle"],
            rows,
        )
    )
    if args.contended:
        bound = cpu_share_slowdown(loads[-1])
        print(
            f"\nbound: one thread's fixed work ran {bound:.2f}x as long with {loads[-1]} busy "
            "processes beside it as alone (measured in this run)"
        )
    tr = list(engines)[-1]
    hf2 = list(engines)[0]
    print()
    print(
        f"idle: treadle {best[(tr, 0)] / max(best[(n, 0)] for n in engines if n != tr):.2f}x "
        f"the faster HF row ({best[(tr, 0)] / best[(hf2, 0)]:.2f}x HF on "
        f"{_common.THREADS} threads; target >= 3x)"
    )


if __name__ == "__main__":
    main()
