"""What an engine is built from: one frozen object, read from flags and
environment in one place (``workers.engine_flags``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class EngineConfig:
    base_models: Mapping[str, str | Path]
    #: where every tensor of the engine lives: "cpu", "cuda", "cuda:N" or "auto"
    #: (``workers.device``)
    device: str = "cpu"
    default_dtype: str = "float32"
    threads: int = 0  # 0: leave torch's default
    #: the sampler backend (``workers.sampler_backends``): "torch" (on the engine
    #: thread, between ordered calls), "torch-thread" (a thread of its own, so
    #: sampling overlaps training), "torch-process" (a process of its own: no
    #: interpreter lock shared with training), "vllm"
    sampler: str = "torch"
    sampler_threads: int = 0  # torch threads of the sampler's thread or process; 0: ``threads``
    #: backend-specific settings (``BackendSettings.options``)
    sampler_options: Mapping[str, Any] = field(default_factory=dict)
    gap_timeout_s: float = 60.0
    keep_versions: int = 4
    sampler_slots: int = 0  # 0: sized by memory (``workers.memory_budget``)
    kv_cache_memory_fraction: float = 0.0  # of free memory, for sampler_slots 0; 0: default
    sampler_max_len: int = 1024
    sampler_prefill_slots: int = 8  # prompts prefilled at once, kept for prefix reuse
    sampler_max_prefill_tokens: int = 512  # prompt tokens computed per step, at most
    sampler_max_queued: int = 4096  # queued sample requests before RESOURCE_EXHAUSTED
    metrics_log_every_s: float = 30.0
    #: run the forward calls of LoRA models on one base as one batched pass
    batch_across_models: bool = True
    #: the most tokens a tenant spends in one scheduling round, what it borrows
    #: ahead of its share included (0: one call of each of its ready models, the
    #: most batching; 1: one call, no borrowing): ``Scheduler.max_quantum_tokens``
    max_quantum_tokens: int = 0
    max_tokens_per_call: int = 262_144
    #: training models recompute each layer in the backward instead of keeping its
    #: activations (``forward_hidden(checkpoint_layers=True)``)
    activation_checkpointing: bool = False
    #: a ForwardBackward whose activations and new gradients would exceed this is
    #: RESOURCE_EXHAUSTED before it starts (``workers.train_memory``); 0 = the
    #: device's available memory at the call
    train_memory_limit_bytes: int = 0
    #: "reuse" (malloc keeps what a step frees for the next, no page faults to get
    #: it back) or "system" (malloc's defaults): ``workers.host_allocator``
    host_allocator: str = "reuse"
    #: torch threads of a forward_backward / forward_logprobs (or a batched pass):
    #: "measure" (one or all, whichever this machine runs faster for calls of that
    #: kind and size; ``workers.thread_choice``), "all" or "one"
    training_threads: str = "measure"
    #: save the state every N optimizer steps (0 = off) under auto_checkpoint_root/<tenant>/<model>/auto
    auto_checkpoint_steps: int = 0
    auto_checkpoint_root: str | Path | None = None
