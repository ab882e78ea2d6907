"""Multi-tenant training batches: 4 tenants' ``forward_backward`` calls on one base,
batched into one pass vs run one after another.

Four LoRA models (rank 8, four tenants) on the 5M-parameter "5m" preset, built
locally. Each round every tenant submits one ``forward_backward`` call (PPO
loss); the engine's scheduler hands them out together and the engine either
runs them as one batched pass (``EngineConfig.batch_across_models=True``:
shared base matmuls, each row's adapter via ``LoraSegments``, one backward) or
one after another (``False``). Both sides go through the same ``Engine`` (its
thread, scheduler and futures), and must agree: every call's logprobs and
every adapter's accumulated gradient within 1e-5 (after one warm-up optimizer
step, so the adapters are not the zero update of a fresh LoRA).

Two sizes: small calls (1 sequence x 32 tokens), where per-call overhead
dominates and batching should pay >= 2x; medium calls (4 x 64 tokens), where
on 2 CPU cores the matmuls already fill the machine and batching must simply
not be slower (>= 1.0x). On a GPU the medium case is where batching pays.
One after another is also run with every call on all threads
(``one_thread_below=0``), the engine's behaviour before small calls ran on one
thread, so that change is measured against its baseline in the same run.

usage: .venv/bin/python benchmarks/multitenant_batching.py [--rounds 2] [--model-dir DIR]
Thread budget: 2 (fixed). Runs in about 1.5 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import _common  # sets the thread budget before torch starts its pools
import numpy as np

from treadle.workers.domain import (
    AdamConfig,
    DatumData,
    ForwardBackwardOp,
    ForwardResult,
    ModelSpec,
    OptimStepOp,
)
from treadle.workers.engine import Engine, EngineConfig

TENANTS = 4


def make_calls(rounds: int, seqs: int, tokens: int, vocab: int) -> list[list[ForwardBackwardOp]]:
    """calls[round][tenant]: the same seeded data for both sides."""
    rng = np.random.default_rng(0)

    def datum() -> DatumData:
        return DatumData(
            rng.integers(3, vocab, size=tokens),
            {
                "target_tokens": rng.integers(3, vocab, size=tokens),
                "weights": np.ones(tokens, np.float32),
                "logprobs": (-4 - rng.random(tokens)).astype(np.float32),
                "advantages": rng.standard_normal(tokens).astype(np.float32),
            },
        )

    return [
        [ForwardBackwardOp(tuple(datum() for _ in range(seqs)), "ppo", {}) for _ in range(TENANTS)]
        for _ in range(rounds)
    ]


def run(
    path: str, batched: bool, calls: list[list[ForwardBackwardOp]], one_thread_below: float = 4e9
) -> tuple[float, Any]:
    """Wall seconds for all rounds, plus every result and final gradient (to compare)."""
    config = EngineConfig(
        {"m": path},
        threads=_common.THREADS,
        batch_across_models=batched,
        one_thread_below=one_thread_below,
    )
    engine = Engine(config).start()
    try:
        ids = [f"model-{t}" for t in range(TENANTS)]
        for t, mid in enumerate(ids):
            engine.create_model(ModelSpec(mid, f"tenant-{t}", "m", 8, 16.0, t, "float32")).result()
        # Warm up, and take one optimizer step so every adapter's B is non-zero
        # (a fresh adapter computes exactly the base model).
        warm = [engine.submit(mid, 1, calls[0][t], "warm") for t, mid in enumerate(ids)]
        step = OptimStepOp(AdamConfig(learning_rate=1e-2))
        warm += [engine.submit(mid, 2, step, "step") for mid in ids]
        for fut in warm:
            fut.result()
        seq = 2
        t0 = time.perf_counter()
        futures = []
        for round_calls in calls:
            seq += 1
            for t, mid in enumerate(ids):
                futures.append(engine.submit(mid, seq, round_calls[t], f"{seq}"))
        results = [f.result() for f in futures]
        seconds = time.perf_counter() - t0
        grads = [
            {k: v.grad.clone() for k, v in engine.models[mid].trainable.items()} for mid in ids
        ]
    finally:
        engine.stop()
    return seconds, (results, grads)


def max_diff(a: Any, b: Any) -> tuple[float, float]:
    """(largest |logprob difference|, largest gradient difference relative to the
    gradient's largest entry): accumulated over many calls, gradients are large."""
    lp = 0.0
    for x, y in zip(a[0], b[0], strict=True):
        assert isinstance(x, ForwardResult) and isinstance(y, ForwardResult)
        for p, q in zip(x.logprobs, y.logprobs, strict=True):
            lp = max(lp, float(np.abs(p - q).max()))
    grad = 0.0
    for gx, gy in zip(a[1], b[1], strict=True):
        for k in gx:
            scale = max(float(gy[k].abs().max()), 1e-12)
            grad = max(grad, float((gx[k] - gy[k]).abs().max()) / scale)
    return lp, grad


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2, help="timed repetitions of each side")
    ap.add_argument("--model-dir", default=None)
    args = ap.parse_args()
    path = str(_common.model_dir("5m", args.model_dir))
    from treadle.workers.model.loading import load_config

    cfg = load_config(path)
    cases = [("small", 1, 32, 40), ("medium", 4, 64, 12)]  # name, seqs, tokens, rounds of calls
    rows = []
    for name, seqs, tokens, n_calls in cases:
        calls = make_calls(n_calls, seqs, tokens, cfg.vocab_size)
        total = n_calls * TENANTS * seqs * tokens
        seq_runs, bat_runs, all_runs, lp_diff, grad_diff = [], [], [], 0.0, 0.0
        for _ in range(args.rounds):
            # the engine's default, and (for the record) every call on all threads
            a_time, _ = run(path, False, calls, one_thread_below=0)
            s_time, s_out = run(path, False, calls)
            b_time, b_out = run(path, True, calls)
            all_runs.append(total / a_time)
            seq_runs.append(total / s_time)
            bat_runs.append(total / b_time)
            lp, grad = max_diff(s_out, b_out)
            lp_diff, grad_diff = max(lp_diff, lp), max(grad_diff, grad)
        assert lp_diff <= 1e-5 and grad_diff <= 1e-5, (lp_diff, grad_diff)
        seq_best, bat_best = max(seq_runs), max(bat_runs)
        rows.append(
            [
                f"{name} ({seqs} x {tokens} tokens)",
                max(all_runs),
                seq_best,
                bat_best,
                bat_best / seq_best,
                f"{lp_diff:.1e}",
                f"{grad_diff:.1e}",
            ]
        )
        print(f"{name}: one after another {seq_runs}, batched {bat_runs} tok/s", flush=True)
    print()
    print(
        f"model 5m: {cfg.num_params() / 1e6:.1f}M params, float32, {TENANTS} tenants x LoRA rank 8, "
        f"PPO loss, {_common.THREADS} threads, best of {args.rounds}"
    )
    print()
    print(
        _common.table(
            [
                "calls",
                "one after another, all threads tok/s",
                "one after another tok/s",
                "batched tok/s",
                "speedup",
                "logprobs max |diff|",
                "grads max |diff| / max |g|",
            ],
            rows,
        )
    )
    print()
    print("targets: small >= 2x, medium >= 1.0x; numerics <= 1e-5")


if __name__ == "__main__":
    main()
