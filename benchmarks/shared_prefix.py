"""GRPO minibatches with each prompt computed once, against the plain padded forward.

A GRPO step trains G completions of each prompt; shuffled into minibatches (as
TRL and ``treadle.rl.grpo_train_step`` split them), each minibatch holds a few
completions of most prompts. The trainer groups a call's rows by their common
prefix and computes it once (``workers/model/shared_prefix.py``); this benchmark
times one ``forward_backward`` (PPO loss, full fine-tune and LoRA rank 16)
through the trainer with that layout and with the plain forward, in the same
process, alternating, on locally built models:

* ``demo`` preset, the demo task's shape: 64 prompts of 5-7 tokens x 8
  completions of 1-3 tokens (plus EOS), a minibatch of a quarter of the step;
* ``5m`` / ``110m`` presets, a reasoning-like shape: 16 prompts of 96-160 tokens
  x 8 completions of 32-128 tokens, a quarter of the step; and the whole step in
  one call (every group whole).

Each row prints the positions each layout computes (padded), the median time of
``--repeat`` calls each way, and plain / shared. Both give the same logprobs and
gradients (tests/unit/model/test_shared_prefix.py and
tests/unit/trainer/test_shared_prefix_training.py check it in float64).

    python benchmarks/shared_prefix.py [--presets demo 5m 110m] [--repeat 7]
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass

import _common
import numpy as np
import torch

from treadle.common.engine.domain import DatumData, ForwardBackwardOp, ModelSpec
from treadle.workers.engine.base_models import BaseModelRegistry
from treadle.workers.model import shared_prefix
from treadle.workers.trainer import trainer
from treadle.workers.trainer.trainer import TrainingModel


@dataclass(frozen=True)
class Shape:
    name: str
    prompts: int
    group: int
    prompt_len: tuple[int, int]
    completion_len: tuple[int, int]
    minibatches: int  # the call is one of this many shuffled minibatches


SHAPES = {
    "demo": [Shape("demo task, 1/4 step", 64, 8, (5, 7), (2, 4), 4)],
    "long": [
        Shape("16 x 8, 96-160 + 32-128, 1/4 step", 16, 8, (96, 160), (32, 128), 4),
        Shape("16 x 8, 96-160 + 32-128, whole step", 16, 8, (96, 160), (32, 128), 1),
    ],
}


def grpo_call(shape: Shape, vocab: int, seed: int) -> ForwardBackwardOp:
    rng = np.random.default_rng(seed)
    data = []
    for _ in range(shape.prompts):
        prompt = rng.integers(3, vocab, size=int(rng.integers(*shape.prompt_len, endpoint=True)))
        for _ in range(shape.group):
            n_out = int(rng.integers(*shape.completion_len, endpoint=True))
            full = np.concatenate((prompt, rng.integers(3, vocab, size=n_out)))
            n = full.size - 1
            weights = (np.arange(n) >= prompt.size - 1).astype(np.float32)
            data.append(
                DatumData(
                    full[:-1],
                    {
                        "target_tokens": full[1:],
                        "weights": weights,
                        "advantages": (rng.standard_normal() * weights).astype(np.float32),
                        "logprobs": (-2 - rng.random(n)).astype(np.float32),
                    },
                )
            )
    order = rng.permutation(len(data))[: len(data) // shape.minibatches]
    return ForwardBackwardOp(tuple(data[i] for i in order), "ppo", {})


def timed(model: TrainingModel, op: ForwardBackwardOp) -> float:
    t0 = time.perf_counter()
    trainer.forward_backward(model, op)
    model.optimizer.zero_grad()
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--presets", nargs="+", default=["demo", "5m", "110m"])
    ap.add_argument("--repeat", type=int, default=7)
    args = ap.parse_args()
    real_plan = shared_prefix.plan
    print(
        f"one forward_backward (PPO), float32, {_common.THREADS} threads; "
        f"median of {args.repeat} calls each way, alternating\n"
    )
    header = (
        "| preset | mode | shape | rows | positions plain / shared "
        "| plain ms | shared ms | plain / shared |"
    )
    print(header)
    print("|---" * (header.count("|") - 1) + "|")
    for preset in args.presets:
        base_dir = _common.model_dir(preset, None)
        base = BaseModelRegistry({preset: base_dir}).get(preset, torch.float32)
        for rank, mode in ((0, "full"), (16, "LoRA r16")):
            model = TrainingModel(ModelSpec("m", "t", preset, rank, 32.0, 0, "float32"), base)
            for shape in SHAPES["demo" if preset == "demo" else "long"]:
                op = grpo_call(shape, base.cfg.vocab_size, seed=0)
                rows = [d.tokens for d in op.data]
                layout = real_plan(rows)
                plain_positions = len(rows) * max(r.size for r in rows)
                shared_positions = layout.positions if layout is not None else plain_positions
                times: dict[str, list[float]] = {"plain": [], "shared": []}
                for i in range(args.repeat + 1):
                    for way in ("plain", "shared"):
                        shared_prefix.plan = real_plan if way == "shared" else _no_plan  # type: ignore[assignment]
                        t = timed(model, op)
                        if i:  # the first of each: warm-up
                            times[way].append(t)
                shared_prefix.plan = real_plan  # type: ignore[assignment]
                plain, shared = (statistics.median(times[w]) * 1e3 for w in ("plain", "shared"))
                print(
                    f"| {preset} | {mode} | {shape.name} | {len(rows)} | "
                    f"{plain_positions:,} / {shared_positions:,} | {plain:.1f} | {shared:.1f} | "
                    f"{plain / shared:.2f}x |",
                    flush=True,
                )
    return 0


def _no_plan(rows: object, pad_id: int = 0) -> None:
    return None


if __name__ == "__main__":
    raise SystemExit(main())
