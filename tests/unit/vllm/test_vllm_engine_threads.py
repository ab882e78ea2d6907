"""vLLM's CPU engine is spawned with as many OpenMP threads as the cores its worker
binds to, whatever ``OMP_NUM_THREADS`` this process inherited (a precaution: more
OpenMP threads than cores make them take turns on one core)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.sampler_backends import vllm_imports
from treadle.workers.vllm import engine as vllm_engine
from treadle.workers.vllm.settings import VllmSettings


class _Base:
    name = "m"
    dtype = torch.float32
    path = Path("/nonexistent-model")


@pytest.mark.skipif(not vllm_imports(), reason="vllm does not import here")
@pytest.mark.parametrize(("cores", "reserved", "threads"), [(2, 1, "1"), (8, 1, "7"), (1, 1, "1")])
def test_the_cpu_engine_is_spawned_with_one_openmp_thread_per_worker_core(
    monkeypatch: pytest.MonkeyPatch, cores: int, reserved: int, threads: str
) -> None:
    import vllm

    seen: dict[str, Any] = {}

    def from_engine_args(args: Any, stat_loggers: Any = None) -> str:
        seen["omp"] = os.environ.get("OMP_NUM_THREADS")
        seen["reserved"] = os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU")
        return "engine"

    monkeypatch.setattr(vllm.LLMEngine, "from_engine_args", staticmethod(from_engine_args))
    monkeypatch.setattr(vllm_engine, "on_gpu", lambda: False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)))
    monkeypatch.setenv("OMP_NUM_THREADS", "2")  # e.g. a benchmark's or a user's shell
    settings = VllmSettings(reserved_cpus=reserved)
    got = vllm_engine.start_engine(_Base(), settings, max_len=64, max_seqs=4)  # type: ignore[arg-type]
    assert got == "engine"
    assert seen == {"omp": threads, "reserved": str(reserved)}
    assert os.environ["OMP_NUM_THREADS"] == "2"  # this process's own setting, restored


def test_a_gpu_host_keeps_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    with vllm_engine.cpu_worker_threads(None):
        assert os.environ["OMP_NUM_THREADS"] == "2"
    monkeypatch.delenv("OMP_NUM_THREADS")
    with vllm_engine.cpu_worker_threads(1):
        assert "OMP_NUM_THREADS" in os.environ
    assert "OMP_NUM_THREADS" not in os.environ  # unset before: unset after


@pytest.mark.skipif(not vllm_imports(), reason="vllm does not import here")
@pytest.mark.parametrize(
    ("cores", "tp", "bind", "threads"),
    [(2, 2, "0|1", "1"), (8, 2, "0,1,2,3|4,5,6,7", "4"), (5, 2, "0,1|2,3", "2")],
)
def test_tensor_parallel_cpu_workers_get_equal_shares_of_the_cores(
    monkeypatch: pytest.MonkeyPatch, cores: int, tp: int, bind: str, threads: str
) -> None:
    import vllm

    seen: dict[str, Any] = {}

    def from_engine_args(args: Any, stat_loggers: Any = None) -> str:
        seen.update(
            tp=args.tensor_parallel_size,
            bind=os.environ.get("VLLM_CPU_OMP_THREADS_BIND"),
            omp=os.environ.get("OMP_NUM_THREADS"),
        )
        return "engine"

    monkeypatch.setattr(vllm.LLMEngine, "from_engine_args", staticmethod(from_engine_args))
    monkeypatch.setattr(vllm_engine, "on_gpu", lambda: False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)))
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    settings = VllmSettings(tensor_parallel_size=tp)
    vllm_engine.start_engine(_Base(), settings, max_len=64, max_seqs=4)  # type: ignore[arg-type]
    assert seen == {"tp": tp, "bind": bind, "omp": threads}


def test_more_tensor_parallel_workers_than_cores_is_refused_naming_the_setting() -> None:
    from treadle.errors import InvalidArgumentError

    with pytest.raises(InvalidArgumentError, match="vllm_tensor_parallel_size: 3 CPU workers"):
        vllm_engine.cpu_binding([0, 1], 3)
    with pytest.raises(InvalidArgumentError, match="vllm_tensor_parallel_size: must be >= 1"):
        VllmSettings.from_options({"tensor_parallel_size": 0})
