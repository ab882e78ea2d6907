"""The torch sampler's steps run on the thread count the engine measures for them
(``workers.device.thread_choice``), like training passes: each kind and size of
step tries all threads, then one, and keeps the faster; ``"one"`` and ``"all"``
fix it. The host's thread count is restored after every step, and the samples
are the same whatever the count."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.unit.engine_ops import tiny_config
from treadle.common.engine.domain import SampleOp, SamplerTarget, SamplingConfig
from treadle.workers.engine.loop import Engine
from treadle.workers.sampler.torch_sampler import TorchSampler

pytestmark = pytest.mark.timeout(120)


def _sample(model_dir: Path, policy: str, monkeypatch: pytest.MonkeyPatch) -> tuple:
    seen: list[tuple[str, int]] = []
    real = TorchSampler.step

    def spy(self: TorchSampler) -> None:
        seen.append((self.step_work()[0], torch.get_num_threads()))
        real(self)

    monkeypatch.setattr(TorchSampler, "step", spy)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    config = replace(tiny_config(model_dir), threads=2, sampler_thread_policy=policy)
    engine = Engine(config).start()
    try:
        op = SampleOp(np.arange(3, 12), 2, SamplingConfig(max_tokens=12, seed=5, ignore_eos=True))
        result = engine.sample(SamplerTarget("tiny"), op).result(60)
        after = torch.get_num_threads()
    finally:
        engine.stop()
        torch.set_num_threads(before)
    return seen, after, [s.tokens.tolist() for s in result.sequences]


def test_steps_measure_their_threads_and_restore_the_count(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch, idle_host: object
) -> None:
    measured, after, tokens = _sample(tiny_model_dir, "measure", monkeypatch)
    assert after == 2
    decode = [n for kind, n in measured if kind == "decode"]
    assert measured[0] == ("prefill", 2)  # a new kind and size: all threads first
    assert decode[:2] == [2, 1]  # then one thread, then whichever was faster
    assert set(decode) == {1, 2}
    one, _, tokens_one = _sample(tiny_model_dir, "one", monkeypatch)
    assert {n for _, n in one} == {1}
    every, _, tokens_all = _sample(tiny_model_dir, "all", monkeypatch)
    assert {n for _, n in every} == {2}
    assert tokens == tokens_one == tokens_all


def test_the_flag_reaches_the_sampler_limits() -> None:
    import argparse

    from treadle.errors import InvalidArgumentError
    from treadle.workers.engine.config import EngineConfig
    from treadle.workers.engine.flags import (
        add_engine_flags,
        check_engine_settings,
        engine_settings,
    )

    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    settings = engine_settings(parser.parse_args(["--sampler-thread-policy", "one"]))
    assert settings["sampler_thread_policy"] == "one"
    config = EngineConfig(base_models={}, sampler_thread_policy="one")
    assert config.sampler_limits().thread_policy == "one"
    with pytest.raises(InvalidArgumentError, match="sampler_thread_policy"):
        check_engine_settings(EngineConfig(base_models={}, sampler_thread_policy="fast"))
