"""``benchmarks/train_step.py --profile``: where the engine's step time goes
(forward, loss, backward, gradient accumulation, optimizer, metrics)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

from _common import table

# ---- the profile --------------------------------------------------------------------


def profile_engine(model: Any, op: Any, mode: str) -> None:
    """Wall time of each phase of the engine's step (``model``, one ``op``, then an
    optimizer step), and torch.profiler's top ops."""
    from torch.profiler import ProfilerActivity, profile, record_function

    from treadle.common.engine.domain import AdamConfig
    from treadle.workers.trainer import losses, trainer

    n, length = len(op.data), max(d.tokens.size for d in op.data)
    phases: dict[str, list[float]] = {}

    def phase(name: str, fn: Callable[[], object]) -> object:
        t0 = time.perf_counter()
        with record_function(name):
            out = fn()
        phases.setdefault(name, []).append(time.perf_counter() - t0)
        return out

    def step() -> None:
        prep = phase("prepare", lambda: trainer.prepare_forward_backward(model, op))
        hidden = phase(
            "forward",
            lambda: trainer.forward_hidden(
                model.cfg, model.params, prep.batch.tokens_B_T, lora=model.adapter
            ),
        )
        logits = phase("lm_head", lambda: trainer.lm_logits(model.cfg, model.params, hidden))
        lp, ent = phase(
            "logprobs+entropy",
            lambda: trainer.logprobs_from_logits(
                logits, prep.batch.targets_B_T, op.temperature, with_entropy=True
            ),
        )
        loss, _ = phase("loss", lambda: trainer.finish_forward_backward(model, op, prep, lp, ent))
        phase("backward+accumulate", lambda: trainer.accumulate_gradients(loss, [model]))
        phase("optimizer+metrics", lambda: model.optim_step(AdamConfig()))

    del losses
    step()
    phases.clear()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(2):
            step()
    total = sum(statistics.median(v) for v in phases.values())
    print(f"\nprofile: engine step, {mode}, {n} x {length}: {total * 1e3:.0f} ms")
    print(
        table(
            ["phase", "ms", "share"],
            [
                [k, statistics.median(v) * 1e3, f"{statistics.median(v) / total:.0%}"]
                for k, v in phases.items()
            ],
        )
    )
    # inside the phases: the ranges the trainer and the optimizer name themselves
    named = {
        e.key: e.cpu_time_total / 1e3 / 2  # ms a step (two profiled steps)
        for e in prof.key_averages()
        if e.key.startswith("treadle.")
    }
    labels = {
        "treadle.backward": "backward (autograd)",
        "treadle.accumulate": "gradient accumulation",
        "treadle.adamw": "optimizer (fused AdamW)",
        "treadle.grad_norm": "metrics: grad norm",
        "treadle.update_norm": "metrics: update norm",
    }
    print(
        table(
            ["inside", "ms", "share of step"],
            [
                [label, named.get(key, 0.0), f"{named.get(key, 0.0) / 1e3 / total:.1%}"]
                for key, label in labels.items()
            ],
        )
    )
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
