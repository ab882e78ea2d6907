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

Not measured here: an async RL step colocated vs with a pool worker, and
sampled tokens/s with 1 vs 2 pool workers. On this 2-core host trainer and
pool share the same cores, so a pool cannot speed a step up; it pays where
the pool has devices of its own.

usage: .venv/bin/python benchmarks/disaggregated.py [--rounds 20] [--presets 5m 110m]
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
    SamplerTarget,
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--presets", nargs="+", default=["5m"])
    parser.add_argument("--model-dir", default=None, help="reuse a built model (one preset)")
    args = parser.parse_args()
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
