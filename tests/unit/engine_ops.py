"""The engines, models and ordered calls the engine-level sampler suites share (one
definition each)."""

from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import numpy as np

from treadle.common.engine.domain import (
    AdamConfig,
    DatumData,
    ForwardBackwardOp,
    ModelSpec,
    OptimStepOp,
    SequenceResult,
)
from treadle.workers.engine.loop import Engine, EngineConfig


def tiny_config(model_dir: Path, **overrides: Any) -> EngineConfig:
    """An engine on the tiny base model: 8 sampler slots, one torch thread."""
    return EngineConfig(base_models={"tiny": model_dir}, sampler_slots=8, threads=1, **overrides)


def tiny_engine(model_dir: Path, sampler: str = "torch", **overrides: Any) -> Engine:
    """``tiny_config``'s engine with the sampler backend ``sampler``, started."""
    return Engine(tiny_config(model_dir, sampler=sampler, **overrides)).start()


def create_lora(engine: Engine, model_id: str, rank: int = 4) -> None:
    """A model of the tiny base (LoRA rank ``rank``; 0 = a full fine-tune), seed 3."""
    engine.create_model(ModelSpec(model_id, "t", "tiny", rank, 8.0, 3, "float32")).result(30)


def train_step(engine: Engine, model_id: str, seq_id: int) -> int:
    """forward_backward + optim_step (lr 5e-2) through the ordered API on one fixed
    datum; the next seq_id."""
    toks = np.arange(3, 27)
    datum = DatumData(toks[:-1], {"target_tokens": toks[1:], "weights": np.ones(23, np.float32)})
    engine.submit(model_id, seq_id, ForwardBackwardOp((datum,), "cross_entropy", {}), f"fb{seq_id}")
    engine.submit(model_id, seq_id + 1, OptimStepOp(AdamConfig(learning_rate=5e-2)), f"o{seq_id}")
    return seq_id + 2


def random_datum(rng: np.random.Generator, n: int) -> DatumData:
    """``n`` random tokens with random targets, weights, advantages and behaviour
    logprobs: a datum every loss accepts."""
    return DatumData(
        rng.integers(3, 90, size=n),
        {
            "target_tokens": rng.integers(3, 90, size=n),
            "weights": rng.random(n).astype(np.float32),
            "advantages": rng.standard_normal(n).astype(np.float32),
            "logprobs": (-3 - rng.random(n)).astype(np.float32),
        },
    )


class RecordingAPI:
    """An engine that records each call of its methods, and runs call messages
    (``EngineAPI.call``) through the engine's own handlers onto those methods. With
    ``answers``, each method's future is answered at once with ``answers[name]`` (and
    a streamed sample's ``on_sequence`` is sent ``streamed`` first); without, it
    stays pending."""

    def call(self, call: Any) -> Future[Any]:
        from treadle.workers.engine import calls

        return calls.HANDLERS[type(call)](self, call)  # type: ignore[arg-type]

    def stream(self, call: Any, on_sequence: Any) -> Future[Any]:
        from treadle.workers.engine import calls

        return calls.stream(self, call, on_sequence)  # type: ignore[arg-type]

    def __init__(
        self, answers: Mapping[str, Any] | None = None, streamed: SequenceResult | None = None
    ) -> None:
        self.answers = answers
        self.streamed = streamed
        self.calls: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []

    def __getattr__(self, name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Future[Any]:
            self.calls.append((name, args, kwargs))
            fut: Future[Any] = Future()
            if self.answers is not None:
                on_sequence = kwargs.get("on_sequence")
                if on_sequence is not None:
                    on_sequence(0, self.streamed, 0.5)
                fut.set_result(self.answers[name])
            return fut

        return call
