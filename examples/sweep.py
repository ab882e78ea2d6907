"""A learning-rate sweep: N LoRA runs of GRPO on the demo task, all in flight.

One researcher, one base model, one run per learning rate, each its own LoRA
model. ``treadle.rl.sweep_loop`` steps them together from this one thread
(every SDK call returns a future, so no thread per run): every run's sample
requests go out together and decode in one batch on the server, then every
run's ``forward_backward`` + ``optim_step``, which the engine runs in shared
passes (a tenant's ready models share a scheduling round), then every sync.
It prints each run's reward, step by step, the server's count of batched
passes, and saves one plot of all the curves.

    python examples/sweep.py                      # embedded server, demo model
    TREADLE_ADDRESS=host:50051 TREADLE_API_KEY=... TREADLE_BASE_MODEL=... \\
        python examples/sweep.py                  # a running server (no warm-up)

The task is ``treadle demo``'s (``treadle.server.demo``): single-digit
addition, ``"7+5="`` -> ``"12"``, exact match. Embedded, the random-weight
demo model is first warmed up by supervised steps (a full fine-tune, as the
demo does) and exported, and that warm model is the sweep's base: on random
weights a LoRA adapter cannot move the frozen output head enough to learn.
"""

from __future__ import annotations

import contextlib
import os
import random
import tempfile
from pathlib import Path

import numpy as np

import treadle
from treadle import rl

LRS = (1e-3, 3e-3, 1e-2, 3e-2)  # one run each (LoRA wants ~10x a full fine-tune's)
RANK = 16
STEPS = 20  # GRPO steps of every run
GROUPS_PER_STEP = 16  # prompts per step (the same for every run)
GROUP_SIZE = 8  # completions per prompt (GRPO's G)
MINIBATCHES = 4  # optimizer steps per batch of rollouts (as the demo)
WARMUP_MAX_STEPS = 300  # supervised steps at most (embedded only)
OUT = Path("sweep_rewards.png")


# ---- 1. a server: a running one, or an embedded one on a warmed-up demo model ----------


@contextlib.contextmanager
def connect():
    address = os.environ.get("TREADLE_ADDRESS")
    if address:
        with treadle.ServiceClient(address) as service:
            yield service, os.environ.get("TREADLE_BASE_MODEL", "demo")
        return
    data = Path(tempfile.mkdtemp(prefix="treadle-sweep-"))
    warm = warm_base(data)
    slots = len(LRS) * GROUPS_PER_STEP * GROUP_SIZE  # every run's rows decode together
    with serve(data / "sweep", {"demo-warm": warm}, sampler_slots=slots) as service:
        yield service, "demo-warm"


@contextlib.contextmanager
def serve(data: Path, models: dict[str, Path], **config):
    from treadle.server.config import ServerConfig
    from treadle.server.embedded import EmbeddedServer

    cfg = ServerConfig(
        data_dir=data, models=models, port=0, threads=1, sampler_max_len=32, **config
    )
    with (
        EmbeddedServer(cfg) as server,
        treadle.ServiceClient(server.address, api_key=server.api_key) as service,
    ):
        yield service


def warm_base(data: Path) -> Path:
    """The demo's supervised warm-up on a full fine-tune, exported as a new base."""
    from tqdm import tqdm

    from treadle.server import demo
    from treadle.workers.model.tiny import build_tiny_model

    model = build_tiny_model(data / "demo", preset="demo", seed=0)
    plan = demo.Plan(sft_max_steps=WARMUP_MAX_STEPS)
    with serve(data / "warm-up", {"demo": model}) as service:
        trainer = service.create_training_client("demo", seed=0)
        tok = trainer.get_tokenizer()
        with tqdm(total=plan.sft_max_steps, desc="warm-up", disable=True) as bar:
            steps, accuracy = demo.warm_up(trainer, tok, plan, random.Random(0), bar)
        print(f"warm-up: {steps} supervised steps, exact match {accuracy:.2f}")
        return trainer.export_weights(data / "demo-warm", merged=True)


# ---- 2. the hooks: prompts and reward (the demo's task) -----------------------------------


def prompt_source(tok: treadle.Tokenizer):
    from treadle.server import demo

    rng = random.Random(0)
    params = treadle.SamplingParams(max_tokens=4, temperature=1.0)
    while True:
        p = rng.choice(demo.PROBLEMS)
        yield rl.Prompt(demo.prompt_tokens(tok, p), p, params)


def make_reward(tok: treadle.Tokenizer):
    from treadle.server import demo

    return lambda problem, seq: demo.exact_match(tok, seq, problem)


# ---- 3. the sweep ------------------------------------------------------------------------


def main() -> None:
    with connect() as (service, base_model):
        tok = service.get_tokenizer(base_model)
        # one LoRA model per learning rate (all or none: a quota refusal keeps nothing)
        runs = rl.create_runs(service, base_model, [rl.RunSpec(rank=RANK) for _ in LRS])
        steps = [
            rl.grpo_train_step(adam=treadle.AdamParams(learning_rate=lr), minibatches=MINIBATCHES)
            for lr in LRS
        ]
        print("step " + " ".join(f"lr={lr:<8g}" for lr in LRS))
        curves: list[list[float]] = [[] for _ in LRS]
        for stats in rl.sweep_loop(
            runs,
            prompt_source(tok),
            make_reward(tok),
            steps=STEPS,
            groups_per_step=GROUPS_PER_STEP,
            group_size=GROUP_SIZE,
            train_steps=steps,
        ):
            for curve, s in zip(curves, stats, strict=True):
                curve.append(s.reward)
            print(f"{stats[0].step:>4} " + " ".join(f"{s.reward:<11.3f}" for s in stats))

        k = max(1, STEPS // 4)
        for lr, curve in zip(LRS, curves, strict=True):
            print(
                f"lr={lr:g}: reward {np.mean(curve[:k]):.3f} in the first {k} steps -> "
                f"{np.mean(curve[-k:]):.3f} in the last {k}; curve "
                + " ".join(f"{r:.2f}" for r in curve)
            )
        passes = service.get_server_info().training_pass_metrics  # did the runs share passes?
        for m in [m for m in passes if m.base_model == base_model] or [None]:
            print(
                f"training passes on {base_model}: "
                + (
                    "none (no group had rewards that differ)"
                    if m is None
                    else f"{m.batched_passes} batched ({m.calls_per_batched_pass:.1f} calls "
                    f"each, {m.tokens_batched} tokens), {m.calls_alone} calls alone "
                    f"({m.tokens_alone} tokens)"
                )
            )
        plot(curves, OUT)
        print(f"reward curves: {OUT}")
        for run in runs:
            service.delete_model(run.model_id)


def plot(curves: list[list[float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for lr, curve in zip(LRS, curves, strict=True):
        ax.plot(np.arange(1, len(curve) + 1), curve, marker=".", label=f"lr {lr:g}")
    ax.set(xlabel="GRPO step", ylabel="rollout reward (exact match)", ylim=(0, 1))
    ax.set_title(f"learning-rate sweep: {len(curves)} LoRA runs (rank {RANK}), one base")
    ax.legend(loc="best")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main()
