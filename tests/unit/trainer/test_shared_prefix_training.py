"""GRPO's minibatches through the trainer: with each prompt computed once
(``workers.model.shared_prefix``) the calls give the results and gradients the plain
forward gives, float64, to rounding; and the shared forward is the one that ran."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from treadle.common.engine.domain import DatumData, ForwardBackwardOp, ForwardLogprobsOp, ModelSpec
from treadle.workers.engine.base_models import BaseModelRegistry
from treadle.workers.model import shared_prefix
from treadle.workers.trainer import trainer
from treadle.workers.trainer.trainer import TrainingModel

torch.set_num_threads(1)


def _grpo_datums(seed: int, prompts: int = 5, group: int = 6, keep: int = 20) -> tuple:
    """``group`` sampled completions of each prompt as PPO datums, shuffled, ``keep``
    of them: one minibatch of a GRPO step."""
    rng = np.random.default_rng(seed)
    data = []
    for _ in range(prompts):
        prompt = rng.integers(3, 90, size=int(rng.integers(4, 10)))
        advantage = 0.0
        for _ in range(group):
            completion = rng.integers(3, 90, size=int(rng.integers(1, 5)))
            full = np.concatenate((prompt, completion))
            n = full.size - 1
            weights = (np.arange(n) >= prompt.size - 1).astype(np.float32)
            advantage = float(rng.standard_normal())
            data.append(
                DatumData(
                    full[:-1],
                    {
                        "target_tokens": full[1:],
                        "weights": weights,
                        "advantages": (advantage * weights).astype(np.float32),
                        "logprobs": (-2 - rng.random(n)).astype(np.float32),
                    },
                )
            )
    order = rng.permutation(len(data))[:keep]
    return tuple(data[i] for i in order)


@pytest.fixture(scope="module")
def base64(tiny_model_dir: Path) -> Any:
    return BaseModelRegistry({"tiny": tiny_model_dir}).get("tiny", torch.float64)


@pytest.mark.parametrize("rank", [0, 4], ids=["full", "lora"])
def test_grpo_calls_equal_the_plain_forward(
    base64: Any, rank: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = ModelSpec("m", "t", "tiny", rank, 8.0, 1, "float64")
    shared, plain = TrainingModel(spec, base64), TrainingModel(spec, base64)
    if rank:  # a trained adapter: B nonzero, so the adapter shapes the forward
        for model in (shared, plain):
            g = torch.Generator().manual_seed(7)
            with torch.no_grad():
                for t in model.adapter.parameters():  # type: ignore[union-attr]
                    t.add_(0.05 * torch.randn(t.shape, generator=g, dtype=t.dtype))
    data = _grpo_datums(seed=rank)
    ops: list[Any] = [
        ForwardBackwardOp(data, "ppo", {"kl_beta": 0.05}, temperature=0.9),
        ForwardLogprobsOp(data),
        ForwardLogprobsOp(data, reference=True),
    ]
    ran: list[int] = []
    real = shared_prefix.forward_hidden_shared

    def spy(*a: Any, **k: Any) -> torch.Tensor:
        ran.append(1)
        return real(*a, **k)

    monkeypatch.setattr(shared_prefix, "forward_hidden_shared", spy)
    results_shared = [_run(shared, op) for op in ops]
    # the ppo call with a KL term: its reference pass and its own, then two reads
    assert len(ran) == 4
    monkeypatch.setattr(shared_prefix, "plan", lambda rows, pad_id=0: None)
    results_plain = [_run(plain, op) for op in ops]
    assert len(ran) == 4  # the plain forward ran

    for a, b in zip(results_shared, results_plain, strict=True):
        for x, y in zip(a.logprobs, b.logprobs, strict=True):
            np.testing.assert_allclose(x, y, rtol=0, atol=1e-12)
        assert a.metrics.keys() == b.metrics.keys()
        for key in a.metrics:
            assert a.metrics[key] == pytest.approx(b.metrics[key], rel=1e-10, abs=1e-12)
    grads = 0
    for name, p in shared.trainable.items():
        q = plain.trainable[name]
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            grads += 1
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-9, atol=1e-12)
    assert grads > 0


def _run(model: TrainingModel, op: Any) -> Any:
    if isinstance(op, ForwardBackwardOp):
        return trainer.forward_backward(model, op)
    return trainer.forward_logprobs(model, op)
