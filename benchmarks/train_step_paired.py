"""The plain-torch step and the engine's step of ``benchmarks/train_step.py``
alternated in one process: the CPU time of each step (the process's, every
thread), median over ``--pairs`` pairs, and their ratio.

``train_step.py`` runs each row in its own process, one after another, so a
load that changes between rows moves the ratio (on the shared 2-core machine
the same 5m step measured 0.90x in one run and 1.05x in another). Here both
steps see the same load, step for step (their order swapped every pair); the
price is that peak memory cannot be told apart, so ``train_step.py`` stays
the table of record and this the check of a row that looks off::

    PYTHONPATH=<peft> python benchmarks/train_step_paired.py --preset 110m \\
        --model-dir DIR/110m --mode full --shape short --pairs 4
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import _common  # noqa: F401  (sets the thread budget before torch loads)
import torch
import train_step


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--model-dir", default=None, help="the preset's model (built if absent); --preset names it"
    )
    ap.add_argument("--preset", default="5m")
    ap.add_argument("--mode", choices=train_step.MODES, default="full")
    ap.add_argument("--shape", choices=sorted(train_step.SHAPES), default="short")
    ap.add_argument("--pairs", type=int, default=10)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    path = _common.model_dir(args.preset, args.model_dir)
    n, length = train_step.SHAPES[args.shape]
    steps = {
        "torch": train_step.torch_step(Path(path), args.mode, n, length),
        "engine": train_step.engine_step(Path(path), args.mode, n, length),
    }
    for step in steps.values():  # warm-up
        step()
    cpu: dict[str, list[float]] = {name: [] for name in steps}
    order = list(steps)
    for _ in range(args.pairs):
        for name in order:
            t0 = time.process_time()
            steps[name]()
            cpu[name].append(time.process_time() - t0)
        order.reverse()
    ms = {name: statistics.median(v) * 1e3 for name, v in cpu.items()}
    print(
        f"{args.preset} ({path}) {args.mode} {args.shape}, {args.threads} thread(s), "
        f"{args.pairs} pairs: "
        f"cpu ms/step torch {ms['torch']:,.1f}, engine {ms['engine']:,.1f}; "
        f"engine vs torch {ms['torch'] / ms['engine']:.3f}x"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
