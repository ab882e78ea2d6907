"""How the engine's training passes were shared: batched across models or alone.

A user running many models (a sweep, several tenants) wants to see whether
their ``ForwardBackward`` / ``ForwardLogprobs`` calls share the base model's
passes (``workers.trainer.batching``) or each run alone; ``GetServerInfo`` reports
these counters per base model. Only those two kinds count: barriers
(``OptimStep``, ``SyncWeights``, ...) are no forward pass.

Written by the engine thread, read by the server's (hence the lock).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class PassStats:
    """Training passes of one base model (and dtype) since the engine started."""

    base_model: str
    dtype: str
    passes: int = 0  # forward passes run (a batched pass counts once)
    batched_passes: int = 0  # passes that held two or more calls (of one model or several)
    calls_batched: int = 0  # calls that ran in a batched pass
    calls_alone: int = 0  # calls that ran in a pass of their own
    tokens_batched: int = 0
    tokens_alone: int = 0
    max_calls_per_pass: int = 0

    @property
    def calls_per_batched_pass(self) -> float:
        return self.calls_batched / self.batched_passes if self.batched_passes else 0.0


class PassCounter:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stats: dict[tuple[str, str], PassStats] = {}

    def record(self, base_model: str, dtype: str, calls: int, tokens: int) -> None:
        """One pass of ``calls`` calls (1: alone) holding ``tokens`` tokens."""
        key = (base_model, dtype)
        with self._lock:
            s = self._stats.get(key) or PassStats(base_model, dtype)
            batched = calls > 1
            self._stats[key] = replace(
                s,
                passes=s.passes + 1,
                batched_passes=s.batched_passes + batched,
                calls_batched=s.calls_batched + (calls if batched else 0),
                calls_alone=s.calls_alone + (0 if batched else calls),
                tokens_batched=s.tokens_batched + (tokens if batched else 0),
                tokens_alone=s.tokens_alone + (0 if batched else tokens),
                max_calls_per_pass=max(s.max_calls_per_pass, calls),
            )

    def snapshot(self) -> list[PassStats]:
        with self._lock:
            return list(self._stats.values())


@dataclass(frozen=True)
class SamplerStats:
    """A sampler's live stats, as the server reports them (``GetServerInfo``, metrics)."""

    running_rows: int
    queued_requests: int
    prefilling_requests: int
    free_slots: int
    num_slots: int
    tokens_generated: int
    prompt_tokens: int
    prefix_reused_tokens: int
    decode_steps: int
    tokens_per_s: float  # generated tokens per second over the recent window
    occupancy: float  # mean fraction of slots decoding per step, recent window
    base_model: str = ""
    dtype: str = ""
    last_step_at: float = 0.0  # time.monotonic() of the last decode step (0: none yet)
    kv_cache_usage: float = 0.0  # fraction of the KV cache's blocks in use, last step
    kv_cache_peak_usage: float = 0.0  # the largest such fraction over the recent window
