"""The engine with its samplers on a thread of their own (``--sampler torch-thread``):
an in-flight weight update that lands between two decode steps, and a shutdown
that fails what is still sampling. Driven through the engine's thread-safe API.
That it samples what the engine thread samples: ``test_sampler_hosts.py``."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.unit.engine_ops import create_lora, tiny_engine, train_step
from treadle.common.engine.domain import (
    SampleOp,
    SampleResult,
    SamplerTarget,
    SamplingConfig,
    SyncWeightsOp,
)
from treadle.errors import UnavailableError
from treadle.workers.engine.loop import Engine

torch.set_num_threads(1)


def _engine(model_dir: Path, *, threaded: bool) -> Engine:
    engine = tiny_engine(model_dir, "torch-thread" if threaded else "torch")
    create_lora(engine, "m")
    return engine


def test_inflight_update_lands_between_decode_steps(tiny_model_dir: Path) -> None:
    engine = _engine(tiny_model_dir, threaded=True)
    try:
        gate, paused = threading.Event(), threading.Event()
        steps = [0]

        def tick() -> None:  # posted work runs before each step: pause after 5 steps
            steps[0] += 1
            if steps[0] <= 5:
                engine.sampler.loop.post(tick)
            else:
                paused.set()
                gate.wait(30)

        op = SampleOp(np.arange(5, 17), 2, SamplingConfig(max_tokens=16, seed=7, ignore_eos=True))
        fut = engine.sample(SamplerTarget("tiny", "m"), op)  # latest: version 0
        # The engine thread takes calls in order: once this answers, the sample's
        # admission is posted to the sampler thread, ahead of the tick.
        engine.check_sampler_target(SamplerTarget("tiny")).result(30)
        engine.sampler.loop.post(tick)
        assert paused.wait(30)
        seq = train_step(engine, "m", 1)
        engine.submit("m", seq, SyncWeightsOp(inflight=True), "sync").result(30)
        gate.set()
        for s in fut.result(60).sequences:
            (start, n0, v0), (cut, n1, v1) = s.versions  # (first token, count, version)
            assert (start, v0, v1, cut, n0 + n1) == (0, 0, 1, n0, 16)
            assert 5 <= n0 <= 9  # decoded before the pause (and a step or two around it)
    finally:
        engine.stop()


def test_stopping_fails_what_is_still_sampling(tiny_model_dir: Path) -> None:
    engine = _engine(tiny_model_dir, threaded=True)
    gate = threading.Event()
    engine.sampler.loop.post(lambda: gate.wait(30))  # hold the sampler thread
    op = SampleOp(np.arange(5, 12), 1, SamplingConfig(max_tokens=40, ignore_eos=True))
    fut: Future[SampleResult] = engine.sample(SamplerTarget("tiny"), op)
    stopper = threading.Thread(target=engine.stop)
    stopper.start()
    gate.set()
    stopper.join(30)
    with pytest.raises(UnavailableError):
        fut.result(30)
