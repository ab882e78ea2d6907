"""One researcher's sweep: N LoRA runs of one tenant on one base model, each
doing the GRPO step, all in flight, against the same runs one after another.

The engine in this process (as ``multitenant_batching.py``: no network, so
the numbers are about the engine), the "5m" preset built locally, N = 4 and 8
runs of one tenant with LoRA ranks 8 and 16 alternating and a learning rate
each (the sweep). A run's step: sample G completions for each of P prompts
from its latest weights (seeded), score them (a synthetic reward of the
tokens), ``forward_backward`` (PPO, group-centred advantages, the sampler's
logprobs as the ratio's denominator), ``optim_step``, ``sync_weights``.

Four ways to run the same work, each on a fresh engine:

* **in flight**: every run's requests of a phase sent together (every run's
  samples, then every run's training calls): the sampler decodes all the
  runs' rows in one batch, the scheduler hands one call of each run out in
  one round, and the engine runs them in one pass;
* **one after another**: run 1's steps, then run 2's, ... (the same models);
* **one run alone x N**: a single run (ranks 8 and 16, each on an engine of
  its own), its time times N;
* **bound**: one model does all N runs' work (N x P prompts a step, one
  ``forward_backward`` of all their rows): the same tokens through one
  adapter, which no way of applying N adapters to them can undercut.

Trained tokens/s is the tokens of every ``forward_backward`` over the
training phases' time, sampled tokens/s the generated tokens over the
sampling phases' time; the speedups are of whole steps (both phases). After
the steps, each run's logprobs on a fixed probe must equal those of the same
run trained one after another (<= 1e-5): its calls shared passes, not numbers.

    .venv/bin/python benchmarks/sweep.py                 # ~5 min on 2 busy cores
    .venv/bin/python benchmarks/sweep.py --runs 8 --steps 3   # a quick look

Thread budget: 2 (fixed). Target: in flight >= 1.3x one after another for N = 8.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import _common  # sets the thread budget before torch starts its pools
import numpy as np

from treadle.common.engine.domain import (
    AdamConfig,
    DatumData,
    ForwardBackwardOp,
    ForwardLogprobsOp,
    ModelSpec,
    OptimStepOp,
    SampleOp,
    SampleResult,
    SamplerTarget,
    SamplingConfig,
    SyncWeightsOp,
)
from treadle.workers.engine.loop import Engine, EngineConfig

TENANT = "researcher"
BASE = "m"
LRS = (1e-4, 3e-4, 1e-3, 3e-3)


@dataclass(frozen=True)
class Shape:
    prompts: int = 4  # P prompts a step
    group: int = 4  # G completions each
    prompt_len: int = 8
    max_tokens: int = 8
    vocab: int = 64


@dataclass
class Run:
    """One run's model and its next seq_id; ``share`` > 1: the bound's model
    doing that many runs' work."""

    engine: Engine
    model_id: str
    rank: int
    lr: float
    shape: Shape
    share: int = 1
    seq: int = 1
    sampled: int = 0
    trained: int = 0

    @classmethod
    def create(cls, engine: Engine, i: int, rank: int, shape: Shape, share: int = 1) -> Run:
        run = cls(engine, f"run-{i}", rank, LRS[i % len(LRS)], shape, share)
        spec = ModelSpec(run.model_id, TENANT, BASE, rank, 2.0 * rank, i, "float32")
        engine.create_model(spec).result()
        return run

    def prompts(self, step: int) -> list[np.ndarray]:
        """The same prompts for every run (a sweep compares like with like)."""
        n = self.shape.prompts * self.share
        rng = np.random.default_rng(step)
        return [rng.integers(3, self.shape.vocab, self.shape.prompt_len) for _ in range(n)]

    def sample(self, step: int) -> list[Future[SampleResult]]:
        target = SamplerTarget(BASE, self.model_id, None, TENANT)
        out = []
        for p, prompt in enumerate(self.prompts(step)):
            cfg = SamplingConfig(
                max_tokens=self.shape.max_tokens, seed=1000 * step + p, ignore_eos=True
            )
            out.append(self.engine.sample(target, SampleOp(prompt, self.shape.group, cfg)))
        return out

    def prepare(self, step: int, samples: Sequence[SampleResult]) -> list[DatumData]:
        """The client's work of a step (rewards, advantages, datums), sending nothing."""
        return self._datums(step, samples)

    def train(self, data: Sequence[DatumData]) -> list[Future[Any]]:
        self.trained += sum(len(d.tokens) for d in data)
        ops = [
            ForwardBackwardOp(tuple(data), "ppo", {}),
            OptimStepOp(AdamConfig(learning_rate=self.lr)),
            SyncWeightsOp(),
        ]
        return [self._submit(op) for op in ops]

    def probe(self) -> Future[Any]:
        rng = np.random.default_rng(99)
        ids = [rng.integers(3, self.shape.vocab, 25) for _ in range(4)]
        data = tuple(DatumData(x[:-1], {"target_tokens": x[1:]}) for x in ids)
        return self._submit(ForwardLogprobsOp(data))

    def _submit(self, op: Any) -> Future[Any]:
        fut = self.engine.submit(self.model_id, self.seq, op, f"{self.model_id}-{self.seq}")
        self.seq += 1
        return fut

    def _datums(self, step: int, samples: Sequence[SampleResult]) -> list[DatumData]:
        rollouts = [
            (prompt, seq)
            for prompt, result in zip(self.prompts(step), samples, strict=True)
            for seq in result.sequences
        ]
        reward_B = np.array([float(np.mean(seq.tokens % 3 == 0)) for _, seq in rollouts])
        group_B = reward_B.reshape(-1, self.shape.group)
        adv_B = (group_B - group_B.mean(axis=1, keepdims=True)).reshape(-1)
        n_tokens = sum(len(seq.tokens) for _, seq in rollouts)
        data = []
        for (prompt, seq), adv in zip(rollouts, adv_B, strict=True):
            self.sampled += len(seq.tokens)
            full = np.concatenate([prompt, seq.tokens])
            P, C = len(prompt) - 1, len(seq.tokens)
            data.append(
                DatumData(
                    full[:-1],
                    {
                        "target_tokens": full[1:],
                        "weights": np.r_[np.zeros(P), np.full(C, 1.0 / n_tokens)].astype(
                            np.float32
                        ),
                        "logprobs": np.r_[np.zeros(P), seq.logprobs].astype(np.float32),
                        "advantages": np.full(P + C, adv, dtype=np.float32),
                    },
                )
            )
        return data


@dataclass
class Timing:
    sample_s: float = 0.0
    train_s: float = 0.0
    sampled: int = 0
    trained: int = 0
    probes: dict[str, np.ndarray] = field(default_factory=dict)
    passes: str = ""

    @property
    def wall_s(self) -> float:
        return self.sample_s + self.train_s

    def scaled(self, n: int) -> Timing:
        return Timing(self.sample_s * n, self.train_s * n, self.sampled * n, self.trained * n)


def _engine(path: Path, slots: int, training_threads: str = "measure") -> Engine:
    config = EngineConfig(
        {BASE: str(path)},
        threads=_common.THREADS,
        training_threads=training_threads,
        gap_timeout_s=3600.0,
        sampler_slots=slots,
        sampler_max_len=64,
    )
    return Engine(config).start()


def _phases(groups: Sequence[Sequence[Run]], warmup: int, steps: int, timing: Timing) -> list[Run]:
    """Each group's runs step together (in flight); the groups one after another."""
    for runs in groups:
        for step in range(1, warmup + steps + 1):
            timed = step > warmup
            t0 = time.perf_counter()
            futures = [run.sample(step) for run in runs]
            samples = [[f.result() for f in fs] for fs in futures]
            t1 = time.perf_counter()
            before = [(r.sampled, r.trained) for r in runs]
            # every run's datums first, then every run's calls: they reach the
            # engine together (as rl.sweep_loop sends them)
            data = [run.prepare(step, s) for run, s in zip(runs, samples, strict=True)]
            pending = [f for run, d in zip(runs, data, strict=True) for f in run.train(d)]
            for f in pending:
                f.result()
            t2 = time.perf_counter()
            if timed:
                timing.sample_s += t1 - t0
                timing.train_s += t2 - t1
                timing.sampled += sum(r.sampled - b[0] for r, b in zip(runs, before, strict=True))
                timing.trained += sum(r.trained - b[1] for r, b in zip(runs, before, strict=True))
    return [run for runs in groups for run in runs]


def measure(
    path: Path,
    mode: str,
    n: int,
    shape: Shape,
    warmup: int,
    steps: int,
    ranks: Sequence[int],
    training_threads: str = "measure",
) -> Timing:
    timing = Timing()
    engine = _engine(
        path,
        shape.prompts * shape.group * (n if mode in ("in flight", "bound") else 1),
        training_threads,
    )
    try:
        if mode == "bound":
            runs = [Run.create(engine, 0, max(ranks), shape, share=n)]
        elif mode == "alone":
            runs = [Run.create(engine, 0, ranks[0], shape)]
        else:
            runs = [Run.create(engine, i, ranks[i % len(ranks)], shape) for i in range(n)]
        groups = [runs] if mode != "one after another" else [[r] for r in runs]
        _phases(groups, warmup, steps, timing)
        timing.probes = {r.model_id: r.probe().result().logprobs for r in runs}
        for stats in engine.pass_metrics():
            timing.passes = (
                f"{stats.batched_passes} batched passes of {stats.calls_per_batched_pass:.1f} "
                f"calls, {stats.calls_alone} calls alone"
            )
    finally:
        engine.stop()
    return timing


def _alone(
    path: Path, n: int, shape: Shape, warmup: int, steps: int, ranks: Sequence[int]
) -> Timing:
    """One run alone, for each rank (an engine each), averaged, times N."""
    each = [measure(path, "alone", 1, shape, warmup, steps, [rank]) for rank in ranks]
    mean = Timing(
        float(np.mean([t.sample_s for t in each])),
        float(np.mean([t.train_s for t in each])),
        each[0].sampled,
        each[0].trained,
    )
    return mean.scaled(n)


def max_diff(a: dict[str, Any], b: dict[str, Any]) -> float:
    worst = 0.0
    for k in a:
        for x, y in zip(a[k], b[k], strict=True):
            worst = max(worst, float(np.abs(x - y).max()))
    return worst


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, nargs="+", default=[4, 8], help="sweep sizes N")
    ap.add_argument("--steps", type=int, default=10, help="timed GRPO steps of each run")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first (thread choice)")
    ap.add_argument("--model-dir", default=None)
    args = ap.parse_args()
    path = _common.model_dir("5m", args.model_dir)
    from treadle.workers.model.loading import load_config

    shape, ranks = Shape(vocab=load_config(str(path)).vocab_size), (8, 16)
    rows: list[list[object]] = []
    notes: list[str] = []
    for n in args.runs:
        out: dict[str, Timing] = {}
        for mode in ("in flight", "one after another", "bound"):
            out[mode] = measure(path, mode, n, shape, args.warmup, args.steps, ranks)
            print(f"N={n} {mode}: {out[mode].wall_s:.1f} s", flush=True)
        out["one run alone x N"] = _alone(path, n, shape, args.warmup, args.steps, ranks)
        diff = max_diff(out["in flight"].probes, out["one after another"].probes)
        assert diff <= 1e-5, diff
        notes.append(f"N={n} in flight: {out['in flight'].passes}")
        seq = out["one after another"]
        alone = out["one run alone x N"]
        for mode, t in out.items():
            rows.append(
                [
                    f"N={n}",
                    mode,
                    t.wall_s,
                    t.trained / t.train_s,
                    t.sampled / t.sample_s,
                    seq.wall_s / t.wall_s,
                    alone.wall_s / t.wall_s,
                    f"{diff:.1e}" if mode == "in flight" else "-",
                ]
            )
    print()
    print(
        f"model 5m, float32, one tenant, LoRA ranks {ranks} alternating, lr {LRS} in turn; "
        f"a step: {shape.prompts} prompts x G={shape.group}, {shape.prompt_len} prompt + "
        f"{shape.max_tokens} sampled tokens, PPO forward_backward + optim_step + sync_weights; "
        f"{args.steps} timed steps after {args.warmup}; {_common.THREADS} threads, "
        f"OMP_WAIT_POLICY {_common.OMP_WAIT_POLICY}"
    )
    print()
    print(
        _common.table(
            [
                "runs",
                "how",
                "wall s",
                "trained tok/s",
                "sampled tok/s",
                "x one after another",
                "x one run alone x N",
                "logprobs max |diff| vs one after another",
            ],
            rows,
        )
    )
    print()
    for note in notes:
        print(note)
    print("target: in flight >= 1.3x one after another for N = 8; numerics <= 1e-5")


if __name__ == "__main__":
    main()
