"""Where an RL step's wall time goes: the demo's GRPO step split by phase.

The demo's task and step (``treadle.server.demo.rl_step``: 64 prompts x 8
samples, the trainer's ``forward_logprobs`` as the ratio's denominator, 4
minibatches of ``forward_backward`` + ``optim_step``, then ``sync_weights``),
from one SFT warm-up, through the SDK against a ``treadle serve`` process
started with its defaults. Each phase is timed on the client from its first
request sent to its last answer:

* sample: the 64 requests (with the rewards scored as their answers arrive);
* forward_logprobs;
* learn: the minibatches' forward_backward and optim_step, sent pipelined as the
  demo sends them (the engine applies them in order; the per-call split is the
  server's: ``--server-split`` reads each call's engine time from the log);
* sync_weights;
* client: the step's own Python between phases (advantages, datums).

"waits" is the step's wall time less the phases: time no phase accounts for.
``--serve-python`` runs the server from another installation (a virtualenv of an
older checkout, say), so a before/after pair is measured in one run; and
``--contended`` runs every row twice, alone and with as many busy processes
beside it as the host has cores (a contended host: tokenizers, reward code,
other workers), and prints the contended/idle ratio of the step time (the
defaults' target: within 1.5x); ``--one-thread`` adds the server pinned to one
thread (``--threads 1``) as a labelled tuned row, the best fixed choice on a
busy host, so the defaults' contended time can be read against it.

    python benchmarks/rl_step_phases.py [--steps 20] [--seeds 0] [--contended]
        [--serve-python OLD/.venv/bin/python]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

import numpy as np
from _procs import busy_processes, cpu_share_slowdown, treadle_serve
from tqdm import tqdm

import treadle
from treadle.rl import Rollout, build_datums, group_advantages, informative_groups
from treadle.server.demo import (
    PPO_CLIP,
    PROBLEMS,
    Plan,
    exact_match,
    prompt_tokens,
    sampling,
)
from treadle.server.demo import warm_up as sft_warm_up

PHASES = ("sample", "forward_logprobs", "learn", "sync_weights", "client")


def rl_step(
    trainer: treadle.TrainingClient,
    sampler: treadle.SamplingClient,
    tok: treadle.Tokenizer,
    plan: Plan,
    rng: random.Random,
    t: dict[str, float],
) -> treadle.SamplingClient:
    """``treadle.server.demo.rl_step``, each phase timed into ``t``."""
    G = plan.group_size
    t0 = time.perf_counter()
    problems = rng.sample(PROBLEMS, plan.prompts_per_step)
    prompts = [prompt_tokens(tok, p) for p in problems]
    futures = [sampler.sample(p, G, sampling(plan, seed=rng.getrandbits(31))) for p in prompts]
    rollouts = [
        Rollout.from_sequence(prompt, seq, reward=exact_match(tok, seq, p))
        for p, prompt, fut in zip(problems, prompts, futures, strict=True)
        for seq in fut.result().sequences
    ]
    t1 = time.perf_counter()
    t["sample"] += t1 - t0
    rewards_B = np.array([r.reward for r in rollouts])
    keep_B = np.repeat(informative_groups(rewards_B, G), G)
    adv_B = group_advantages(rewards_B, G)[keep_B]
    rollouts = [r for r, k in zip(rollouts, keep_B, strict=True) if k]
    if rollouts:
        datums = build_datums(rollouts, adv_B)
        t2 = time.perf_counter()
        recomputed = trainer.forward_logprobs(datums, temperature=plan.temperature).result()
        t3 = time.perf_counter()
        t["forward_logprobs"] += t3 - t2
        rollouts = [
            replace(r, completion_logprobs=out.logprobs[len(r.prompt_tokens) - 1 :])
            for r, out in zip(rollouts, recomputed.loss_fn_outputs, strict=True)
        ]
        order = rng.sample(range(len(rollouts)), len(rollouts))
        minibatches = [
            build_datums([rollouts[i] for i in mb], adv_B[mb])
            for mb in np.array_split(order, min(plan.minibatches, len(order)))
        ]
        t4 = time.perf_counter()
        results, steps = [], []
        for datums in minibatches:
            results.append(
                trainer.forward_backward(datums, "ppo", PPO_CLIP, temperature=plan.temperature)
            )
            steps.append(trainer.optim_step(treadle.AdamParams(learning_rate=plan.rl_lr)))
        for f in results:
            f.result()
        for s in steps:
            s.result()
        t5 = time.perf_counter()
        t["learn"] += t5 - t4
        t["client"] += (t2 - t1) + (t4 - t3)
    else:
        t5 = time.perf_counter()
        t["client"] += t5 - t1
    out = trainer.sync_weights()
    t["sync_weights"] += time.perf_counter() - t5
    return out


def run(
    warm_flags: list[str], work: Path, name: str, args: argparse.Namespace, seed: int
) -> dict[str, float]:
    plan = Plan()
    totals: dict[str, float] = defaultdict(float)
    serve_python = args.serve_python if name == "before" else None
    data = work / f"{name.replace(' ', '').replace(',', '-')}-{seed}"
    with (
        treadle_serve(warm_flags, data, python=serve_python) as (addr, key, _),
        treadle.ServiceClient(addr, api_key=key) as service,
    ):
        tok = service.get_tokenizer("demo")
        trainer = service.create_training_client("demo", seed=seed)
        rng = random.Random(seed)
        sft_warm_up(trainer, tok, plan, rng, tqdm(disable=True))
        sampler = trainer.sync_weights()
        for _ in range(args.warmup_steps):  # not timed: the engine's first calls
            sampler = rl_step(trainer, sampler, tok, plan, rng, defaultdict(float))
        walls = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            sampler = rl_step(trainer, sampler, tok, plan, rng, totals)
            walls.append(time.perf_counter() - t0)
    out = {k: v / args.steps for k, v in totals.items()}
    out["wall"] = statistics.fmean(walls)
    out["median wall"] = statistics.median(walls)
    out["waits"] = out["wall"] - sum(out.get(p, 0.0) for p in PHASES)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup-steps", type=int, default=3)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument(
        "--contended",
        action="store_true",
        help="each row alone and with one busy process per core beside it",
    )
    ap.add_argument(
        "--serve-python",
        default=None,
        help="a python whose treadle serves the 'before' rows (e.g. an older checkout's venv)",
    )
    ap.add_argument("--flags", nargs="*", default=[], help="more `treadle serve` flags")
    ap.add_argument(
        "--one-thread",
        action="store_true",
        help="also a tuned row: the server pinned to one thread (--threads 1), the best "
        "fixed choice on a busy host, beside the defaults",
    )
    args = ap.parse_args()
    from _common import scratch

    from treadle.workers.model.tiny import build_tiny_model

    work = scratch("treadle-phases-")
    names = ["before", "after"] if args.serve_python else ["after"]
    tuned = {"after, --threads 1": ["--threads", "1"]} if args.one_thread else {}
    names += list(tuned)
    loads = [0, os.cpu_count() or 2] if args.contended else [0]
    rows = []
    for seed in args.seeds:
        base = build_tiny_model(work / f"base-{seed}", preset="demo", seed=seed)
        flags = [f"--model=demo={base}", "--sampler-slots", "512", "--sampler-max-len", "32"]
        for name in names:
            for busy in loads:
                with busy_processes(busy):
                    r = run([*flags, *args.flags, *tuned.get(name, [])], work, name, args, seed)
                rows.append((seed, name, busy, r))
                print(f"seed {seed} {name} busy {busy}: {r['wall']:.3f} s/step", file=sys.stderr)
    print(
        f"\nthe demo's GRPO step split by phase, mean seconds over {args.steps} steps; "
        "busy: processes spinning beside the server\n"
    )
    if args.contended:
        bound = cpu_share_slowdown(loads[-1])
        print(
            f"bound: one thread's fixed work ran {bound:.2f}x as long with {loads[-1]} busy "
            "processes beside it as alone (measured in this run); a step that ran on more "
            "than one thread alone has a higher bound: its one-thread idle time times this\n"
        )
    cols = [*PHASES, "waits", "wall", "median wall"]
    print("| seed | server | busy | " + " | ".join(cols) + " | phases / wall | x idle |")
    print("|---" * (len(cols) + 5) + "|")
    idle = {(seed, name): r["wall"] for seed, name, busy, r in rows if busy == 0}
    for seed, name, busy, r in rows:
        phases = sum(r.get(p, 0.0) for p in PHASES)
        print(
            f"| {seed} | {name} | {busy} | "
            + " | ".join(f"{r.get(c, 0.0):.3f}" for c in cols)
            + f" | {phases / r['wall']:.2f} | {r['wall'] / idle[(seed, name)]:.2f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
