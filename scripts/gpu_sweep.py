"""The GPU check's sweep: N LoRA runs of one tenant, each doing GRPO steps, all in
flight vs one after another, on the device under test.

The runs, their steps and their timing are ``benchmarks/sweep.py``'s (imported
from the checkout); only the engine differs: on ``device`` in ``dtype``, with
the models in the same dtype. Each way runs on a fresh engine; the runs'
logprobs on a fixed probe are compared afterwards (their calls shared passes,
not numbers).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
_threads = torch.get_num_threads()
sys.path.insert(0, str(ROOT / "benchmarks"))
import sweep as bench  # noqa: E402  (its _common pins 2 torch threads: undone below)

torch.set_num_threads(_threads)

from treadle.common.engine.domain import ModelSpec  # noqa: E402
from treadle.workers.engine.loop import Engine, EngineConfig  # noqa: E402
from treadle.workers.model.loading import load_config  # noqa: E402

RANKS = (8, 16)


class _Run(bench.Run):
    @classmethod
    def create(cls, engine: Engine, i: int, rank: int, shape: bench.Shape, share: int = 1) -> _Run:
        run = cls(engine, f"run-{i}", rank, bench.LRS[i % len(bench.LRS)], shape, share)
        dtype = engine.config.default_dtype
        spec = ModelSpec(run.model_id, bench.TENANT, bench.BASE, rank, 2.0 * rank, i, dtype)
        engine.create_model(spec).result()
        return run


@dataclass
class SweepResult:
    timings: dict[str, bench.Timing] = field(default_factory=dict)
    diff: float = 0.0  # logprobs max |diff|, in flight vs one after another
    peaks: list[str] = field(default_factory=list)  # in flight, one after another

    def __getitem__(self, how: str) -> bench.Timing:
        return self.timings[how]


def sweep(
    path: Path,
    device: str,
    dtype: str,
    *,
    runs: int,
    steps: int,
    reset_peak: Callable[[], None],
    peak: Callable[[], str],
    warmup: int = 1,
) -> SweepResult:
    shape = bench.Shape(vocab=load_config(str(path)).vocab_size)
    out = SweepResult()
    for how in ("in flight", "one after another"):
        config = EngineConfig(
            {bench.BASE: str(path)},
            device=device,
            default_dtype=dtype,
            gap_timeout_s=3600.0,
            sampler_slots=shape.prompts * shape.group * (runs if how == "in flight" else 1),
            sampler_max_len=64,
        )
        engine = Engine(config).start()
        reset_peak()
        try:
            models = [_Run.create(engine, i, RANKS[i % len(RANKS)], shape) for i in range(runs)]
            groups = [models] if how == "in flight" else [[r] for r in models]
            timing = bench.Timing()
            bench._phases(groups, warmup, steps, timing)
            timing.probes = {r.model_id: r.probe().result().logprobs for r in models}
            for stats in engine.pass_metrics():
                timing.passes = (
                    f"{stats.batched_passes} batched passes of "
                    f"{stats.calls_per_batched_pass:.1f} calls, {stats.calls_alone} alone"
                )
            out.timings[how] = timing
            out.peaks.append(peak())
        finally:
            engine.stop()
    out.diff = bench.max_diff(out["in flight"].probes, out["one after another"].probes)
    return out
