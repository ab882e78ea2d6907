"""The engine's settings that an operator chooses: one frozen dataclass, the only
place each of them, its default and its meaning are written.

``ServerConfig`` (embedded engine), ``WorkerConfig`` (Celery worker) and
``EngineConfig`` (what an engine is built from) all extend it, so an option added
here is a flag of both processes (``engine.flags``) and a setting of the engine at
once. Keyword-only, so a subclass may put its own required fields first
(``EngineConfig(base_models, ...)``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any


@dataclass(frozen=True, kw_only=True)
class EngineOptions:
    #: where every tensor of the engine lives: "cpu", "cuda", "cuda:N", or "auto"
    #: (``engine.device``; the flags resolve "auto" before it gets here)
    device: str = "cpu"
    default_dtype: str = "float32"
    threads: int = 0  # torch threads of the engine; 0 = torch's default
    #: the sampler backend (``sampler.backends``, ``--sampler``): "torch" (on the
    #: engine thread, between ordered calls), "torch-thread" (a thread of its own, so
    #: sampling overlaps training), "torch-process" (a process of its own: no
    #: interpreter lock shared with training), "vllm"
    sampler: str = "torch"
    sampler_threads: int = 0  # torch threads of the sampler's thread or process; 0 = threads
    #: backend-specific settings (``--vllm-*`` for vllm; ``BackendSettings.options``)
    sampler_options: Mapping[str, Any] = field(default_factory=dict)
    #: torch threads of a forward_backward / forward_logprobs (or a batched pass):
    #: "measure" (one or all, whichever this machine runs faster for calls of that
    #: kind and size; ``device.thread_choice``), "all" or "one"
    training_threads: str = "measure"
    #: torch threads of each step of the torch sampler, on the CPU: the same choices
    #: ("measure": a busy host's sampler steps run on one thread, where two took
    #: 3-10x as long)
    sampler_thread_policy: str = "measure"
    #: seconds an ordered call waits for a missing earlier seq_id before ABORTED
    gap_timeout_s: float = 60.0
    keep_versions: int = 4  # published weight versions kept per model
    sampler_slots: int = 0  # rows decoding together; 0 = sized by memory (--sampler-slots)
    kv_cache_memory_fraction: float = 0.0  # of free memory, for sampler_slots 0; 0 = default
    sampler_max_len: int = 1024
    #: finished turns' KV kept for requests that ask (``cache_completion``: agent
    #: episodes), in slots of ``sampler_max_len`` tokens (0: none); an auto-sized KV
    #: cache is that much smaller (``--sampler-turn-cache-slots``)
    sampler_turn_cache_slots: int = 16
    max_tokens_per_call: int = 262_144
    #: save the state every N optimizer steps (0 = off), under the engine's
    #: auto_checkpoint_root/<tenant>/<model>/auto
    auto_checkpoint_steps: int = 0
    #: the most tokens a tenant spends in one scheduling round, what it borrows
    #: ahead of its share included (0: one call of each of its ready models, the
    #: most batching; 1: one call, no borrowing): ``Scheduler.max_quantum_tokens``
    max_quantum_tokens: int = 0
    #: training models recompute each layer in the backward instead of keeping its
    #: activations (long sequences: less memory, about one more forward)
    activation_checkpointing: bool = False
    #: a ForwardBackward whose activations and new gradients would exceed this is
    #: RESOURCE_EXHAUSTED before it starts (``trainer.memory``); 0 = the device's
    #: available memory at the call
    train_memory_limit_bytes: int = 0
    #: "reuse" (malloc keeps what a step frees for the next, no page faults to get
    #: it back) or "system" (malloc's defaults): ``engine.host_allocator``
    host_allocator: str = "reuse"
    #: processes of this worker (``workers.group``): rank 0 runs the engine, every rank
    #: executes each training call on torch.distributed; 1: one process, no group
    ranks: int = 1
    #: hosts of the group (``--nnodes``), this host's index (``--node-rank``) and where
    #: they meet (``--rdzv-endpoint HOST:PORT``, served by node 0; "" = loopback)
    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str = ""
    #: seconds a collective of the group waits for every rank before the call fails
    #: UNAVAILABLE (a rank died or hangs)
    collective_timeout_s: float = 300.0
    #: times a worker process whose group lost a rank restarts it (re-executes itself:
    #: a fresh group, the same command line) before it exits for its supervisor
    group_restarts: int = 3


#: the operator's options, by name: what a server's or worker's config hands its engine
ENGINE_FIELDS = tuple(f.name for f in fields(EngineOptions))
