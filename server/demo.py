"""``treadle demo``: the whole product in one command, and the worked example of the RL loop.

It starts the embedded server (SQLite, local checkpoints, in-process engine),
builds a small random-weight model, and then, through the SDK only (exactly what
a user's laptop would run), teaches it single-digit addition, ``"7+5="`` -> ``"12"``:

* a supervised warm-up (``cross_entropy`` on the answer tokens) that stops while
  the model is right only some of the time, because GRPO learns only from groups
  whose completions disagree;
* GRPO, each step the five phases of an RL step (docs/concepts.md):
  (1) rollout: G completions per prompt from the latest synced weights;
  (2) reward: exact match, scored here on the client;
  (3) experience prep: the trainer's logprobs (``forward_logprobs``) as the ratio
      denominator, group-relative advantages (``treadle.rl``);
  (4) learn: the clipped surrogate (``ppo``, DAPO's 0.8/1.28 clip) in minibatches,
      ``forward_backward`` + ``optim_step`` each;
  (5) weight sync: ``sync_weights`` returns the sampler of the next step.

The task has 100 problems, so the evaluation set is all of them, sampled at the
training temperature with fixed seeds: it measures the policy (how often it says
the right answer), not generalisation. It is taken before RL and every few
steps; the curve goes to a PNG, the numbers to ``DATA_DIR/demo_summary.json``.

The model is a full fine-tune. LoRA learns on these random weights only with
the output head adapted (``train_unembed``, on by default): a frozen random head
keeps every prediction close to uniform whatever the other adapters do
(docs/lora.md has the measured losses).
"""

from __future__ import annotations

import json
import random
import sys
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

import treadle
from treadle.rl import Rollout, build_datums, group_advantages, informative_groups

if TYPE_CHECKING:
    from tqdm import tqdm

SUMMARY_FILE = "demo_summary.json"
PPO_CLIP = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.28}
#: The engine's torch threads. One: this model's matmuls are too small to gain from
#: a second thread, the SDK and gRPC in this process need a core, and two OpenMP
#: threads on a busy 2-core machine spin-wait for each other (several times slower).
ENGINE_THREADS = 1


@dataclass(frozen=True)
class DemoOptions:
    data_dir: Path
    quick: bool = False
    seed: int = 0
    out: Path | None = None
    sampler: str = "torch"  # the sampler backend (``--sampler``)
    #: the HTTP port of the web console and tinker API (0: any free port; -1: off)
    http_port: int = 0


@dataclass(frozen=True)
class Plan:
    """The knobs, tuned to finish in minutes on 2 CPU cores."""

    sft_max_steps: int = 300
    sft_batch: int = 64
    sft_lr: float = 3e-3
    sft_target: float = 0.35  # stop the warm-up once the sampled accuracy reaches this
    sft_probe_every: int = 10
    rl_steps: int = 80
    prompts_per_step: int = 64
    group_size: int = 8
    minibatches: int = 4  # optimizer steps per batch of rollouts
    rl_lr: float = 3e-4
    temperature: float = 1.0
    max_tokens: int = 4  # two digits + EOS, and one spare
    eval_samples: int = 4  # per problem of the evaluation set
    eval_every: int = 10  # GRPO steps


FULL, QUICK = Plan(), Plan(rl_steps=20, eval_every=5)


# ---- the task: single-digit addition, scored by exact match ----------------------------


@dataclass(frozen=True)
class Problem:
    a: int
    b: int

    @property
    def question(self) -> str:
        return f"{self.a}+{self.b}="

    @property
    def answer(self) -> str:
        return str(self.a + self.b)


PROBLEMS = [Problem(a, b) for a in range(10) for b in range(10)]


def prompt_tokens(tok: treadle.Tokenizer, p: Problem) -> list[int]:
    return [tok.bos_token_id, *tok.encode(p.question)]


def exact_match(tok: treadle.Tokenizer, seq: treadle.SampledSequence, p: Problem) -> float:
    """1 for the answer's tokens followed by EOS, else 0 (compared as token ids, as
    TRL's reward in ``benchmarks/peer_trl.py`` does: decoding would skip special
    tokens, so "1<s>2" would pass for "12")."""
    want = [*tok.encode(p.answer), tok.eos_token_id]
    return float(seq.stop_reason == "stop" and list(seq.tokens) == want)


def sft_datum(tok: treadle.Tokenizer, p: Problem, scale: float) -> treadle.Datum:
    prompt, answer = prompt_tokens(tok, p), [*tok.encode(p.answer), tok.eos_token_id]
    full = prompt + answer
    weights = [0.0] * (len(prompt) - 1) + [scale] * len(answer)  # only the answer is taught
    return treadle.Datum(
        model_input=treadle.ModelInput.from_ints(full[:-1]),
        loss_fn_inputs={"target_tokens": full[1:], "weights": weights},
    )


def sampling(plan: Plan, seed: int) -> treadle.SamplingParams:
    return treadle.SamplingParams(
        max_tokens=plan.max_tokens, temperature=plan.temperature, seed=seed
    )


def evaluate(sampler: treadle.SamplingClient, tok: treadle.Tokenizer, plan: Plan) -> float:
    """Mean exact match over every problem, ``eval_samples`` samples each.

    The same seeds every time, so "before" and "after" share their sampling noise
    and their difference measures the policy, not the dice.
    """
    futures = [
        sampler.sample(prompt_tokens(tok, p), plan.eval_samples, sampling(plan, seed=i))
        for i, p in enumerate(PROBLEMS)
    ]
    scores = [
        exact_match(tok, seq, p)
        for p, fut in zip(PROBLEMS, futures, strict=True)
        for seq in fut.result().sequences
    ]
    return float(np.mean(scores))


# ---- phase 0: supervised warm-up ----------------------------------------------------------


def warm_up(
    trainer: treadle.TrainingClient,
    tok: treadle.Tokenizer,
    plan: Plan,
    rng: random.Random,
    bar: tqdm,
) -> tuple[int, float]:
    """Cross-entropy steps until the sampled accuracy reaches ``sft_target``.

    Each step's loss is the token mean over the batch: the mean is folded into
    the weights (the server only sums). Calls are pipelined: the SDK returns
    futures at once and the engine applies the calls in order; the futures are
    checked at each probe.
    """
    accuracy = 0.0
    pending: list[treadle.APIFuture] = []
    for step in range(1, plan.sft_max_steps + 1):
        batch = [rng.choice(PROBLEMS) for _ in range(plan.sft_batch)]
        n_tokens = sum(len(p.answer) + 1 for p in batch)
        pending.append(trainer.forward_backward([sft_datum(tok, p, 1 / n_tokens) for p in batch]))
        pending.append(trainer.optim_step(treadle.AdamParams(learning_rate=plan.sft_lr)))
        bar.update(1)
        if step % plan.sft_probe_every == 0:
            for fut in pending:
                fut.result()  # raises the first failure, if any
            pending.clear()
            accuracy = evaluate(trainer.sync_weights(), tok, replace(plan, eval_samples=1))
            bar.set_postfix(accuracy=f"{accuracy:.2f}")
            if accuracy >= plan.sft_target:
                return step, accuracy
    return plan.sft_max_steps, accuracy


# ---- one GRPO step: the five phases ---------------------------------------------------------


def rl_step(
    trainer: treadle.TrainingClient,
    sampler: treadle.SamplingClient,
    tok: treadle.Tokenizer,
    plan: Plan,
    rng: random.Random,
) -> tuple[treadle.SamplingClient, dict[str, float]]:
    G = plan.group_size

    # (1) rollout: every prompt's G completions, sampled concurrently by the server
    problems = rng.sample(PROBLEMS, plan.prompts_per_step)
    prompts = [prompt_tokens(tok, p) for p in problems]
    futures = [sampler.sample(p, G, sampling(plan, seed=rng.getrandbits(31))) for p in prompts]

    # (2) reward, on the client
    rollouts = [
        Rollout.from_sequence(prompt, seq, reward=exact_match(tok, seq, p))
        for p, prompt, fut in zip(problems, prompts, futures, strict=True)
        for seq in fut.result().sequences
    ]
    rewards_B = np.array([r.reward for r in rollouts])
    n_tokens = sum(len(r.completion_tokens) for r in rollouts)
    metrics = {"reward": float(rewards_B.mean()), "tokens": float(n_tokens)}

    # (3) experience prep: keep groups that disagree (the others have zero advantage),
    # recompute the behaviour logprobs on the trainer, centre rewards per group.
    keep_B = np.repeat(informative_groups(rewards_B, G), G)
    adv_B = group_advantages(rewards_B, G)[keep_B]
    rollouts = [r for r, k in zip(rollouts, keep_B, strict=True) if k]
    metrics.update(loss=0.0, clip_frac=0.0, logprob_diff=0.0, groups=float(keep_B.sum() // G))
    if rollouts:
        datums = build_datums(rollouts, adv_B)
        recomputed = trainer.forward_logprobs(datums, temperature=plan.temperature).result()
        trainer_lp = [
            out.logprobs[len(r.prompt_tokens) - 1 :]
            for r, out in zip(rollouts, recomputed.loss_fn_outputs, strict=True)
        ]
        metrics["logprob_diff"] = max(
            float(np.abs(lp - r.completion_logprobs).max())
            for r, lp in zip(rollouts, trainer_lp, strict=True)
        )
        rollouts = [
            replace(r, completion_logprobs=lp) for r, lp in zip(rollouts, trainer_lp, strict=True)
        ]

        # (4) learn: shuffled minibatches, one optimizer step each; later minibatches
        # are off-policy by the steps before them, which the clip bounds.
        order = rng.sample(range(len(rollouts)), len(rollouts))
        results, steps = [], []
        for mb in np.array_split(order, min(plan.minibatches, len(order))):
            datums = build_datums([rollouts[i] for i in mb], adv_B[mb])  # token mean per step
            results.append(
                trainer.forward_backward(datums, "ppo", PPO_CLIP, temperature=plan.temperature)
            )
            steps.append(trainer.optim_step(treadle.AdamParams(learning_rate=plan.rl_lr)))
        fb = [f.result().metrics for f in results]
        for s in steps:
            s.result()
        metrics["loss"] = sum(m["loss:sum"] for m in fb)
        metrics["clip_frac"] = float(np.mean([m.get("clip_frac:mean", 0.0) for m in fb]))

    # (5) weight sync: the next step samples from the weights just trained
    return trainer.sync_weights(), metrics


# ---- the command --------------------------------------------------------------------------


#: What each column of the GRPO table means, printed above it (docs/rl_loop.md).
TABLE_LEGEND = (
    "reward: share of this step's {n} prompts x {G} samples answered exactly right; "
    "loss: the step's loss:sum; clip: clip_frac:mean;\n"
    "groups: prompts whose {G} answers disagree (the only ones with a gradient); "
    "tokens: completion tokens sampled; s: seconds; "
    "eval: exact match on all 100 problems (fixed seeds)"
)


def progress_bar(iterable: Iterable[int] | None = None, **kwargs: Any) -> tqdm:
    """A tqdm bar on stderr, drawn only when stderr is a terminal: in a log file or
    a pipe its redraws would mix into the table printed on stdout."""
    from tqdm import tqdm

    return tqdm(iterable, file=sys.stderr, disable=not sys.stderr.isatty(), **kwargs)


def run_demo(opts: DemoOptions) -> int:
    from tqdm import tqdm

    from treadle.server.config import ServerConfig
    from treadle.server.embedded import EmbeddedServer

    plan = QUICK if opts.quick else FULL
    data_dir = Path(opts.data_dir)
    config = ServerConfig(
        data_dir=data_dir,
        models={"demo": _model_dir(data_dir, opts.seed)},
        port=0,
        threads=ENGINE_THREADS,
        sampler_slots=plan.prompts_per_step * plan.group_size,  # a whole step's rollouts at once
        sampler_max_len=32,
        sampler=opts.sampler,
        http_port=None if opts.http_port < 0 else opts.http_port,
    )
    rng = random.Random(opts.seed)
    t_start = time.perf_counter()
    mode = "quick" if opts.quick else "full"
    print(f"treadle demo ({mode}, seed {opts.seed}): single-digit addition, SFT warm-up then GRPO")
    with (
        EmbeddedServer(config) as server,
        treadle.ServiceClient(server.address, api_key=server.api_key) as service,
    ):
        tok = service.get_tokenizer("demo")
        trainer = service.create_training_client("demo", seed=opts.seed)  # full fine-tune
        if server.http_url is not None:
            print(
                f"console: {server.http_url}/console/runs/{trainer.model_id} while the demo "
                f"runs (sign in with the key in {(data_dir / 'api_key').resolve()})",
                flush=True,
            )

        with progress_bar(total=plan.sft_max_steps, desc="warm-up") as bar:
            sft_steps, _ = warm_up(trainer, tok, plan, rng, bar)
        sampler = trainer.sync_weights()
        evals = {0: evaluate(sampler, tok, plan)}
        print(f"warm-up: {sft_steps} supervised steps; exact match {evals[0]:.3f}")

        print(TABLE_LEGEND.format(n=plan.prompts_per_step, G=plan.group_size))
        print(" step  reward      loss    clip  groups  tokens      s    eval")
        history: list[dict[str, float]] = []
        for step in progress_bar(range(1, plan.rl_steps + 1), desc="GRPO"):
            t0 = time.perf_counter()
            sampler, m = rl_step(trainer, sampler, tok, plan, rng)
            m["seconds"] = time.perf_counter() - t0
            history.append(m)
            if step % plan.eval_every == 0 or step == plan.rl_steps:
                evals[step] = evaluate(sampler, tok, plan)
            # the reward curve in the console (x: the GRPO step)
            logged = {"reward": m["reward"], "clip_frac": m["clip_frac"]}
            if step in evals:
                logged["eval"] = evals[step]
            trainer.log_metrics(step, logged)
            tqdm.write(
                f"{step:>5} {m['reward']:>7.3f} {m['loss']:>9.4f} {m['clip_frac']:>7.3f} "
                f"{m['groups']:>7.0f} {m['tokens']:>7.0f} {m['seconds']:>6.2f}"
                + (f" {evals[step]:>7.3f}" if step in evals else ""),
                file=sys.stdout,
            )

    rewards = [m["reward"] for m in history]
    before, after = evals[0], evals[plan.rl_steps]
    png = opts.out or data_dir / "reward_curve.png"
    _plot(rewards, evals, png)
    summary = {
        "seed": opts.seed,
        "quick": opts.quick,
        "plan": asdict(plan),
        "sft_steps": sft_steps,
        "eval_before": before,
        "eval_after": after,
        "eval_curve": evals,
        "rollout_reward": rewards,
        "max_logprob_diff": max(m["logprob_diff"] for m in history),
        "wall_s": time.perf_counter() - t_start,
        "png": str(png),
    }
    (data_dir / SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n")
    k = max(1, len(rewards) // 4)
    print(
        f"exact match on the evaluation set ({len(PROBLEMS)} problems x {plan.eval_samples} "
        f"samples, temperature {plan.temperature}): {before:.3f} before RL -> {after:.3f} after "
        f"{plan.rl_steps} GRPO steps\n"
        f"rollout reward {np.mean(rewards[:k]):.3f} in the first {k} steps -> "
        f"{np.mean(rewards[-k:]):.3f} in the last {k}; sampler vs trainer logprobs differ by "
        f"at most {summary['max_logprob_diff']:.1e}\n"
        f"{summary['wall_s']:.0f} s; reward curve: {png}; numbers: {data_dir / SUMMARY_FILE}"
    )
    return 0


def _model_dir(data_dir: Path, seed: int) -> Path:
    """The random-weight "demo" model (~0.8M parameters), built on the first run."""
    from treadle.workers.model.tiny import build_tiny_model

    path = data_dir / "models" / f"demo-seed{seed}"
    if not (path / "config.json").exists():
        build_tiny_model(path, preset="demo", seed=seed)
    return path


def _plot(rewards: list[float], evals: dict[int, float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = np.arange(1, len(rewards) + 1)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(steps, rewards, marker=".", label="rollout reward (exact match)")
    ax.plot(list(evals), list(evals.values()), "s--", label="evaluation set (fixed seeds)")
    ax.set(xlabel="GRPO step", ylabel="exact match", ylim=(0, 1), title="treadle demo")
    ax.legend(loc="lower right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
