"""The vLLM backend's sampler metrics: what one engine generated, over a recent
window, as the ``SamplerStats`` every backend reports (``GetServerInfo``, the
metrics endpoint).

KV cache usage comes from vLLM's own scheduler statistics, through its public
stat-logger hook (``LLMEngine.from_engine_args(..., stat_loggers=[...])``):
``kv_logger`` gives the engine a logger that writes each step's
``kv_cache_usage`` into the engine's meter."""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any

from treadle.common.engine.stats import SamplerStats


class EngineMeter:
    """Counters and the recent window of one vLLM engine (the loop thread updates it)."""

    def __init__(self) -> None:
        self.tokens_generated = 0
        self.prompt_tokens = 0
        self.prefix_reused_tokens = 0
        self.steps = 0
        self.window: deque[tuple[float, int, int]] = deque()  # (time, tokens, rows)
        self.kv_usage = 0.0  # the fraction of KV blocks in use at vLLM's last step
        self.kv_window: deque[tuple[float, float]] = deque()  # (time, kv usage)

    def kv_recorded(self, usage: float) -> None:
        """vLLM's scheduler reported ``usage`` (a fraction of its KV cache's blocks)."""
        self.kv_usage = usage
        now = time.monotonic()
        self.kv_window.append((now, usage))
        while len(self.kv_window) > 256 or now - self.kv_window[0][0] > 10.0:
            self.kv_window.popleft()

    def stepped(self, produced: int, running: int) -> None:
        self.tokens_generated += produced
        self.steps += 1
        now = time.monotonic()
        self.window.append((now, self.tokens_generated, running))
        while len(self.window) > 64 or (self.window and now - self.window[0][0] > 10.0):
            self.window.popleft()

    def stats(
        self, *, running: int, waiting: int, slots: int, base_model: str, dtype: str
    ) -> SamplerStats:
        w = self.window
        rate = 0.0
        if len(w) > 1 and time.monotonic() - w[-1][0] < 5.0:
            rate = (w[-1][1] - w[0][1]) / max(w[-1][0] - w[0][0], 1e-9)
        steps = len(w)
        return SamplerStats(
            running_rows=running,
            queued_requests=waiting,
            prefilling_requests=0,
            free_slots=max(0, slots - running),
            num_slots=slots,
            tokens_generated=self.tokens_generated,
            prompt_tokens=self.prompt_tokens,
            prefix_reused_tokens=self.prefix_reused_tokens,
            decode_steps=self.steps,
            tokens_per_s=rate,
            occupancy=sum(min(r, slots) for _, _, r in w) / (steps * slots) if steps else 0.0,
            base_model=base_model,
            dtype=dtype,
            last_step_at=w[-1][0] if w else 0.0,
            kv_cache_usage=self.kv_usage,
            kv_cache_peak_usage=max((u for _, u in self.kv_window), default=0.0),
        )


def kv_logger(meter: EngineMeter) -> Any:
    """A per-engine stat-logger factory for ``LLMEngine.from_engine_args``: the
    logger it makes writes each step's ``SchedulerStats.kv_cache_usage`` into
    ``meter`` (imports vLLM: call it only where vLLM is installed)."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class KvUsageLogger(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            pass

        def record(
            self,
            scheduler_stats: Any,
            iteration_stats: Any,
            mm_cache_stats: Any = None,
            engine_idx: int = 0,
        ) -> None:
            if scheduler_stats is not None:
                meter.kv_recorded(float(scheduler_stats.kv_cache_usage))

        def log_engine_initialized(self) -> None:
            pass

    return KvUsageLogger


class StatsBoard:
    """The latest ``SamplerStats`` of each engine, published by the loop thread after
    its steps and read by any thread (``GetServerInfo``)."""

    def __init__(self) -> None:
        self._stats: dict[Any, SamplerStats] = {}
        self._lock = threading.Lock()

    def all(self) -> list[SamplerStats]:
        with self._lock:
            return list(self._stats.values())

    def forget(self, key: Any) -> None:
        with self._lock:
            self._stats.pop(key, None)

    def publish(self, eng: Any, slots: int) -> None:
        """``eng``: a ``workers.vllm_pool.VllmEngine`` (its key, base, rows and meter)."""
        stats = eng.meter.stats(
            running=len(eng.rows),
            waiting=len(eng.waiting()),
            slots=slots,
            base_model=eng.base.name,
            dtype=str(eng.base.dtype).removeprefix("torch."),
        )
        with self._lock:
            self._stats[eng.key] = stats
