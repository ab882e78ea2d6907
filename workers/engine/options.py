"""The engine options that ``ServerConfig`` (embedded engine) and ``WorkerConfig``
(Celery worker) share: one frozen dataclass both configs extend, so each field,
its default and its meaning are written once (flags: ``engine_flags``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any


@dataclass(frozen=True)
class EngineOptions:
    #: where the engine's tensors live: "cpu" or "cuda:N" (the flag's "auto" resolved)
    device: str = "cpu"
    default_dtype: str = "float32"
    threads: int = 0  # torch threads of the engine; 0 = torch's default
    #: the sampler backend: torch | torch-thread | torch-process | vllm (``--sampler``)
    sampler: str = "torch"
    sampler_threads: int = 0  # torch threads of the sampler's thread or process; 0 = threads
    #: backend-specific settings (``--vllm-*`` for vllm)
    sampler_options: Mapping[str, Any] = field(default_factory=dict)
    training_threads: str = "measure"  # forward passes: "measure" | "all" | "one"
    gap_timeout_s: float = 60.0
    keep_versions: int = 4
    sampler_slots: int = 0  # rows decoding together; 0 = sized by memory (--sampler-slots)
    kv_cache_memory_fraction: float = 0.0  # of free memory, for sampler_slots 0; 0 = default
    sampler_max_len: int = 1024
    max_tokens_per_call: int = 262_144
    auto_checkpoint_steps: int = 0  # 0 = off; else checkpoint every N optimizer steps
    max_quantum_tokens: int = 0  # a tenant's tokens a scheduling round at most; 0 = no cap
    #: recompute each layer in the backward (long sequences: less memory, ~1 more forward)
    activation_checkpointing: bool = False
    #: what one ForwardBackward may need (activations + new gradients); 0 = available memory
    train_memory_limit_bytes: int = 0
    #: "reuse": freed host memory kept for the next step, "system": malloc's defaults
    host_allocator: str = "reuse"


#: the fields both configs carry (the same names as ``EngineConfig``'s)
ENGINE_FIELDS = tuple(f.name for f in fields(EngineOptions))
