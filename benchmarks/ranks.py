"""A worker as a group of ranks (``--ranks``, issue 36): step time and peak memory
per rank of a full fine-tune, 1 rank against 2, in one run.

Each configuration runs in a fresh process (this script with ``--one RANKS``):
the engine of a worker (``workers.group.launch.build_engine``, as ``treadle
serve --ranks`` builds it) with one full fine-tune of the ``--preset`` (110m)
in float32, and ``--steps`` steps of ``forward_backward`` (cross-entropy on
``--batch`` x ``--length`` random tokens) + ``optim_step`` after one untimed
step. The machine's cores are shared out: 1 rank runs ``THREADS`` torch
threads, each of 2 ranks ``THREADS / 2``, so both rows use the same cores.

Columns: the median step time; each rank's peak RSS (``VmHWM``: rank 0 is the
process that runs the engine, the others its rank processes); and the bytes of
the model's parameters + gradients + Adam moments a rank holds between calls,
counted on rank 0 from its tensors after the last ``forward_backward`` (its
gradients accumulated, before the step; the other ranks hold shards of the
same sizes).

What to expect: on 2 ranks a full fine-tune is sharded with FSDP2
(``workers.trainer.fsdp``, ``fully_shard``: each rank keeps half of every
weight, of its gradient and of its Adam moments), so parameters + gradients +
Adam per rank are half of 1 rank's. Each rank's peak RSS is lower too: FSDP
gathers the weights one layer at a time (two in the backward, which prefetches
the next; the embedding, norm and head for the whole pass), and each rank keeps
the activations of half the datums, as activation checkpointing does (each
layer is recomputed in the backward), where the one-rank row keeps every
activation. On a 2-core machine
2 ranks of 1 thread do the work of 1 rank of 2 threads, plus the all-gathers,
reduce-scatters and recompute, and a second process: expect no speed-up.

With ``--lora R``: one LoRA model of rank R instead. On 2 ranks its frozen base
is sharded (``workers.trainer.sharded_base``); the adapter is replicated. The
last columns are then the base's bytes each rank holds after the steps: rank 0
its shard and the whole base (which its sampler and whole reads use), every
other rank its shard only (counted on rank 0 from the shard's sizes: the other
ranks' are the same, at most a row more per tensor); and each rank's RSS after
the steps (``VmRSS``: a rank other than 0 read the whole base once to shard it,
so its peak is not what it keeps).

With ``--tenants N``: N tenants' LoRA models of rank ``--lora`` (default 8) on
one base, each step every tenant's ``forward_backward`` submitted at once, then
every ``optim_step``; 1 rank and 2, each with mixed-tenant batched passes
(``batch_across_models``, the default) and without (each call alone, split
across the ranks). Columns: the median time of a step of all N tenants, and the
engine's pass counter (batched passes, the most calls in one).

    python benchmarks/ranks.py                      # 110m, 4 x 256, 3 steps
    python benchmarks/ranks.py --preset 5m --steps 2   # quick
    python benchmarks/ranks.py --lora 16            # LoRA on a sharded base
    python benchmarks/ranks.py --tenants 3 --preset 5m --batch 2 --length 64
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import THREADS, model_dir, table  # noqa: E402


def _hwm_bytes(pid: int, field: str = "VmHWM") -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    return 0


def _base_bytes(model: object) -> list[int]:
    """A LoRA model's base bytes held by rank 0 and by every other rank."""
    from torch.distributed.tensor import DTensor

    base = model.base  # type: ignore[attr-defined]
    whole = sum(t.numel() * t.element_size() for _, t in base.params.named_tensors())
    sharding = model.sharding  # type: ignore[attr-defined]
    if sharding is None:
        return [whole]
    shard = sum(
        t.to_local().numel() * t.element_size()
        for _, t in sharding.params().named_tensors()
        if isinstance(t, DTensor)
    )
    return [whole + shard, shard]


def _held_bytes(model: object) -> int:
    """The weights, accumulated gradients and Adam moments ``model`` holds here."""
    opt = model.optimizer  # type: ignore[attr-defined]
    grads = [p.grad for p in opt.params.values() if p.grad is not None]
    tensors = [*opt.params.values(), *grads, *opt.exp_avg.values(), *opt.exp_avg_sq.values()]
    return sum(t.numel() * t.element_size() for t in tensors)


def one(
    ranks: int, model: Path, steps: int, batch: int, length: int, lora: int = 0
) -> dict[str, object]:
    import numpy as np

    from treadle.common.engine.domain import (
        AdamConfig,
        DatumData,
        ForwardBackwardOp,
        ModelSpec,
        OptimStepOp,
    )
    from treadle.workers.engine.config import EngineConfig
    from treadle.workers.group.launch import build_engine

    threads = max(1, THREADS // ranks)
    config = EngineConfig(base_models={"m": model}, ranks=ranks, threads=threads)
    engine = build_engine(config).start()
    spec = ModelSpec("full", "t", "m", lora, 0.0, 0, "float32")
    engine.create_model(spec).result()
    rng = np.random.default_rng(0)
    vocab = engine.bases.config("m").vocab_size
    data = tuple(
        DatumData(
            rng.integers(3, vocab, length),
            {"target_tokens": rng.integers(3, vocab, length), "weights": np.ones(length)},
        )
        for _ in range(batch)
    )
    seq, times, per_rank_state = 1, [], 0
    for i in range(steps + 1):
        t0 = time.perf_counter()
        engine.submit("full", seq, ForwardBackwardOp(data, "cross_entropy", {}), f"f{i}").result()
        if i == steps:  # the gradients held, before the step consumes them
            per_rank_state = _held_bytes(engine.models["full"])
        engine.submit(
            "full", seq + 1, OptimStepOp(AdamConfig(learning_rate=1e-5)), f"o{i}"
        ).result()
        seq += 2
        if i:
            times.append(time.perf_counter() - t0)
    children = [p.pid for p in multiprocessing.active_children() if p.pid]
    pids = [os.getpid(), *children]
    peaks = [_hwm_bytes(pid) for pid in pids]
    rss = [_hwm_bytes(pid, "VmRSS") for pid in pids]
    base = _base_bytes(engine.models["full"]) if lora else []
    engine.stop()
    return {
        "ranks": ranks,
        "threads": threads,
        "step_s": statistics.median(times),
        "peaks": peaks,
        "rss": rss,
        "state": per_rank_state,
        "base": base,
    }


def tenants_one(
    ranks: int, model: Path, steps: int, batch: int, length: int, lora: int, tenants: int,
    batched: bool,
) -> dict[str, object]:  # fmt: skip
    import numpy as np

    from treadle.common.engine.domain import (
        AdamConfig,
        DatumData,
        ForwardBackwardOp,
        ModelSpec,
        OptimStepOp,
    )
    from treadle.workers.engine.config import EngineConfig
    from treadle.workers.group.launch import build_engine

    threads = max(1, THREADS // ranks)
    config = EngineConfig(
        base_models={"m": model}, ranks=ranks, threads=threads, batch_across_models=batched
    )
    engine = build_engine(config).start()
    ids = [f"t{i}" for i in range(tenants)]
    for i, model_id in enumerate(ids):
        engine.create_model(ModelSpec(model_id, model_id, "m", lora, 0.0, i, "float32")).result()
    rng = np.random.default_rng(0)
    vocab = engine.bases.config("m").vocab_size

    def data() -> tuple[DatumData, ...]:
        return tuple(
            DatumData(
                rng.integers(3, vocab, length),
                {"target_tokens": rng.integers(3, vocab, length), "weights": np.ones(length)},
            )
            for _ in range(batch)
        )

    seq, times = 1, []
    for i in range(steps + 1):
        ops = {model_id: ForwardBackwardOp(data(), "cross_entropy", {}) for model_id in ids}
        t0 = time.perf_counter()
        calls = [engine.submit(m, seq, op, f"f{m}{i}") for m, op in ops.items()]
        for fut in calls:
            fut.result()
        steps_done = [
            engine.submit(m, seq + 1, OptimStepOp(AdamConfig(learning_rate=1e-5)), f"o{m}{i}")
            for m in ids
        ]
        for fut in steps_done:
            fut.result()
        seq += 2
        if i:
            times.append(time.perf_counter() - t0)
    passes = engine.pass_metrics()
    engine.stop()
    return {
        "ranks": ranks,
        "threads": threads,
        "batched": batched,
        "step_s": statistics.median(times),
        "batched_passes": sum(s.batched_passes for s in passes),
        "max_calls": max((s.max_calls_per_pass for s in passes), default=0),
    }


def _tenants_table(args: argparse.Namespace, model: Path) -> None:
    rows, base = [], None
    lora = args.lora or 8
    for ranks in (1, 2):
        for batched in (False, True):
            cmd = [sys.executable, __file__, "--one", str(ranks), "--model-dir", str(model)]
            cmd += ["--steps", str(args.steps), "--batch", str(args.batch)]
            cmd += ["--length", str(args.length), "--lora", str(lora)]
            cmd += ["--tenants", str(args.tenants)] + ([] if batched else ["--alone"])
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            r = json.loads(out.strip().splitlines()[-1])
            base = base or r
            rows.append(
                [
                    r["ranks"],
                    r["threads"],
                    "batched" if r["batched"] else "each alone",
                    r["step_s"] * 1e3,
                    f"{r['step_s'] / base['step_s']:.2f}x",
                    r["batched_passes"],
                    r["max_calls"],
                ]
            )
    print(
        f"{args.preset}, {args.tenants} tenants' LoRA rank {lora}, {args.batch} x {args.length} "
        f"tokens each, float32, median of {args.steps} steps; {THREADS} cores shared out"
    )
    head = ["ranks", "threads/rank", "passes", "ms/step (all tenants)", "vs 1 rank alone"]
    print(table([*head, "batched passes", "most calls in one"], rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="110m")
    parser.add_argument("--model-dir", default=None)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--lora", type=int, default=0, help="a LoRA model of this rank")
    parser.add_argument("--tenants", type=int, default=0, help="N tenants' LoRA models")
    parser.add_argument("--alone", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--one", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    model = model_dir(args.preset, args.model_dir)
    if args.one and args.tenants:
        r = tenants_one(
            args.one, model, args.steps, args.batch, args.length, args.lora, args.tenants,
            not args.alone,
        )  # fmt: skip
        print(json.dumps(r))
        return
    if args.tenants:
        _tenants_table(args, model)
        return
    if args.one:
        print(json.dumps(one(args.one, model, args.steps, args.batch, args.length, args.lora)))
        return
    rows, base = [], None
    for ranks in (1, 2):
        cmd = [sys.executable, __file__, "--one", str(ranks), "--model-dir", str(model)]
        cmd += ["--steps", str(args.steps), "--batch", str(args.batch)]
        cmd += ["--length", str(args.length), "--lora", str(args.lora)]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        r = json.loads(out.strip().splitlines()[-1])
        base = base or r
        gib = 2**30
        row = [
            r["ranks"],
            r["threads"],
            r["step_s"] * 1e3,
            f"{r['step_s'] / base['step_s']:.2f}x",
            " / ".join(f"{p / gib:.2f}" for p in r["peaks"]),
        ]
        if args.lora:
            row += [
                " / ".join(f"{b / gib:.3f}" for b in r["base"]),
                " / ".join(f"{p / gib:.2f}" for p in r["rss"]),
            ]
        else:
            row += [r["state"] / gib, f"{r['state'] / base['state']:.2f}x"]
        rows.append(row)
    kind = f"LoRA rank {args.lora}" if args.lora else "full fine-tune"
    print(
        f"{args.preset} {kind}, {args.batch} x {args.length} tokens, float32, "
        f"median of {args.steps} steps; {THREADS} cores shared out"
    )
    last = (
        ["base GiB per rank (0 / others)", "RSS after GiB per rank (0 / 1)"]
        if args.lora
        else ["params+grads+Adam GiB/rank", "vs 1 rank"]
    )
    head = ["ranks", "threads/rank", "ms/step", "vs 1 rank", "peak RSS GiB per rank (0 / 1)"]
    print(table([*head, *last], rows))


if __name__ == "__main__":
    main()
