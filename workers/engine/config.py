"""What an engine is built from: the operator's options (``EngineOptions``, read
from flags and environment in one place, ``engine.flags``), the base models, and
the settings no flag reaches (tests and benchmarks set them).

Each option is declared once, in ``EngineOptions``; this class adds only what an
engine needs beyond them."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from treadle.workers.engine.options import EngineOptions
from treadle.workers.sampler.state import SamplerLimits


@dataclass(frozen=True)
class EngineConfig(EngineOptions):
    base_models: Mapping[str, str | Path]
    sampler_prefill_slots: int = 8  # prompts prefilled at once, kept for prefix reuse
    sampler_max_prefill_tokens: int = 512  # prompt tokens computed per step, at most
    sampler_max_queued: int = 4096  # queued sample requests before RESOURCE_EXHAUSTED
    metrics_log_every_s: float = 30.0
    #: run the forward calls of LoRA models on one base as one batched pass
    batch_across_models: bool = True
    #: where auto-checkpoints go (``EngineOptions.auto_checkpoint_steps``); None: off
    auto_checkpoint_root: str | Path | None = None

    def sampler_limits(self) -> SamplerLimits:
        """The torch sampler's limits, as these settings give them."""
        return SamplerLimits(
            num_slots=self.sampler_slots,
            max_len=self.sampler_max_len,
            prefill_slots=self.sampler_prefill_slots,
            max_prefill_tokens=self.sampler_max_prefill_tokens,
            max_queued=self.sampler_max_queued,
            turn_cache_slots=self.sampler_turn_cache_slots,
            log_every_s=self.metrics_log_every_s,
            kv_memory_fraction=self.kv_cache_memory_fraction,
            thread_policy=self.sampler_thread_policy,
        )
