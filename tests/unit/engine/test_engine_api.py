"""Both in-process engines implement the one typed ``EngineAPI``; the staged one
passes sampling and resumes through to its engine (a Celery worker holds only
the staged engine)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tests.unit.engine_ops import RecordingAPI
from treadle.common.engine.api import EngineAPI
from treadle.common.engine.domain import SampleOp, SamplerTarget, SamplingConfig
from treadle.common.engine.messages import ResumeCall, SampleStreamCall
from treadle.common.store import LocalStore
from treadle.workers.engine.loop import Engine, EngineConfig
from treadle.workers.engine.staging import StagedEngine


def test_engine_and_staged_engine_are_engine_apis(tiny_model_dir: Path, tmp_path: Path) -> None:
    engine = Engine(EngineConfig(base_models={"tiny": tiny_model_dir}))
    staged = StagedEngine(engine, LocalStore(tmp_path))
    assert isinstance(engine, EngineAPI)
    assert isinstance(staged, EngineAPI)


def test_staged_engine_passes_resume_and_streamed_samples_through(tmp_path: Path) -> None:
    inner = RecordingAPI()
    staged = StagedEngine(inner, LocalStore(tmp_path))  # type: ignore[arg-type]
    target = SamplerTarget("tiny", "m", tenant_id="t")
    params = SamplingConfig(max_tokens=4)
    staged.call(ResumeCall(target, ("rh-1", "rh-2"), params))
    on_sequence = lambda i, s, t: None  # noqa: E731
    op = SampleOp(np.arange(3), 1, params)
    staged.stream(SampleStreamCall(target, op), on_sequence)
    assert inner.calls == [
        ("resume", (target, ("rh-1", "rh-2"), params), {}),
        ("sample", (target, op), {"on_sequence": on_sequence}),
    ]
