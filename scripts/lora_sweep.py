"""Which LoRA settings learn on a random-weight preset: supervised loss after N steps.

Trains in-process (the engine's own ``TrainingModel``, no server) on the demo's
task, single-digit addition ``"7+5="`` -> ``"12</s>"``, cross-entropy on the
answer tokens, token mean per step, AdamW. Prints one markdown row per setting:
targets, rank, learning rate, steps -> mean loss per answer token over the
last 10 steps. The numbers of ``docs/lora.md`` come from this script.

    python scripts/lora_sweep.py --preset demo --steps 100
"""

from __future__ import annotations

import argparse
import itertools
import random
import tempfile
import time

import numpy as np
import torch

from treadle.common.engine.domain import AdamConfig, DatumData, ForwardBackwardOp, ModelSpec
from treadle.workers.engine.base_models import BaseModelRegistry
from treadle.workers.model.tiny import build_char_tokenizer, build_tiny_model
from treadle.workers.trainer.trainer import TrainingModel, forward_backward

TARGET_SETS = {
    "full": (False, False, False),  # a full fine-tune (rank ignored), for comparison
    "attn+mlp": (True, True, False),  # treadle's targets before train_unembed
    "attn+mlp+unembed": (True, True, True),  # the default (tinker's)
    "unembed": (False, False, True),
}


def addition_batch(rng: random.Random, batch: int) -> tuple[DatumData, ...]:
    tok = build_char_tokenizer()
    rows = []
    pairs = [(rng.randrange(10), rng.randrange(10)) for _ in range(batch)]
    n_answer = sum(len(str(a + b)) + 1 for a, b in pairs)
    for a, b in pairs:
        prompt = [1, *tok.encode(f"{a}+{b}=").ids]
        answer = [*tok.encode(str(a + b)).ids, 2]
        full = prompt + answer
        weights = [0.0] * (len(prompt) - 1) + [1.0 / n_answer] * len(answer)
        rows.append(
            DatumData(
                np.array(full[:-1], dtype=np.int64),
                {
                    "target_tokens": np.array(full[1:], dtype=np.int64),
                    "weights": np.array(weights, dtype=np.float32),
                },
            )
        )
    return tuple(rows)


def run(
    base_dir: str, targets: str, rank: int, lr: float, steps: int, batch: int, seed: int
) -> float:
    """Mean loss per answer token over the last 10 steps."""
    attn, mlp, unembed = TARGET_SETS[targets]
    base = BaseModelRegistry({"m": base_dir}).get("m", torch.float32)
    rank = 0 if targets == "full" else rank
    spec = ModelSpec("m", "t", "m", rank, float(rank), seed, "float32", attn, mlp, unembed)
    model = TrainingModel(spec, base)
    rng = random.Random(seed)
    losses = []
    for _ in range(steps):
        op = ForwardBackwardOp(addition_batch(rng, batch), "cross_entropy", {})
        out = forward_backward(model, op)
        losses.append(out.metrics["loss:sum"])
        model.optim_step(AdamConfig(learning_rate=lr))
    return float(np.mean(losses[-10:]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="demo")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--ranks", default="8,32")
    p.add_argument("--lrs", default="1e-4,1e-3,1e-2")
    p.add_argument("--targets", default=",".join(TARGET_SETS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    ranks = [int(r) for r in args.ranks.split(",")]
    lrs = [float(x) for x in args.lrs.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        base_dir = str(build_tiny_model(tmp, preset=args.preset, seed=args.seed))
        print(
            f"preset {args.preset}, {args.steps} steps of {args.batch} problems, seed {args.seed}"
        )
        print("| targets | rank | learning rate | loss/token (last 10 steps) | s |")
        print("|---|---|---|---|---|")
        for targets, rank, lr in itertools.product(args.targets.split(","), ranks, lrs):
            if targets == "full" and rank != ranks[0]:
                continue  # a full fine-tune has no rank
            t0 = time.perf_counter()
            loss = run(base_dir, targets, rank, lr, args.steps, args.batch, args.seed)
            dt = time.perf_counter() - t0
            shown = "-" if targets == "full" else rank
            print(f"| {targets} | {shown} | {lr:g} | {loss:.3f} | {dt:.0f} |", flush=True)


if __name__ == "__main__":
    main()
