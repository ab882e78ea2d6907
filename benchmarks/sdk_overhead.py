"""What the service costs a training step: SDK -> gRPC -> engine against the engine's
own trainer objects called in-process, in one run.

Both paths run the same step on the same model: ``forward_backward``
(cross-entropy on a fixed batch of 8 datums x 64 tokens) then ``optim_step``,
on the "5m" preset (~4.6M parameters, a random-weight Llama built on the spot)
with a LoRA adapter of rank 16 (``--full`` for a full fine-tune).

* sdk: an embedded server (SQLite, local checkpoints, in-process engine on its
  own thread, ``threads=N``) driven through ``treadle.ServiceClient``; a step
  submits both calls and waits for the optimizer step's result, as a user's loop
  does. The cost over direct is request encoding, gRPC on loopback, auth,
  the database's op log, the scheduler and the result's way back.
* direct: ``treadle.workers.trainer.trainer.forward_backward`` and
  ``TrainingModel.optim_step`` on the caller's thread (``torch.set_num_threads(N)``),
  the code the engine runs for those calls.

Noise control: one warm-up round each way, then rounds that alternate the two
paths (a block of steps each, the order flipping every round), so a slow spell
of a shared machine hits both; medians of per-step times. Target: median sdk /
median direct <= 1.10.

    python benchmarks/sdk_overhead.py              # ~1 min on 2 CPU cores
    python benchmarks/sdk_overhead.py --full --rounds 12 --json out.json

Exit status 0 when the target is met.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

THREADS = 2
os.environ.setdefault("OMP_NUM_THREADS", str(THREADS))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import treadle  # noqa: E402
from treadle.common.engine.domain import AdamConfig, DatumData, ForwardBackwardOp, ModelSpec  # noqa: E402
from treadle.server.config import ServerConfig  # noqa: E402
from treadle.server.embedded import EmbeddedServer  # noqa: E402
from treadle.workers.engine.base_models import BaseModelRegistry  # noqa: E402
from treadle.workers.model.tiny import build_tiny_model  # noqa: E402
from treadle.workers.trainer.trainer import TrainingModel, forward_backward  # noqa: E402

TARGET = 1.10
LR = 1e-4


def make_batch(n: int, length: int, vocab: int, seed: int = 0) -> list[treadle.Datum]:
    """``n`` datums of ``length`` tokens; weights 1/(n*length): the token mean."""
    rng = np.random.default_rng(seed)
    batch = []
    for _ in range(n):
        tokens = rng.integers(3, vocab, size=length + 1)
        batch.append(
            treadle.Datum(
                model_input=treadle.ModelInput.from_ints(tokens[:-1]),
                loss_fn_inputs={
                    "target_tokens": tokens[1:],
                    "weights": np.full(length, 1.0 / (n * length), dtype=np.float32),
                },
            )
        )
    return batch


def sdk_stepper(trainer: treadle.TrainingClient, batch: list[treadle.Datum]) -> Callable[[], None]:
    adam = treadle.AdamParams(learning_rate=LR)

    def step() -> None:
        fb = trainer.forward_backward(batch, "cross_entropy")
        trainer.optim_step(adam).result()
        fb.result()

    return step


def direct_stepper(
    model_dir: Path, batch: list[treadle.Datum], lora_rank: int
) -> Callable[[], None]:
    base = BaseModelRegistry({"bench": model_dir}).get("bench", torch.float32)
    spec = ModelSpec("direct", "bench", "bench", lora_rank, float(lora_rank), 0, "float32")
    model = TrainingModel(spec, base)
    op = ForwardBackwardOp(
        data=tuple(
            DatumData(np.asarray(d.model_input.tokens, dtype=np.int64), dict(d.loss_fn_inputs))
            for d in batch
        ),
        loss_fn="cross_entropy",
        loss_config={},
    )
    adam = AdamConfig(learning_rate=LR)

    def step() -> None:
        forward_backward(model, op)
        model.optim_step(adam)

    return step


def timed(step: Callable[[], None], n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        step()
        out.append(time.perf_counter() - t0)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="5m")
    ap.add_argument("--full", action="store_true", help="full fine-tune instead of LoRA")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--steps-per-round", type=int, default=5)
    ap.add_argument("--threads", type=int, default=THREADS)
    ap.add_argument("--model-dir", default=None, help="reuse a built model directory")
    ap.add_argument("--json", default=None, help="also write the numbers here")
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    tmp = Path(tempfile.mkdtemp(prefix="treadle-sdk-overhead-"))
    atexit.register(shutil.rmtree, tmp, ignore_errors=True)
    model_dir = Path(args.model_dir) if args.model_dir else tmp / args.preset
    if not (model_dir / "config.json").exists():
        build_tiny_model(model_dir, preset=args.preset, seed=0)
    rank = 0 if args.full else args.rank
    config = ServerConfig(
        data_dir=tmp / "data", models={"bench": model_dir}, port=0, threads=args.threads
    )
    with (
        EmbeddedServer(config) as server,
        treadle.ServiceClient(server.address, api_key=server.api_key) as service,
    ):
        vocab = service.get_server_info().base_models[0].vocab_size
        batch = make_batch(args.batch, args.tokens, vocab)
        trainer = (
            service.create_training_client("bench")
            if args.full
            else service.create_lora_training_client("bench", rank=rank)
        )
        paths = {
            "sdk": sdk_stepper(trainer, batch),
            "direct": direct_stepper(model_dir, batch, rank),
        }
        times: dict[str, list[float]] = {name: [] for name in paths}
        for step in paths.values():  # warm-up: allocator, first-call paths, caches
            timed(step, 3)
        t_start = time.perf_counter()
        for r in range(args.rounds):
            order = list(paths) if r % 2 == 0 else list(reversed(paths))
            for name in order:
                times[name] += timed(paths[name], args.steps_per_round)
        wall = time.perf_counter() - t_start

    med = {name: statistics.median(ts) * 1e3 for name, ts in times.items()}
    ratio = med["sdk"] / med["direct"]
    what = "full fine-tune" if args.full else f"LoRA rank {rank}"
    print(
        f"sdk overhead: {args.preset} preset, {what}, {args.batch} datums x {args.tokens} tokens, "
        f"forward_backward + optim_step, {args.threads} torch threads, "
        f"{args.rounds} interleaved rounds of {args.steps_per_round} steps ({wall:.0f} s)\n"
    )
    print("| path   | steps | median ms/step | p10 ms | p90 ms |")
    print("|--------|------:|---------------:|-------:|-------:|")
    for name, ts in times.items():
        p10, p90 = np.percentile(np.array(ts) * 1e3, [10, 90])
        print(f"| {name:<6} | {len(ts):>5} | {med[name]:>14.1f} | {p10:>6.1f} | {p90:>6.1f} |")
    verdict = "met" if ratio <= TARGET else "NOT met"
    print(
        f"\nratio sdk / direct (medians): {ratio:.3f} (+{med['sdk'] - med['direct']:.1f} ms per "
        f"step); target <= {TARGET:.2f}: {verdict}"
    )
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {"median_ms": med, "ratio": ratio, "target": TARGET, "args": vars(args)}, indent=2
            )
            + "\n"
        )
    return 0 if ratio <= TARGET else 1


if __name__ == "__main__":
    sys.exit(main())
