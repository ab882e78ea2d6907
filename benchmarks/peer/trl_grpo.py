"""TRL's side of ``benchmarks/peer_trl.py``: ``trl.GRPOTrainer`` on the demo's task.

Runs in the peer virtualenv (``benchmarks/peer/requirements-trl.txt``), never in
treadle's: it imports no treadle. It reads one JSON object of settings from
argv[1], trains the model directory it names with GRPO until the wall-clock
budget (or ``max_steps`` RL steps) is spent, and prints one JSON line: per
generation batch (one RL step) its end time and mean reward, the evaluation exact
match at the end, seconds a step and the process's peak memory.

With ``dump_dir`` set it also writes there what ``peer_trl.py --replay`` feeds
to treadle: the minibatches each optimizer step trained on, as TRL split them
(``minibatches.pt``: prompt and completion ids, masks, advantages, the old
logprobs and the step's token count), the gradient norm before each clip
(``grad_norms.json``) and the weights after the run (``model.safetensors``).

The task and its scoring mirror ``treadle.server.demo``: the prompt is BOS then
``"a+b="``, the reward is 1 when the completion is the answer's digits followed
by EOS (what the demo's ``exact_match`` counts), and the evaluation samples
every one of the 100 problems ``eval_samples`` times at the training temperature.
"""

from __future__ import annotations

import json
import resource
import sys
import time


def main() -> int:
    cfg = json.loads(sys.argv[1])
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    if cfg.get("threads"):
        torch.set_num_threads(int(cfg["threads"]))
    tok = AutoTokenizer.from_pretrained(cfg["model_dir"])
    model = AutoModelForCausalLM.from_pretrained(cfg["model_dir"], dtype=torch.float32)
    problems = [(a, b) for a in range(10) for b in range(10)]
    bos = tok.bos_token
    data = Dataset.from_list(
        [{"prompt": f"{bos}{a}+{b}=", "answer": str(a + b)} for a, b in problems]
    )
    eos = tok.eos_token_id

    def want(answer: str) -> list[int]:
        return [*tok.encode(answer, add_special_tokens=False), eos]

    rewards: list[float] = []  # each generation batch's mean reward, until its step ends

    def exact_match(completion_ids: list[list[int]], answer: list[str], **_: object) -> list[float]:
        out = [float(list(ids) == want(a)) for ids, a in zip(completion_ids, answer, strict=True)]
        rewards.append(sum(out) / len(out))
        return out

    G, P, M = cfg["group_size"], cfg["prompts_per_step"], cfg["minibatches"]
    args = GRPOConfig(
        output_dir=cfg["out_dir"],
        seed=cfg["seed"],
        use_cpu=True,
        bf16=False,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        # one RL step: P prompts x G completions, trained in M optimizer steps
        num_generations=G,
        per_device_train_batch_size=P * G // M,
        gradient_accumulation_steps=1,
        steps_per_generation=M,
        num_iterations=1,
        max_completion_length=cfg["max_tokens"],
        temperature=cfg["temperature"],
        top_p=1.0,
        top_k=0,
        # the loss: DAPO's clip and token normalisation, no KL, no std scaling
        loss_type="dapo",
        epsilon=cfg["clip_low"],
        epsilon_high=cfg["clip_high"],
        beta=0.0,
        scale_rewards="none",
        # AdamW as treadle's AdamParams: constant lr, the same betas, eps, decay, clip
        learning_rate=cfg["lr"],
        lr_scheduler_type="constant",
        warmup_steps=0,
        adam_beta1=cfg["beta1"],
        adam_beta2=cfg["beta2"],
        adam_epsilon=cfg["eps"],
        weight_decay=0.0,
        max_grad_norm=cfg["grad_clip"],
        max_steps=cfg["max_steps"] * M,
        use_vllm=bool(cfg.get("use_vllm")),
    )

    steps: list[tuple[float, float]] = []
    t0 = [0.0]

    class Clock(TrainerCallback):  # type: ignore[misc]
        """Records each RL step's reward and stops when the budget is spent."""

        def on_train_begin(self, *a: object, **k: object) -> None:
            t0[0] = time.perf_counter()

        def on_step_end(self, a: object, state: object, control: object, **k: object) -> None:
            if state.global_step % M:  # type: ignore[attr-defined]
                return  # inside an RL step: its M optimizer steps are not done
            now = time.perf_counter() - t0[0]
            steps.append((now, rewards.pop(0)))
            if now >= cfg["budget_s"]:
                control.should_training_stop = True  # type: ignore[attr-defined]

    dump = Dump(cfg["dump_dir"]) if cfg.get("dump_dir") else None
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=exact_match,
        args=args,
        train_dataset=data,
        processing_class=tok,
        callbacks=[Clock()],
    )
    if dump is not None:
        dump.attach(trainer)
    trainer.train()
    if dump is not None:
        dump.write(trainer)
    wall = time.perf_counter() - t0[0]
    evaluation = evaluate(trainer.model, tok, problems, cfg)
    print(
        json.dumps(
            {
                "steps": steps,
                "wall_s": wall,
                "eval": evaluation,
                "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                "threads": torch.get_num_threads(),
            }
        )
    )
    return 0


class Dump:
    """Records each generation batch's minibatches as TRL splits them (its
    ``split_tensor_dict``, after its shuffle) and each optimizer step's gradient
    norm (accelerate's ``clip_grad_norm_``, which returns it before clipping)."""

    def __init__(self, out: str) -> None:
        self.out = out
        self.minibatches: list[list[dict[str, object]]] = []
        self.grad_norms: list[float] = []

    def attach(self, trainer: object) -> None:
        import torch
        import trl.trainer.grpo_trainer as grpo

        split = grpo.split_tensor_dict

        def recording_split(batch: dict, n: int) -> list[dict]:
            chunks = split(batch, n)
            self.minibatches.append(
                [
                    {k: v.clone() for k, v in c.items() if isinstance(v, torch.Tensor)}
                    for c in chunks
                ]
            )
            return chunks

        grpo.split_tensor_dict = recording_split
        accelerator = trainer.accelerator  # type: ignore[attr-defined]
        clip = accelerator.clip_grad_norm_

        def recording_clip(*a: object, **k: object) -> object:
            norm = clip(*a, **k)
            self.grad_norms.append(float(norm))
            return norm

        accelerator.clip_grad_norm_ = recording_clip

    def write(self, trainer: object) -> None:
        from pathlib import Path

        import torch
        from safetensors.torch import save_file

        out = Path(self.out)
        out.mkdir(parents=True, exist_ok=True)
        torch.save(self.minibatches, out / "minibatches.pt")
        (out / "grad_norms.json").write_text(json.dumps(self.grad_norms))
        state = trainer.model.state_dict()  # type: ignore[attr-defined]
        save_file({k: v.detach().contiguous() for k, v in state.items()}, out / "model.safetensors")


def evaluate(model: object, tok: object, problems: list[tuple[int, int]], cfg: dict) -> float:
    """Exact match over every problem, ``eval_samples`` samples each, at the training
    temperature (the demo's ``evaluate``)."""
    import torch

    torch.manual_seed(cfg["seed"])
    n = cfg["eval_samples"]
    eos = tok.eos_token_id  # type: ignore[attr-defined]
    hits = 0.0
    model.eval()  # type: ignore[attr-defined]
    prompts = [f"{tok.bos_token}{a}+{b}=" for a, b in problems]  # type: ignore[attr-defined]
    batch = tok(prompts, return_tensors="pt", add_special_tokens=False)  # type: ignore[operator]
    with torch.no_grad():
        out = model.generate(  # type: ignore[attr-defined]
            **batch,
            do_sample=True,
            temperature=cfg["temperature"],
            top_k=0,
            top_p=1.0,
            max_new_tokens=cfg["max_tokens"],
            num_return_sequences=n,
            eos_token_id=eos,
            pad_token_id=tok.pad_token_id,  # type: ignore[attr-defined]
        )
    width = batch["input_ids"].shape[1]
    for i, row in enumerate(out[:, width:].tolist()):
        a, b = problems[i // n]
        want = [*tok.encode(str(a + b), add_special_tokens=False), eos]  # type: ignore[attr-defined]
        hits += float(row[: len(want)] == want)
    return hits / (len(problems) * n)


if __name__ == "__main__":
    sys.exit(main())
