"""The Python SDK's side of test/python-parity.test.ts: a fixed pipeline of
forward_backward + optim_step (and a forward_logprobs) on a new LoRA model, printed as
JSON with every float32 logprob as its bit pattern, so Node can replay the same data
and compare to the last bit.

usage: python py_reference.py ADDRESS API_KEY BASE_MODEL
"""

from __future__ import annotations

import json
import sys

import numpy as np

import treadle

SEED, RANK = 11, 4
PPO = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.28}


def bits(arr: np.ndarray) -> list[str]:
    return [x.tobytes().hex() for x in np.asarray(arr, dtype=np.float32)]


def main() -> None:
    address, api_key, base = sys.argv[1:4]
    rng = np.random.default_rng(0)
    with treadle.ServiceClient(address, api_key=api_key, session=False) as service:
        vocab = service.get_tokenizer(base).vocab_size
        data_json = []
        for n in (5, 8, 6):
            tokens = rng.integers(3, vocab, size=n + 1)
            data_json.append(
                {
                    "modelInput": [int(t) for t in tokens[:-1]],
                    "lossFnInputs": {
                        "target_tokens": [int(t) for t in tokens[1:]],
                        "weights": [float(w) for w in rng.random(n).astype(np.float32)],
                        "logprobs": [float(w) for w in (-rng.random(n) * 3).astype(np.float32)],
                        "advantages": [float(w) for w in rng.normal(size=n).astype(np.float32)],
                    },
                }
            )
        data = [
            treadle.Datum(
                model_input=treadle.ModelInput.from_ints(d["modelInput"]),
                loss_fn_inputs={
                    k: np.asarray(v, dtype=np.int64 if k == "target_tokens" else np.float32)
                    for k, v in d["lossFnInputs"].items()
                },
            )
            for d in data_json
        ]
        trainer = service.create_lora_training_client(base, rank=RANK, seed=SEED)
        steps = []
        for loss, config, lr in (
            ("cross_entropy", {}, 1e-2),
            ("ppo", PPO, 5e-3),
            ("cross_entropy", {}, 1e-2),
        ):
            fb = trainer.forward_backward(data, loss, config)
            op = trainer.optim_step(treadle.AdamParams(learning_rate=lr))
            out, step = fb.result(), op.result()
            steps.append(
                {
                    "loss": loss,
                    "config": config,
                    "lr": lr,
                    "logprobs": [bits(o.logprobs) for o in out.loss_fn_outputs],
                    "metrics": out.metrics,
                    "step": step.step,
                    "optimMetrics": step.metrics,
                }
            )
        final = trainer.forward_logprobs(data).result()
        print(
            json.dumps(
                {
                    "seed": SEED,
                    "rank": RANK,
                    "data": data_json,
                    "steps": steps,
                    "final": [bits(o.logprobs) for o in final.loss_fn_outputs],
                }
            )
        )


if __name__ == "__main__":
    main()
