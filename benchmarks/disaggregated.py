"""Weights shipped per version to a sampler pool: what one ``sync_weights`` costs
when samplers live apart from the trainer, against the colocated baseline.

Two engines in this process, as a trainer worker and a sampler worker hold
them: each round is ``forward_backward`` + ``optim_step`` on the trainer, then

- colocated (baseline): ``sync_weights`` alone, which is what a sampler on the
  trainer's own worker waits for;
- pool: ``sync_weights``, then the trainer writes the version to the store
  (``ShipVersionCall``: safetensors) and the sampler engine reads it and serves
  it (``LoadVersionCall``): the time from the sync to the pool serving it, and
  the bytes shipped.

The first version the pool loads is not timed (its engine reads the base
then). The store here is a local directory, so the figures hold the serialisation and
the file I/O but not an S3 upload and download (add the object store's
bandwidth for the bytes shown). One torch thread per engine.

Two more tables, each with its baseline in the same run:

- sampled tokens/s: the same requests (``--requests`` of ``--group`` samples,
  ``--max-tokens`` each, EOS ignored, all in flight at once) on the trainer's own
  engine (colocated), on 1 pool engine, and on 2 pool engines (each request to the
  one with the fewest in flight, as the server routes);
- an async RL step (one step off-policy, as ``treadle.rl.async_loop``): the next
  batch samples while the trainer takes ``forward_backward`` on the last one (its
  sampled tokens; cross-entropy stands in for the policy loss, the same passes),
  ``optim_step`` and ``sync_weights``; with a pool, the version is then shipped and
  loaded before the step ends. Colocated, the trainer's engine samples between
  its training calls (the default sampler, one thread), or on a sampler thread of
  its own (one more thread, as many as trainer + pool engine have).

The engines are threads of one process, so on a host of N cores a pool adds no
cores: trainer and pool engines share them. On 2 cores neither the second pool
worker nor the pool itself can speed anything up; the tables say by how much
they cost instead. A pool pays where it has devices of its own.

usage: .venv/bin/python benchmarks/disaggregated.py [--rounds 20] [--presets 5m 110m]
         [--steps 6] [--requests 8] [--group 4] [--max-tokens 32]
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import _common  # noqa: E402  (tables, scratch directories, one thread)
import numpy as np  # noqa: E402

from treadle.common.engine.domain import (  # noqa: E402
    AdamConfig,
    DatumData,
    ForwardBackwardOp,
    ModelSpec,
    OptimStepOp,
    SampleOp,
    SampleResult,
    SamplerTarget,
    SamplingConfig,
    SyncWeightsOp,
)
from treadle.common.engine.messages import LoadVersionCall, ShipVersionCall  # noqa: E402
from treadle.workers.engine.loop import Engine, EngineConfig  # noqa: E402


def _datum(rng: np.random.Generator, n: int) -> DatumData:
    tokens = rng.integers(3, 90, size=n)
    return DatumData(
        tokens,
        {"target_tokens": np.roll(tokens, -1), "weights": np.ones(n, np.float32)},
    )


def run(model: Path, rank: int, rounds: int) -> dict[str, object]:
    store = _common.scratch("treadle-bench-pool-store-")
    trainer = Engine(EngineConfig({"m": model}, threads=1)).start()
    pool = Engine(EngineConfig({"m": model}, threads=1)).start()
    rng = np.random.default_rng(0)
    colocated, shipped, sizes = [], [], []
    seq = 0
    try:
        trainer.create_model(ModelSpec("bench", "t", "m", rank, 32.0, 0, "float32")).result(600)

        def submit(op: object) -> object:
            nonlocal seq
            seq += 1
            return trainer.submit("bench", seq, op, f"d{seq}").result(600)  # type: ignore[arg-type]

        # warm-up, untimed: the pool engine reads its base on the first version it loads
        warm = str(store / "v0")
        trainer.call(ShipVersionCall("bench", 0, warm)).result(600)
        pool.call(LoadVersionCall(SamplerTarget("m", "bench", 0, "t"), warm)).result(600)
        for r in range(rounds):
            submit(ForwardBackwardOp((_datum(rng, 32),), "cross_entropy", {}))
            submit(OptimStepOp(AdamConfig(learning_rate=1e-4)))
            t0 = time.perf_counter()
            version = submit(SyncWeightsOp()).version  # type: ignore[attr-defined]
            t_sync = time.perf_counter() - t0
            if r % 2 == 0:  # alternate rounds, so both sides see the same noise
                colocated.append(t_sync)
                continue
            path = str(store / f"v{version}")
            out = trainer.call(ShipVersionCall("bench", version, path)).result(600)
            pool.call(LoadVersionCall(SamplerTarget("m", "bench", version, "t"), path)).result(600)
            shipped.append(time.perf_counter() - t0)
            sizes.append(out.size_bytes)
    finally:
        trainer.stop()
        pool.stop()
    return {
        "colocated": colocated,
        "pool": shipped,
        "bytes": int(np.median(sizes)) if sizes else 0,
    }


ENGINE = dict(threads=1, sampler_slots=16, sampler_max_len=256)


class Trainer:
    """A trainer engine with one model ("bench", LoRA r``rank`` or full) and its seq_ids."""

    def __init__(self, model: Path, rank: int, **settings: object) -> None:
        config = EngineConfig({"m": model}, **{**ENGINE, **settings})  # type: ignore[arg-type]
        self.engine = Engine(config).start()
        self.engine.create_model(ModelSpec("bench", "t", "m", rank, 32.0, 0, "float32")).result(600)
        self.seq = 0
        self.store = _common.scratch("treadle-bench-pool-store-")

    def submit(self, op: object) -> object:
        self.seq += 1
        return self.engine.submit("bench", self.seq, op, f"d{self.seq}").result(600)  # type: ignore[arg-type]

    def ship(self, version: int, pool: list[Engine]) -> None:
        """Write ``version`` once, and have every pool engine serve it."""
        path = str(self.store / f"v{version}-{self.seq}")
        self.engine.call(ShipVersionCall("bench", version, path)).result(600)
        target = SamplerTarget("m", "bench", version, "t")
        for futures in [e.call(LoadVersionCall(target, path)) for e in pool]:
            futures.result(600)

    def stop(self) -> None:
        self.engine.stop()


def _sample(
    engines: list[Engine], version: int, requests: int, group: int, max_tokens: int, seed: int
) -> list[SampleResult]:
    """``requests`` requests of ``group`` samples, all in flight, each to the engine
    with the fewest in flight (ties: the first)."""
    target = SamplerTarget("m", "bench", version, "t")
    cfg = SamplingConfig(max_tokens=max_tokens, temperature=1.0, ignore_eos=True, seed=seed)
    rng = np.random.default_rng(seed)
    futures, placed = [], []
    for _ in range(requests):
        busy = [
            sum(not f.done() for f, e in zip(futures, placed, strict=True) if e is i)
            for i in engines
        ]
        engine = engines[int(np.argmin(busy))]
        prompt = rng.integers(3, 90, size=8).astype(np.int64)
        futures.append(engine.sample(target, SampleOp(prompt, group, cfg)))
        placed.append(engine)
    return [f.result(600) for f in futures]


def _tokens(results: list[SampleResult]) -> int:
    return sum(len(s.tokens) for r in results for s in r.sequences)


def sampled_tokens_per_s(
    model: Path, rank: int, rounds: int, requests: int, group: int, max_tokens: int
) -> dict[str, list[float]]:
    """Tokens/s of the same requests colocated, on 1 pool engine and on 2, rounds
    interleaved so the three see the same noise on a busy host."""
    trainer = Trainer(model, rank)
    pool = [Engine(EngineConfig({"m": model}, **ENGINE)).start() for _ in range(2)]  # type: ignore[arg-type]
    out: dict[str, list[float]] = {"colocated": [], "pool 1": [], "pool 2": []}
    try:
        trainer.submit(SyncWeightsOp())
        trainer.ship(0, pool)
        setups = {"colocated": [trainer.engine], "pool 1": pool[:1], "pool 2": pool}
        for engines in setups.values():  # warm-up, untimed
            _sample(engines, 0, 2, group, 4, seed=0)
        for r in range(rounds):
            for name, engines in setups.items():
                t0 = time.perf_counter()
                results = _sample(engines, 0, requests, group, max_tokens, seed=r + 1)
                out[name].append(_tokens(results) / (time.perf_counter() - t0))
    finally:
        trainer.stop()
        for e in pool:
            e.stop()
    return out


def _datums(results: list[SampleResult]) -> tuple[DatumData, ...]:
    """Each sampled sequence as a next-token datum (its prompt is not kept: the
    sequence's own tokens stand for the rollout)."""
    out = []
    for r in results:
        for s in r.sequences:
            tokens = np.asarray(s.tokens, dtype=np.int64)
            out.append(
                DatumData(
                    tokens[:-1],
                    {
                        "target_tokens": tokens[1:],
                        "weights": np.ones(len(tokens) - 1, np.float32),
                    },
                )
            )
    return tuple(out)


#: where an async RL step samples: colocated on the engine thread between training
#: calls (the default sampler, 1 thread), colocated on a sampler thread of its own
#: (1 + 1 threads, as the pool), or on one pool engine (1 + 1 threads)
RL_SIDES = {
    "colocated": {},
    "colocated, sampler thread": {"sampler": "torch-thread", "sampler_threads": 1},
    "pool": {},
}


class RLSide:
    """One side of the async RL comparison (``RL_SIDES``): a trainer, where it
    samples, and the batch the next step trains on."""

    def __init__(
        self, model: Path, rank: int, side: str, requests: int, group: int, max_tokens: int
    ) -> None:
        self.trainer = Trainer(model, rank, **RL_SIDES[side])
        engine = EngineConfig({"m": model}, **ENGINE)  # type: ignore[arg-type]
        self.pool = [Engine(engine).start()] if side == "pool" else []
        self.sampler = self.pool[0] if self.pool else self.trainer.engine
        self.requests, self.group, self.max_tokens = requests, group, max_tokens
        self.version = self.trainer.submit(SyncWeightsOp()).version  # type: ignore[attr-defined]
        self.trainer.ship(self.version, self.pool)
        self.batch = _sample([self.sampler], self.version, requests, group, max_tokens, seed=0)

    def step(self, seed: int) -> float:
        """One step's seconds: the next batch samples (under the version it starts
        at) while this one trains, syncs and, with a pool, ships."""
        t0 = time.perf_counter()
        cfg = SamplingConfig(max_tokens=self.max_tokens, ignore_eos=True, seed=seed)
        prompts = np.random.default_rng(seed).integers(3, 90, size=(self.requests, 8))
        target = SamplerTarget("m", "bench", self.version, "t")
        nxt = [
            self.sampler.sample(target, SampleOp(p.astype(np.int64), self.group, cfg))
            for p in prompts
        ]
        trainer = self.trainer
        trainer.submit(ForwardBackwardOp(_datums(self.batch), "cross_entropy", {}))
        trainer.submit(OptimStepOp(AdamConfig(learning_rate=1e-4)))
        self.version = trainer.submit(SyncWeightsOp()).version  # type: ignore[attr-defined]
        trainer.ship(self.version, self.pool)
        self.batch = [f.result(600) for f in nxt]
        return time.perf_counter() - t0

    def close(self) -> None:
        self.trainer.stop()
        for e in self.pool:
            e.stop()


def async_rl_steps(
    model: Path, rank: int, steps: int, requests: int, group: int, max_tokens: int
) -> dict[str, list[float]]:
    """Seconds per async RL step on each side, steps interleaved (one of each side
    in turn) so that all sides see the same load on a busy host; the first step of
    each side warms up, untimed."""
    sides = {}
    times: dict[str, list[float]] = {side: [] for side in RL_SIDES}
    try:
        for side in RL_SIDES:
            sides[side] = RLSide(model, rank, side, requests, group, max_tokens)
        for step in range(steps + 1):
            for side, rl in sides.items():
                took = rl.step(seed=step + 1)
                if step:
                    times[side].append(took)
    finally:
        for rl in sides.values():
            rl.close()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--presets", nargs="+", default=["5m"])
    parser.add_argument("--model-dir", default=None, help="reuse a built model (one preset)")
    parser.add_argument("--steps", type=int, default=6, help="timed async RL steps per side")
    parser.add_argument("--requests", type=int, default=8, help="requests per batch")
    parser.add_argument("--group", type=int, default=4, help="samples per request")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens per sample")
    parser.add_argument("--sample-rounds", type=int, default=3, help="rounds of tokens/s")
    parser.add_argument(
        "--only", choices=("sync", "sampling", "rl"), nargs="+", default=["sync", "sampling", "rl"]
    )
    args = parser.parse_args()
    for preset in args.presets:
        model = _common.model_dir(preset, args.model_dir)
        if "sampling" in args.only:
            rows = []
            for name, rank in (("LoRA r16", 16), ("full", 0)):
                tps = sampled_tokens_per_s(
                    model, rank, args.sample_rounds, args.requests, args.group, args.max_tokens
                )
                base = float(np.median(tps["colocated"]))
                rows.append(
                    (
                        preset,
                        name,
                        f"{base:.0f}",
                        *(
                            f"{np.median(tps[k]):.0f} ({np.median(tps[k]) / base:.2f}x)"
                            for k in ("pool 1", "pool 2")
                        ),
                    )
                )
            print(
                f"sampled tokens/s ({args.requests} requests x {args.group} samples x "
                f"{args.max_tokens} tokens, median of {args.sample_rounds}; engines share "
                f"this host's {os.cpu_count()} cores)"
            )
            print(
                _common.table(
                    ("preset", "weights", "colocated", "1 pool worker", "2 pool workers"), rows
                )
            )
        if "rl" in args.only:
            rows = []
            for name, rank in (("LoRA r16", 16), ("full", 0)):
                t = async_rl_steps(
                    model, rank, args.steps, args.requests, args.group, args.max_tokens
                )
                p50 = {side: float(np.median(v)) for side, v in t.items()}
                rows.append(
                    (
                        preset,
                        name,
                        *(
                            f"{p50[side] * 1e3:.0f} / {np.percentile(t[side], 95) * 1e3:.0f}"
                            for side in RL_SIDES
                        ),
                        f"{p50['colocated'] / p50['pool']:.2f}x",
                        f"{p50['colocated, sampler thread'] / p50['pool']:.2f}x",
                    )
                )
            print(
                f"async RL step, ms p50 / p95 ({args.requests} x {args.group} rollouts of "
                f"{args.max_tokens} tokens, {args.steps} steps each, the sides interleaved; "
                "pool speed-up = colocated / pool)"
            )
            print(
                _common.table(
                    (
                        "preset",
                        "weights",
                        "colocated",
                        "colocated, sampler thread",
                        "1 pool worker",
                        "pool speed-up",
                        "vs sampler thread",
                    ),
                    rows,
                )
            )
    if "sync" not in args.only:
        return
    rows = []
    for preset in args.presets:
        model = _common.model_dir(preset, args.model_dir)
        for name, rank in (("LoRA r16", 16), ("full", 0)):
            res = run(model, rank, args.rounds)
            col, pool = np.array(res["colocated"]), np.array(res["pool"])
            rows.append(
                (
                    preset,
                    name,
                    float(np.percentile(col, 50) * 1e3),
                    float(np.percentile(col, 95) * 1e3),
                    float(np.percentile(pool, 50) * 1e3),
                    float(np.percentile(pool, 95) * 1e3),
                    f"{res['bytes'] / 2**20:.2f} MiB",
                )
            )
    print(f"sync_weights to a pool worker serving the version ({args.rounds} rounds)")
    print(
        _common.table(
            (
                "preset",
                "weights",
                "colocated sync p50 ms",
                "p95 ms",
                "sync → pool serves p50 ms",
                "p95 ms",
                "shipped per sync",
            ),
            rows,
        )
    )


if __name__ == "__main__":
    main()
