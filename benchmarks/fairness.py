"""Fair share across tenants, measured on the engine: deficit round robin by tokens
(the scheduler's ``drr``) against first-come-first-served (``fcfs``), in one run.

Runs the real ``Engine`` (a random-weight Llama built on the spot, LoRA adapters,
``forward_backward`` calls of equal size) in this process, without the gRPC
server: the scheduler decides the order inside the engine, and leaving out the
network keeps the numbers about that order (the server adds the same small cost
to every call whatever the policy).

1. Fairness. Four tenants, one model each (``--heavy-models K``: the heavy
   tenant's calls go to its K models in turn, a sweep); the heavy one has a
   backlog 10x the others'. Every call is queued before the engine runs any
   ("all submitting at once"), in two arrival orders: shuffled, and the heavy
   tenant's burst first. Jain's index of the tokens served to each tenant while
   all four are still backlogged: in the passes up to the one in which the
   first backlog empties (a pass's calls complete together). Target: >= 0.95
   for drr, and fcfs fails it.
2. Latency. A light tenant sends one call at a time (closed loop), on an idle
   engine and while the heavy tenant floods it (keeps a window of calls
   queued), in alternating blocks (a change of the machine's load weighs on
   both alike). Target: the light tenant's p50 while flooded <= its idle p50 +
   one call's service time (the engine's median compute time of one call):
   a flooded call waits behind at most one call of the heavy tenant.

    python benchmarks/fairness.py            # ~1.5 min on 2 busy CPU cores
    python benchmarks/fairness.py --preset 5m --light-calls 8

Exit status 0 when every target is met.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402

from treadle.common.engine.domain import DatumData, ForwardBackwardOp, ModelSpec  # noqa: E402
from treadle.workers.engine.loop import Engine, EngineConfig  # noqa: E402
from treadle.workers.engine.scheduler import Scheduler  # noqa: E402
from treadle.workers.model.tiny import build_tiny_model  # noqa: E402

TENANTS = ("heavy", "light-1", "light-2", "light-3")
LONG = 3600.0  # no gap timeouts in a benchmark


def _scratch(prefix: str) -> Path:
    """A temporary directory removed when this process exits."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def jain(values: Sequence[float]) -> float:
    total = sum(values)
    squares = sum(v * v for v in values)
    return total * total / (len(values) * squares) if squares else 1.0


@dataclass(frozen=True)
class Setup:
    model_dir: Path
    tokens: int
    batch: int
    threads: int
    batch_across_models: bool
    heavy_models: int = 1  # the heavy tenant's models (a sweep: its calls go to each in turn)
    max_quantum_tokens: int = 0  # the scheduler's cap on a tenant's tokens a round

    def call(self, seed: int) -> ForwardBackwardOp:
        rng = np.random.default_rng(seed)
        data = []
        for _ in range(self.batch):
            ids = rng.integers(1, 60, size=self.tokens + 1)
            data.append(
                DatumData(
                    tokens=ids[:-1].astype(np.int64),
                    inputs={
                        "target_tokens": ids[1:].astype(np.int64),
                        "weights": np.ones(self.tokens, dtype=np.float32),
                    },
                )
            )
        return ForwardBackwardOp(data=tuple(data), loss_fn="cross_entropy", loss_config={})

    @property
    def call_tokens(self) -> int:
        return self.tokens * self.batch


class Bench:
    """An engine with one LoRA model per tenant and the bookkeeping of seq_ids."""

    def __init__(self, setup: Setup, policy: str) -> None:
        self.setup = setup
        config = EngineConfig(
            base_models={"base": setup.model_dir},
            threads=setup.threads,
            gap_timeout_s=LONG,
            batch_across_models=setup.batch_across_models,
        )
        self.engine = Engine(config)
        # before start, for the engine and its ordered-call executor alike
        self.engine.scheduler = self.engine.executor.scheduler = Scheduler(
            gap_timeout_s=LONG,
            policy=policy,
            max_quantum_tokens=setup.max_quantum_tokens,
            anticipate_batched=setup.batch_across_models,
        )
        self.engine.start()
        self.models = {
            t: [f"{t}/{k}" for k in range(setup.heavy_models)]
            if t == "heavy" and setup.heavy_models > 1
            else [t]
            for t in TENANTS
        }
        self.seq = {m: 0 for ms in self.models.values() for m in ms}
        self.sent = dict.fromkeys(TENANTS, 0)
        self.lock = threading.Lock()
        for i, (tenant, ids) in enumerate(self.models.items()):
            for k, model_id in enumerate(ids):
                spec = ModelSpec(model_id, tenant, "base", 8, 8.0, 10 * i + k, "float32")
                self.engine.create_model(spec).result()
        self.ops = [setup.call(i) for i in range(8)]

    def submit(self, tenant: str) -> Future:
        """The tenant's next call, to its models in turn."""
        with self.lock:
            ids = self.models[tenant]
            model_id = ids[self.sent[tenant] % len(ids)]
            self.sent[tenant] += 1
            self.seq[model_id] += 1
            seq = self.seq[model_id]
        op = self.ops[seq % len(self.ops)]
        return self.engine.submit(model_id, seq, op, f"{model_id}-{seq}")

    def hold(self) -> threading.Event:
        """Keep the engine thread busy until the event is set, so everything sent
        meanwhile is queued before anything runs."""
        gate = threading.Event()
        self.engine._on_engine(gate.wait)  # the engine's own inbox: runs on its thread
        return gate

    def close(self) -> None:
        self.engine.stop()


# ---- 1. fairness -------------------------------------------------------------------------


def fairness(setup: Setup, policy: str, arrival: str, light_calls: int, factor: int) -> dict:
    bench = Bench(setup, policy)
    try:
        backlog = {t: light_calls * (factor if t == "heavy" else 1) for t in TENANTS}
        order = [t for t in TENANTS for _ in range(backlog[t])]
        if arrival == "shuffled":
            random.Random(0).shuffle(order)
        # (the pass it completed in, when): the calls of one pass complete
        # together, in whatever order the engine resolves them
        done: dict[str, list[tuple[int, float]]] = {t: [] for t in TENANTS}

        def passes_run() -> int:
            return sum(s.passes for s in bench.engine.passes.snapshot())

        def record(tenant: str) -> Callable[[Future], None]:
            return lambda _: done[tenant].append((passes_run(), time.perf_counter()))

        gate = bench.hold()
        futures = []
        for tenant in order:
            fut = bench.submit(tenant)
            fut.add_done_callback(record(tenant))
            futures.append(fut)
        t0 = time.perf_counter()
        gate.set()
        for fut in futures:
            fut.result()
        wall = time.perf_counter() - t0
    finally:
        bench.close()
    # while all are backlogged: up to the pass in which the first tenant's last
    # call completed (all of that pass, whichever call the engine resolved first)
    end, end_t = min(max(calls) for calls in done.values())
    served = {t: sum(1 for p, _ in done[t] if p <= end) * setup.call_tokens for t in TENANTS}
    return {
        "policy": policy,
        "arrival": arrival,
        "tokens": served,
        "jain": jain(list(served.values())),
        "wall_s": wall,
        "window_s": end_t - t0,
    }


# ---- 2. latency --------------------------------------------------------------------------


def _refiller(
    bench: Bench, flooding: threading.Event, outstanding: list[Future]
) -> Callable[[Future], None]:
    """A done-callback that sends the heavy tenant's next call while ``flooding``."""

    def refill(_: Future) -> None:
        if flooding.is_set():
            fut = bench.submit("heavy")
            fut.add_done_callback(refill)
            outstanding.append(fut)

    return refill


def latency(setup: Setup, policy: str, calls: int, window: int, blocks: int) -> dict:
    """Idle and flooded calls in alternating blocks, so a change of the machine's
    load during the run weighs on both sides of the comparison alike."""
    bench = Bench(setup, policy)
    # (when, calls) of every pass the engine starts, to see what a light call
    # waited behind: the pass running when it arrived
    passes: list[tuple[float, int]] = []
    count_pass = bench.engine.executor._count_pass

    def record_pass(model: object, n: int, tokens: int) -> None:
        passes.append((time.perf_counter(), n))
        count_pass(model, n, tokens)  # type: ignore[arg-type]

    bench.engine.executor._count_pass = record_pass  # type: ignore[method-assign]
    try:
        for _ in range(3):  # warm up (allocations, first-call costs)
            bench.submit("light-1").result()
        idle, compute, flooded, ahead = [], [], [], []
        per_block = [calls // blocks + (b < calls % blocks) for b in range(blocks)]
        for n in per_block:
            for _ in range(n):
                t0 = time.perf_counter()
                result = bench.submit("light-1").result()
                idle.append(time.perf_counter() - t0)
                compute.append(result.compute_s)
            flooding = threading.Event()
            flooding.set()
            outstanding: list[Future] = []
            refill = _refiller(bench, flooding, outstanding)
            for _ in range(window):
                fut = bench.submit("heavy")
                fut.add_done_callback(refill)
                outstanding.append(fut)
            while sum(f.done() for f in outstanding) < 3:  # the flood is flowing
                time.sleep(0.001)
            for _ in range(n):
                t0 = time.perf_counter()
                bench.submit("light-1").result()
                flooded.append(time.perf_counter() - t0)
                running = [k for when, k in passes if when <= t0]
                ahead.append(running[-1] if running else 0)
            flooding.clear()
            for fut in list(outstanding):
                fut.result()
    finally:
        bench.close()
    idle_p50 = statistics.median(idle)
    service = statistics.median(compute)
    flooded_p50 = statistics.median(flooded)
    return {
        "policy": policy,
        "idle_p50_ms": idle_p50 * 1e3,
        "flooded_p50_ms": flooded_p50 * 1e3,
        "service_ms": service * 1e3,
        "target_ms": (idle_p50 + service) * 1e3,
        "ok": flooded_p50 <= idle_p50 + service,
        "ahead_p50": statistics.median(ahead),
        "ahead_max": max(ahead),
    }


# ---- report --------------------------------------------------------------------------------


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    cells = [[str(h) for h in headers], *[[str(c) for c in row] for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = [
        "| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |"
        for row in cells
    ]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--preset", default="demo", choices=["tiny", "demo", "5m", "110m"])
    p.add_argument("--model", help="an HF model directory to use instead of building one")
    p.add_argument("--tokens", type=int, default=64, help="tokens per datum")
    p.add_argument("--batch", type=int, default=2, help="datums per call")
    p.add_argument("--light-calls", type=int, default=12, help="a light tenant's backlog")
    p.add_argument("--factor", type=int, default=10, help="the heavy backlog, in light backlogs")
    p.add_argument("--latency-calls", type=int, default=20)
    p.add_argument("--flood-window", type=int, default=32, help="heavy calls kept queued")
    p.add_argument(
        "--latency-blocks",
        type=int,
        default=4,
        help="idle and flooded light calls alternate in this many blocks",
    )
    p.add_argument("--threads", type=int, default=1, help="torch threads of the engine")
    p.add_argument(
        "--heavy-models", type=int, default=1, help="the heavy tenant's models (a sweep's runs)"
    )
    p.add_argument(
        "--max-quantum-tokens",
        type=int,
        default=0,
        help="the engine's --max-quantum-tokens (0: no cap; 1: one call a tenant a round)",
    )
    p.add_argument(
        "--batch-across-models",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the engine's cross-model training batches (its default: on)",
    )
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args(argv)

    model_dir = (
        Path(args.model)
        if args.model
        else build_tiny_model(_scratch("treadle-fairness-") / args.preset, preset=args.preset)
    )
    setup = Setup(
        model_dir,
        args.tokens,
        args.batch,
        args.threads,
        args.batch_across_models,
        args.heavy_models,
        args.max_quantum_tokens,
    )
    print(
        f"engine: {args.preset} model, LoRA rank 8, heavy tenant's models: {args.heavy_models}, "
        f"max quantum tokens: {args.max_quantum_tokens or 'no cap'}, "
        f"forward_backward of {args.batch} x "
        f"{args.tokens} = {setup.call_tokens} tokens per call, {args.threads} torch thread(s), "
        f"cross-model batches {'on' if args.batch_across_models else 'off'}",
        flush=True,
    )

    fair = [
        fairness(setup, policy, arrival, args.light_calls, args.factor)
        for arrival in ("shuffled", "heavy first")
        for policy in ("drr", "fcfs")
    ]
    print(
        f"\n1. Tokens served while all 4 tenants are backlogged (backlogs {args.light_calls * args.factor}"
        f" / {args.light_calls} / {args.light_calls} / {args.light_calls} calls, all queued at once)\n"
    )
    print(
        table(
            ["policy", "arrival", *TENANTS, "Jain", "window s", "all done s"],
            [
                [
                    r["policy"],
                    r["arrival"],
                    *(f"{r['tokens'][t]:,}" for t in TENANTS),
                    f"{r['jain']:.3f}",
                    f"{r['window_s']:.2f}",
                    f"{r['wall_s']:.2f}",
                ]
                for r in fair
            ],
        )
    )
    lat = [
        latency(setup, policy, args.latency_calls, args.flood_window, args.latency_blocks)
        for policy in ("drr", "fcfs")
    ]
    print(
        f"\n2. A light tenant's latency, one call at a time ({args.latency_calls} calls), idle vs while "
        f"the heavy tenant keeps {args.flood_window} calls queued, in {args.latency_blocks} alternating "
        "blocks; 'calls ahead': the calls in the pass running when a flooded light call arrived\n"
    )
    print(
        table(
            [
                "policy",
                "idle p50 ms",
                "flooded p50 ms",
                "one call ms",
                "target <= ms",
                "met",
                "calls ahead p50 / max",
            ],
            [
                [
                    r["policy"],
                    f"{r['idle_p50_ms']:.1f}",
                    f"{r['flooded_p50_ms']:.1f}",
                    f"{r['service_ms']:.1f}",
                    f"{r['target_ms']:.1f}",
                    "yes" if r["ok"] else "no",
                    f"{r['ahead_p50']:g} / {r['ahead_max']}",
                ]
                for r in lat
            ],
        )
    )
    drr_fair = all(r["jain"] >= 0.95 for r in fair if r["policy"] == "drr")
    fcfs_unfair = all(r["jain"] < 0.95 for r in fair if r["policy"] == "fcfs")
    drr_latency = next(r for r in lat if r["policy"] == "drr")["ok"]
    print(
        f"\ntargets: drr Jain >= 0.95: {'met' if drr_fair else 'MISSED'}; "
        f"fcfs fails it: {'yes' if fcfs_unfair else 'NO'}; "
        f"drr flooded p50 <= idle p50 + one call: {'met' if drr_latency else 'MISSED'}"
    )
    if args.json:
        Path(args.json).write_text(json.dumps({"fairness": fair, "latency": lat}, indent=2))
    return 0 if drr_fair and fcfs_unfair and drr_latency else 1


if __name__ == "__main__":
    sys.exit(main())
