"""Multi-tenant training batches: 4 tenants' ``forward_backward`` calls on one base,
batched into one pass vs run one after another.

Four LoRA models (rank 8, four tenants) on the 5M-parameter "5m" preset, built
locally. Each round every tenant submits one ``forward_backward`` call (PPO
loss); the engine's scheduler hands them out together and the engine either
runs them as one batched pass (``EngineConfig.batch_across_models=True``:
shared base matmuls, each row's adapter via ``LoraRows``, one backward) or
one after another (``False``). Both sides go through the same ``Engine`` (its
thread, scheduler and futures), and must agree: every call's logprobs and
every adapter's accumulated gradient within 1e-5 (after one warm-up optimizer
step, so the adapters are not the zero update of a fresh LoRA).

Two sizes: small calls (1 sequence x 32 tokens), where the issue expects
per-call overhead to dominate and batching to pay >= 2x; medium calls (4 x 64
tokens), where on 2 CPU cores the matmuls already fill the machine and
batching must simply not be slower (>= 1.0x). On a GPU the medium case is
where batching pays. A third case, mixed (the tenants send 1, 2, 3 and 4
sequences x 48 tokens), gives the adapters unequal row counts: the batched pass
cannot split its rows into equal segments and takes ``LoraRows``' per-adapter
form (each adapter on its own contiguous rows), as calls of different sizes do.

One after another runs three ways: every call on one torch thread, every call
on both, and the engine's default (``training_threads="measure"``: whichever
of the two this machine runs faster for that kind and size of call). Batched
runs with the engine's default. The speedup is batched against the best of
the three, so no thread setting flatters either side.

The bound (small calls): the same rounds sent by one tenant's one model,
batched into the same passes, so the 128 tokens go through one adapter instead
of four: the same base work, and one adapter's LoRA work on those tokens,
which no way of applying four adapters to them can undercut. At 128 tokens
(the matmuls' rows) the single-adapter form (two plain matmuls per projection)
was as cheap as any form timed on a 2-core Xeon: one 256 -> 688 projection's
LoRA work, forward and backward, on top of the base matmul's, took ~200 µs
that way, 184-207 µs with ``addmm`` variants, 235 µs with the LoRA columns
appended to the base matmul and 288-301 µs in ``low_rank``'s rank-outer
orientation (scratch timings, 2 threads). So the bound's speedup is about what
a perfect multi-LoRA batch would reach on such a machine. It is not printed
for the medium calls: at 1,024 tokens one adapter's thin products run slower
than four adapters' segments, so one adapter bounds nothing there.

usage: .venv/bin/python benchmarks/multitenant_batching.py [--rounds 2] [--model-dir DIR]
    [--cases small,medium,mixed]
Thread budget: 2 (fixed). Runs in about 3 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import _common  # sets the thread budget before torch starts its pools
import numpy as np

from treadle.common.engine.domain import (
    AdamConfig,
    DatumData,
    ForwardBackwardOp,
    ForwardResult,
    ModelSpec,
    OptimStepOp,
)
from treadle.workers.engine.loop import Engine, EngineConfig

TENANTS = 4
WARMUP_ROUNDS = 8  # ThreadChoice's trials (3) on each option, and a margin


def make_calls(
    rounds: int, seqs: tuple[int, ...], tokens: int, vocab: int
) -> list[list[ForwardBackwardOp]]:
    """calls[round][tenant]: the same seeded data for both sides; tenant t's calls
    hold ``seqs[t]`` sequences."""
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
        [ForwardBackwardOp(tuple(datum() for _ in range(n)), "ppo", {}) for n in seqs]
        for _ in range(rounds)
    ]


def run(
    path: str,
    batched: bool,
    calls: list[list[ForwardBackwardOp]],
    threads: str = "measure",
    one_adapter: bool = False,
) -> tuple[float, Any]:
    """Wall seconds for all rounds, plus every result and final gradient (to compare).

    ``one_adapter``: the bound of a multi-LoRA batch of small calls. One model (one tenant,
    one adapter) sends all four calls of each round, and the scheduler hands
    them out together, so the engine's batched pass runs the same rows through
    a single adapter (``LoraAdapter.apply``, two plain matmuls per projection)
    instead of four (``LoraRows``): the same base work, the least LoRA work
    those rows can take. Its gradients are one model's, not comparable."""
    config = EngineConfig(
        {"m": path},
        threads=_common.THREADS,
        batch_across_models=batched,
        training_threads=threads,
    )
    engine = Engine(config).start()
    try:
        ids = [f"model-{t}" for t in range(TENANTS)]
        if one_adapter:
            ids = ids[:1]
            # Every call of a round in one scheduler round (the default quantum
            # is one head call's tokens).
            engine.scheduler.quantum_tokens = sum(len(d.tokens) for c in calls[0] for d in c.data)
        for t, mid in enumerate(ids):
            engine.create_model(ModelSpec(mid, f"tenant-{t}", "m", 8, 16.0, t, "float32")).result()

        def submit_round(round_calls: list[ForwardBackwardOp], seq: int, tag: str) -> list[Any]:
            """Each tenant's call of the round; with one model, all of them in seq order."""
            if one_adapter:
                return [engine.submit(ids[0], seq + k, op, tag) for k, op in enumerate(round_calls)]
            return [engine.submit(mid, seq, round_calls[t], tag) for t, mid in enumerate(ids)]

        per_round = TENANTS if one_adapter else 1  # seq_ids a model uses per round
        # Warm-up rounds (untimed): a measuring engine times each call size on one
        # thread and on all first (``workers.device.thread_choice``). Then one optimizer
        # step, so every adapter's B is non-zero (a fresh adapter computes exactly
        # the base model).
        step = OptimStepOp(AdamConfig(learning_rate=1e-2))
        seq = 1
        for round_calls in calls[:WARMUP_ROUNDS]:
            for fut in submit_round(round_calls, seq, "w"):
                fut.result()
            seq += per_round
        for fut in [engine.submit(mid, seq, step, "step") for mid in ids]:
            fut.result()
        seq += 1
        t0 = time.perf_counter()
        futures = []
        for round_calls in calls[WARMUP_ROUNDS:]:
            futures += submit_round(round_calls, seq, f"{seq}")
            seq += per_round
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
    ap.add_argument("--cases", default="small,medium,mixed", help="which cases to run")
    args = ap.parse_args()
    path = str(_common.model_dir("5m", args.model_dir))
    from treadle.workers.model.loading import load_config

    cfg = load_config(path)
    # name, each tenant's sequences a call, tokens, timed rounds of calls (after
    # WARMUP_ROUNDS more)
    cases = [
        ("small", (1,) * TENANTS, 32, 40),
        ("medium", (4,) * TENANTS, 64, 12),
        ("mixed", (1, 2, 3, 4), 48, 12),
    ]
    chosen = args.cases.split(",")
    rows = []
    for name, seqs, tokens, n_calls in [c for c in cases if c[0] in chosen]:
        calls = make_calls(WARMUP_ROUNDS + n_calls, seqs, tokens, cfg.vocab_size)
        total = n_calls * sum(seqs) * tokens
        sides: dict[str, list[float]] = {"one": [], "all": [], "measure": [], "batched": []}
        if name == "small":
            sides["bound"] = []
        lp_diff, grad_diff = 0.0, 0.0
        for _ in range(args.rounds):
            outs = {}
            for side in sides:
                batched = side in ("batched", "bound")
                seconds, outs[side] = run(
                    path,
                    batched,
                    calls,
                    "measure" if batched else side,
                    one_adapter=side == "bound",
                )
                sides[side].append(total / seconds)
            lp, grad = max_diff(outs["measure"], outs["batched"])
            lp_diff, grad_diff = max(lp_diff, lp), max(grad_diff, grad)
        assert lp_diff <= 1e-5 and grad_diff <= 1e-5, (lp_diff, grad_diff)
        best = {side: max(runs) for side, runs in sides.items()}
        seq_best = max(best["one"], best["all"], best["measure"])
        rows.append(
            [
                f"{name} ({'/'.join(map(str, sorted(set(seqs))))} x {tokens} tokens)",
                best["one"],
                best["all"],
                best["measure"],
                best["batched"],
                best["batched"] / seq_best,
                best.get("bound", "-"),
                best["bound"] / seq_best if "bound" in best else "-",
                f"{lp_diff:.1e}",
                f"{grad_diff:.1e}",
            ]
        )
        print(f"{name}: tok/s per round {sides}", flush=True)
    print()
    print(
        f"model 5m: {cfg.num_params() / 1e6:.1f}M params, float32, {TENANTS} tenants x LoRA rank 8, "
        f"PPO loss, {_common.THREADS} threads, OMP_WAIT_POLICY {_common.OMP_WAIT_POLICY}, "
        f"best of {args.rounds}"
    )
    print()
    print(
        _common.table(
            [
                "calls",
                "one after another, 1 thread tok/s",
                f"one after another, {_common.THREADS} threads",
                "one after another, measured",
                "batched, measured",
                "speedup (vs best one after another)",
                "bound: one adapter on the same tokens",
                "bound speedup",
                "logprobs max |diff|",
                "grads max |diff| / max |g|",
            ],
            rows,
        )
    )
    print()
    print("targets: small >= 2x, medium and mixed >= 1.0x; numerics <= 1e-5")


if __name__ == "__main__":
    main()
