"""The torch sampler behind ``SamplerBackend``: one implementation, three hosts.

``TorchSamplers`` is the implementation: one ``TorchSampler`` per base model
and dtype, the requests handed to them, and the stepping loop (one step of
each sampler with work, a failing sampler failing its own requests, stats
published) written once. Where it runs is its host:

* ``InlineTorchBackend`` (``--sampler torch``): on the engine thread, between
  two rounds of training calls (``EngineThread.run_between_calls``);
* ``ThreadTorchBackend`` (``--sampler torch-thread``): on a thread of its own
  (``workers.sampler.thread``), so sampling overlaps training;
* ``ProcessTorchBackend`` (``--sampler torch-process``,
  ``workers.sampler.process.proxy``): in a child process, which runs the same
  ``TorchSamplers`` on its own loop.
"""

from __future__ import annotations

import logging
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from concurrent.futures import Future

import torch

from treadle.common.engine.domain import SampleResult
from treadle.common.engine.model_config import ModelConfig
from treadle.common.engine.stats import SamplerStats
from treadle.errors import InternalError, TreadleError
from treadle.workers.device import device
from treadle.workers.device.pass_threads import pass_threads
from treadle.workers.device.thread_choice import ThreadChoice
from treadle.workers.engine.base_models import BaseModel
from treadle.workers.engine.versions import WeightSnapshot
from treadle.workers.model.params import LlamaParams
from treadle.workers.model.published import WeightsFile, WholeWeights, clone_weights
from treadle.workers.sampler.backend import (
    EngineThread,
    ResumeJob,
    SampleJob,
)
from treadle.workers.sampler.state import SamplerLimits
from treadle.workers.sampler.thread import SamplerLoop
from treadle.workers.sampler.torch_sampler import TorchSampler

log = logging.getLogger("treadle.sampler")

SamplerKey = tuple[str, torch.dtype]
#: stats are republished at most this often while a sampler is busy
STATS_EVERY_S = 0.25


class TorchSamplers:
    """The torch samplers of one host: one per base model and dtype, made on first use.

    Not thread-safe: its host calls it from one thread (the one that steps it),
    except ``published_stats``, which any thread may read."""

    def __init__(self, limits: SamplerLimits) -> None:
        self.limits = limits
        #: each step's torch threads: one or all of its host's, measured per kind and size
        self.threads = ThreadChoice(limits.thread_policy, label="sampler")
        self.samplers: dict[SamplerKey, TorchSampler] = {}
        self._stats: dict[SamplerKey, SamplerStats] = {}
        self._stats_lock = threading.Lock()
        self._stats_at = 0.0

    def sampler_for(self, base: BaseModel) -> TorchSampler:
        key = (base.name, base.dtype)
        if key not in self.samplers:
            self.samplers[key] = TorchSampler(base, limits=self.limits)
        return self.samplers[key]

    def submit(self, job: SampleJob, future: Future[SampleResult]) -> None:
        # the sampler is made inside: a KV cache that does not fit fails the future
        _reporting(
            lambda: self.sampler_for(job.base).submit(job, future), future, "sample admission"
        )

    def resume(self, job: ResumeJob, future: Future[SampleResult]) -> None:
        _reporting(
            lambda: self.sampler_for(job.base).resume(job, future), future, "resume admission"
        )

    def swap_weights(self, weights: WeightSnapshot) -> None:
        """An in-flight update: every sampler's requests following ``weights.model_id``."""
        for sampler in self.samplers.values():
            sampler.swap_weights(weights)

    def has_work(self) -> bool:
        return any(s.has_work() for s in self.samplers.values())

    def step_all(self) -> None:
        """One step of every sampler with work; a sampler whose step fails fails
        its own requests (INTERNAL; RESOURCE_EXHAUSTED when the device ran out of
        memory) and stays usable."""
        for key, sampler in list(self.samplers.items()):
            if not sampler.has_work():
                continue
            try:
                kind, tokens = sampler.step_work()
                work = float(tokens * sampler.cfg.num_params())
                with pass_threads(self.threads, sampler.base.device, kind, work):
                    sampler.step()
            except torch.OutOfMemoryError as err:  # its requests fail, its slots are freed
                log.warning("sampler step ran out of device memory: %s", err)
                sampler.fail_all(device.out_of_memory("sample", err, sampler.base.device))
            except Exception as err:
                log.error("sampler step failed: %s\n%s", err, traceback.format_exc())
                sampler.fail_all(InternalError(f"sampler step failed: {type(err).__name__}: {err}"))
            self._publish(key, sampler, force=not sampler.has_work())

    def fail_all(self, error: TreadleError) -> None:
        for sampler in self.samplers.values():
            sampler.fail_all(error)

    def publish_stats(self) -> None:
        """Publish every sampler's stats now."""
        for key, sampler in self.samplers.items():
            self._publish(key, sampler, force=True)

    def published_stats(self) -> list[SamplerStats]:
        with self._stats_lock:
            return list(self._stats.values())

    def _publish(self, key: SamplerKey, sampler: TorchSampler, *, force: bool) -> None:
        """At most every ``STATS_EVERY_S`` while busy; at once when ``force``."""
        now = time.monotonic()
        if not force and now - self._stats_at < STATS_EVERY_S:
            return
        self._stats_at = now
        stats = sampler.stats()
        with self._stats_lock:
            self._stats[key] = stats


class _LocalTorchBackend:
    """What the in-process hosts share; ``_post`` runs work where the samplers live."""

    name = "torch"
    reads_base_weights = True

    def __init__(self, limits: SamplerLimits) -> None:
        self.limits = limits
        self.core = TorchSamplers(limits)

    def _post(self, fn: Callable[[], None]) -> None:
        raise NotImplementedError

    def max_context(self, cfg: ModelConfig) -> int:
        return self.limits.context_of(cfg)

    def keep_weights(self, weights: WholeWeights) -> LlamaParams | WeightsFile:
        return clone_weights(weights)

    def version_memory(self, device: torch.device) -> torch.device | None:
        """A clone on the model's own device."""
        return device

    def submit(self, job: SampleJob, future: Future[SampleResult]) -> None:
        self._post(lambda: self.core.submit(job, future))

    def resume(self, job: ResumeJob, future: Future[SampleResult]) -> None:
        self._post(lambda: self.core.resume(job, future))

    def publish(self, base: BaseModel, weights: WeightSnapshot, *, inflight: bool) -> None:
        if inflight:  # PipelineRL: running latest rows continue under it
            self._post(lambda: self.core.swap_weights(weights))

    def release(self, model_id: str, versions: Sequence[int]) -> None:
        """Nothing to do: a version's tensors go when the last row reading them ends."""

    def fail_all(self, error: TreadleError) -> None:
        self._post(lambda: self.core.fail_all(error))

    def training(self) -> None:
        """Nothing to free: the samplers' KV cache is preallocated."""


class InlineTorchBackend(_LocalTorchBackend):
    """The torch samplers on the engine thread, stepped between rounds of training
    calls: sampling and training take turns (the default, and the simplest)."""

    name = "torch"

    def start(self, engine: EngineThread) -> None:
        engine.run_between_calls(self.core.has_work, self.core.step_all)

    def close(self, error: TreadleError, timeout: float = 10.0) -> None:
        self.core.fail_all(error)

    def _post(self, fn: Callable[[], None]) -> None:
        fn()  # called on the engine thread, where these samplers live

    def stats(self) -> list[SamplerStats]:
        return self.core.published_stats()  # the engine thread may be busy training


class ThreadTorchBackend(_LocalTorchBackend):
    """The torch samplers on a thread of their own (``workers.sampler.thread``)."""

    name = "torch-thread"

    def __init__(self, limits: SamplerLimits, *, torch_threads: int = 0) -> None:
        super().__init__(limits)
        self.loop = SamplerLoop(self.core.step_all, self.core.has_work, torch_threads=torch_threads)

    def start(self, engine: EngineThread) -> None:
        self.loop.start()

    def close(self, error: TreadleError, timeout: float = 10.0) -> None:
        self.loop.post(lambda: self.core.fail_all(error))
        self.loop.stop(timeout)

    def _post(self, fn: Callable[[], None]) -> None:
        self.loop.post(fn)

    def stats(self) -> list[SamplerStats]:
        """Refreshed now: the sampler thread answers between two steps (1 s at most)."""
        if self.loop.running:
            fresh = threading.Event()

            def publish() -> None:
                self.core.publish_stats()
                fresh.set()

            self.loop.post(publish)
            fresh.wait(1.0)
        return self.core.published_stats()


def _reporting(fn: Callable[[], None], fut: Future[SampleResult], what: str) -> None:
    """Run ``fn``; an error it raises fails ``fut`` (a bug is logged first)."""
    try:
        fn()
    except TreadleError as err:
        if not fut.done():
            fut.set_exception(err)
    except Exception as err:
        log.error("%s failed: %s\n%s", what, err, traceback.format_exc())
        if not fut.done():
            fut.set_exception(InternalError(f"{type(err).__name__}: {err}"))
