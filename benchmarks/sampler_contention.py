"""What a decoding sampler costs the trainer beside it: on a thread of the same
process (``--sampler torch-thread``, sharing the GIL) or in a process of its own.

The async rungs of ``async_vs_sync.py`` need the trainer and the sampler to run
at the same time. This measures the two CPU engines' parts directly, without
the SDK, gRPC or a loop: the trainer's step is that benchmark's (full
fine-tune of the "demo" preset, ``forward_backward`` of 64 sequences x 10
tokens with the importance-sampling loss, then an AdamW step); the sampler
decodes what rung 3 keeps in flight (9 requests x 8 samples of up to 64
tokens, EOS ignored, a finished request replaced at once). Each side has one
torch thread.

Four runs, in one process and one machine state:

* trainer alone; sampler alone (in a child process);
* trainer beside the sampler on a thread of this process;
* trainer beside the sampler in a child process (its own GIL).

Reported: the trainer's median step time, the sampler's decode tokens/s over
the same window, and each against running alone.

usage: .venv/bin/python benchmarks/sampler_contention.py [--steps 20] [--model-dir DIR]
Runs in about 40 s on 2 cores.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import threading
import time
from concurrent.futures import Future
from typing import Any

import _common  # sets the thread budget before torch starts its pools
import numpy as np
import torch

from treadle.common.engine.domain import (
    AdamConfig,
    DatumData,
    ForwardBackwardOp,
    ModelSpec,
    SampleOp,
    SampleResult,
    SamplingConfig,
)
from treadle.workers.engine.base_models import BaseModelRegistry
from treadle.workers.engine.versions import WeightSnapshot
from treadle.workers.sampler.backend import SampleJob
from treadle.workers.sampler.torch_sampler import TorchSampler
from treadle.workers.trainer.trainer import TrainingModel, forward_backward

REQUESTS, SAMPLES, MAX_TOKENS = 9, 8, 64  # rung 3's buffer at groups_per_step 8
WARM_S = 2.0  # the sampler decodes this long before the trainer starts


def decode(path: str, stop: Any, tokens: Any) -> None:
    """Keep REQUESTS requests decoding until ``stop``; publish the token count."""
    torch.set_num_threads(1)
    base = BaseModelRegistry({"m": path}).get("m", torch.float32)
    sampler = TorchSampler(base, num_slots=2 * REQUESTS * SAMPLES, max_len=MAX_TOKENS + 16)
    weights = WeightSnapshot(None, 0, base.params, None)
    rng = np.random.default_rng(0)
    params = SamplingConfig(max_tokens=MAX_TOKENS, ignore_eos=True, seed=0)

    def submit() -> Future[SampleResult]:
        prompt = rng.integers(3, base.cfg.vocab_size, size=12)
        fut: Future[SampleResult] = Future()
        sampler.submit(SampleJob(sampler.base, SampleOp(prompt, SAMPLES, params), weights), fut)
        return fut

    running = [submit() for _ in range(REQUESTS)]
    while not stop.is_set():
        sampler.step()
        running = [f if not f.done() else submit() for f in running]
        tokens.value = sampler.tokens_generated


def train_steps(path: str, steps: int) -> float:
    """Median seconds of one train step (forward_backward + AdamW)."""
    torch.set_num_threads(1)
    base = BaseModelRegistry({"m": path}).get("m", torch.float32)
    model = TrainingModel(ModelSpec("m", "t", "m", 0, 0.0, 0, "float32"), base)
    rng = np.random.default_rng(0)
    V = base.cfg.vocab_size

    def datum() -> DatumData:
        return DatumData(
            rng.integers(3, V, size=10),
            {
                "target_tokens": rng.integers(3, V, size=10),
                "weights": np.ones(10, np.float32),
                "logprobs": (-3 - rng.random(10)).astype(np.float32),
                "advantages": rng.standard_normal(10).astype(np.float32),
            },
        )

    op = ForwardBackwardOp(tuple(datum() for _ in range(64)), "importance_sampling", {})
    adam = AdamConfig(learning_rate=1e-5)
    times = []
    for _ in range(steps + 2):  # two warm-up steps
        t0 = time.perf_counter()
        forward_backward(model, op)
        model.optim_step(adam)
        times.append(time.perf_counter() - t0)
    return float(np.median(times[2:]))


def beside(path: str, where: str, steps: int) -> tuple[float, float]:
    """(train step seconds or nan, decode tokens/s or nan) with the sampler ``where``."""
    ctx = mp.get_context("spawn")
    stop: Any = threading.Event() if where == "thread" else ctx.Event()
    tokens: Any = ctx.Value("q", 0)
    worker: Any = None
    if where == "thread":
        worker = threading.Thread(target=decode, args=(path, stop, tokens), daemon=True)
    elif where in ("process", "alone"):
        worker = ctx.Process(target=decode, args=(path, stop, tokens), daemon=True)
    if worker is not None:
        worker.start()
        while tokens.value == 0:  # loaded and decoding
            time.sleep(0.05)
        time.sleep(WARM_S)
    t0, n0 = time.perf_counter(), tokens.value
    if where == "alone":
        time.sleep(5.0)
        step = float("nan")
    else:
        step = train_steps(path, steps)
    rate = (tokens.value - n0) / (time.perf_counter() - t0) if worker else float("nan")
    stop.set()
    if worker is not None:
        worker.join(30)
    return step, rate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=20, help="timed train steps per run")
    ap.add_argument("--model-dir", default=None)
    args = ap.parse_args()
    path = str(_common.model_dir("demo", args.model_dir))
    runs = {where: beside(path, where, args.steps) for where in ("none", "alone")}
    runs.update({where: beside(path, where, args.steps) for where in ("thread", "process")})
    step0, rate0 = runs["none"][0], runs["alone"][1]
    labels = {
        "none": "trainer alone",
        "alone": "sampler alone (child process)",
        "thread": "trainer + sampler on a thread (one GIL)",
        "process": "trainer + sampler in a child process",
    }
    rows = []
    for where, (step, rate) in runs.items():
        rows.append(
            [
                labels[where],
                "-" if np.isnan(step) else f"{step * 1e3:.1f}",
                "-" if np.isnan(step) else f"{step / step0:.2f}",
                "-" if np.isnan(rate) else f"{rate:,.0f}",
                "-" if np.isnan(rate) else f"{rate / rate0:.2f}",
            ]
        )
    print()
    print(
        f"model demo (full fine-tune), train step 64 x 10 tokens + AdamW; sampler "
        f"{REQUESTS} x {SAMPLES} samples of {MAX_TOKENS} tokens; 1 torch thread each, "
        f"median of {args.steps} steps"
    )
    print()
    print(
        _common.table(
            ["run", "train step ms", "x alone", "decode tok/s", "x alone"],
            rows,
        )
    )


if __name__ == "__main__":
    main()
