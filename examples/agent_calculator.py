"""An agent that learns because of its tool: three-digit addition with a calculator.

The model sees ``"347+589="``. It may answer at once (digits, then EOS), which
the small ``demo`` model cannot do reliably, or call the calculator by writing
the call in a fixed format, ``[347+589]`` then EOS. The environment runs the
tool and answers with its output, ``"936\\n"``, as the next observation; the
model's next turn is its answer. Reward: 1 for the right answer, else 0.

    python examples/agent_calculator.py                  # embedded server, the demo model
    TREADLE_ADDRESS=host:50051 TREADLE_API_KEY=... TREADLE_BASE_MODEL=... \\
        python examples/agent_calculator.py              # a running server

1. A short supervised warm-up on demonstrations: half of them call the tool,
   half answer directly; the model learns the call format (copying the
   operands) but not when a call pays.
2. GRPO over episodes (``treadle.rl.sync_episode_loop``): each group is 8
   episodes of one problem; only the model's tokens are trained on (the
   prompt and the tool's output have weight 0). Episodes that call the tool
   correctly are right far more often, so the share of correct tool calls and
   the success rate rise together.

Before and after RL it evaluates the same problems with the same seeds, so the
difference measures the policy, not the dice. docs/agents.md explains the pieces.
"""

from __future__ import annotations

import contextlib
import os
import random
import tempfile
import threading
from pathlib import Path

import treadle
from treadle import rl

STEPS = 20  # GRPO steps
GROUPS_PER_STEP = 16  # problems per step
GROUP_SIZE = 8  # episodes per problem (GRPO's G)
SFT_STEPS = 240  # warm-up steps (64 demonstrations each)
SFT_LR = 3e-3
RL_LR = 5e-4
EVAL_PROBLEMS = 128
TURN_TOKENS = 8  # a call: "[calc]" + EOS; an answer: 3 digits + EOS
CALL = "[calc]"  # the tool call's fixed format (then EOS): the calculator reads the problem


# ---- 1. a server: a running one, or an embedded one with the `demo` model ---------------


@contextlib.contextmanager
def connect():
    address = os.environ.get("TREADLE_ADDRESS")
    if address:
        with treadle.ServiceClient(address) as service:
            yield service, os.environ.get("TREADLE_BASE_MODEL", "demo")
        return
    from treadle.server.config import ServerConfig
    from treadle.server.embedded import EmbeddedServer
    from treadle.workers.model.tiny import build_tiny_model

    data = Path(tempfile.mkdtemp(prefix="treadle-agent-"))
    model = build_tiny_model(data / "model", preset="demo", seed=0)
    config = ServerConfig(data_dir=data, models={"demo": model}, port=0, threads=1)
    with (
        EmbeddedServer(config) as server,
        treadle.ServiceClient(server.address, api_key=server.api_key) as service,
    ):
        yield service, "demo"


# ---- 2. the environment: a problem, and a calculator the model may call -------------------


class Tally:
    """What this step's episodes did (the loop reports rewards; the calls are ours).
    Blocking environments run on a thread pool: the counts take a lock."""

    def __init__(self) -> None:
        self.episodes = self.correct_calls = 0
        self.lock = threading.Lock()

    def add(self, episodes: int = 0, correct_calls: int = 0) -> None:
        with self.lock:
            self.episodes += episodes
            self.correct_calls += correct_calls

    def take_share(self) -> float:
        """The share of correct calls since the last call, and start counting anew."""
        with self.lock:
            share = self.correct_calls / self.episodes if self.episodes else 0.0
            self.episodes = self.correct_calls = 0
        return share


class CalculatorEnv:
    """One problem. Turn 1: an answer (the episode ends) or a call ``[a+b]``;
    the calculator's output is the next observation. Turn 2: the answer."""

    def __init__(self, tok: treadle.Tokenizer, a: int, b: int, tally: Tally) -> None:
        self.tok, self.a, self.b, self.tally = tok, a, b, tally
        self.called = False

    def initial_observation(self) -> list[int]:
        self.tally.add(episodes=1)
        return [self.tok.bos_token_id, *self.tok.encode(f"{self.a}+{self.b}=")]

    def step(self, action: list[int]) -> rl.StepResult:
        finished = bool(action) and action[-1] == self.tok.eos_token_id
        text = self.tok.decode(action)
        if finished and text == CALL and not self.called:  # the tool: a calculator
            self.called = True
            self.tally.add(correct_calls=1)
            return rl.StepResult(
                0.0, done=False, observation=self.tok.encode(f"{self.a + self.b}\n")
            )
        right = finished and text == str(self.a + self.b)
        return rl.StepResult(float(right), done=True)


def problems(rng: random.Random):
    """Two-digit sums of three digits: too many to memorise (2,500) for the demo model."""
    while True:
        yield rng.randrange(50, 100), rng.randrange(50, 100)


def env_groups(tok: treadle.Tokenizer, tally: Tally, seed: int = 0):
    for a, b in problems(random.Random(seed)):
        yield rl.EnvGroup([CalculatorEnv(tok, a, b, tally) for _ in range(GROUP_SIZE)])


# ---- 3. the warm-up: demonstrations, trained on the model's tokens only -----------------


def demonstration(tok: treadle.Tokenizer, a: int, b: int, use_tool: bool) -> rl.Rollout:
    """A demonstration as a masked rollout: the same layout as an episode."""
    prompt = [tok.bos_token_id, *tok.encode(f"{a}+{b}=")]
    answer = [*tok.encode(str(a + b)), tok.eos_token_id]
    if not use_tool:
        return rl.Rollout(prompt, answer, [0.0] * len(answer))
    call = [*tok.encode(CALL), tok.eos_token_id]
    output = tok.encode(f"{a + b}\n")
    completion = call + output + answer
    mask = [1.0] * len(call) + [0.0] * len(output) + [1.0] * len(answer)
    return rl.Rollout(prompt, completion, [0.0] * len(completion), mask=mask)


def warm_up(trainer: treadle.TrainingClient, tok: treadle.Tokenizer) -> None:
    rng = random.Random(1)
    source = problems(rng)
    for step in range(1, SFT_STEPS + 1):
        demos = [demonstration(tok, *next(source), use_tool=rng.random() < 0.5) for _ in range(64)]
        datums = [
            treadle.Datum(
                d.model_input,
                {k: d.loss_fn_inputs[k] for k in ("target_tokens", "weights")},
            )
            for d in rl.build_datums(demos, [1.0] * len(demos), include_logprobs=False)
        ]
        trainer.forward_backward(datums, "cross_entropy")
        done = trainer.optim_step(treadle.AdamParams(learning_rate=SFT_LR))
        if step % 50 == 0:  # pipelined, but within the tenant's calls-in-flight quota
            done.result()
    trainer.get_info()  # waits for the pipelined calls above


# ---- 4. evaluation: the same problems and seeds every time --------------------------------


def evaluate(
    sampler: treadle.SamplingClient, tok: treadle.Tokenizer, context: int
) -> tuple[float, float]:
    """Success rate and correct-tool-call share on ``EVAL_PROBLEMS`` fixed problems."""
    tally = Tally()
    rng = random.Random(12345)
    groups = [
        rl.EnvGroup(
            [CalculatorEnv(tok, a, b, tally)],
            sampling_params=treadle.SamplingParams(max_tokens=TURN_TOKENS, seed=i),
        )
        for i, (a, b) in zip(range(EVAL_PROBLEMS), problems(rng), strict=False)
    ]
    results = rl.run_episodes(
        sampler, groups, context_limit=context, limits=rl.EpisodeLimits(max_turns=2)
    )
    episodes = [e for group in results for e in group]
    return sum(e.reward for e in episodes) / len(episodes), tally.take_share()


def main() -> tuple[float, float, float, float]:
    """Runs it all; returns (success before, success after, calls before, calls after)."""
    with connect() as (service, base_model):
        tok = service.get_tokenizer(base_model)
        context = next(
            b.max_context for b in service.get_server_info().base_models if b.name == base_model
        )
        trainer = service.create_training_client(base_model, seed=0)  # full fine-tune
        warm_up(trainer, tok)
        success0, calls0 = evaluate(trainer.sync_weights(), tok, context)
        print(f"after the warm-up: success {success0:.3f}, correct tool calls {calls0:.3f}")

        tally = Tally()
        print("step version success calls  tokens failed     s")
        for s in rl.sync_episode_loop(
            trainer,
            env_groups(tok, tally),
            steps=STEPS,
            groups_per_step=GROUPS_PER_STEP,
            sampling_params=treadle.SamplingParams(max_tokens=TURN_TOKENS, temperature=1.0),
            limits=rl.EpisodeLimits(max_turns=2),
            train_step=rl.grpo_train_step(adam=treadle.AdamParams(learning_rate=RL_LR)),
        ):
            print(
                f"{s.step:>4} {s.version:>7} {s.reward:>7.3f} {tally.take_share():>5.2f} "
                f"{s.trained_tokens:>7} {s.failed_episodes:>6} {s.step_s:>5.1f}"
            )

        success1, calls1 = evaluate(trainer.sync_weights(), tok, context)
        print(f"after RL: success {success1:.3f}, correct tool calls {calls1:.3f}")
        print(
            f"success {success0:.3f} -> {success1:.3f}; correct tool calls {calls0:.3f} -> {calls1:.3f}"
        )
        return success0, success1, calls0, calls1


if __name__ == "__main__":
    main()
