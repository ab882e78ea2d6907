"""The torch sampler's child process (``--sampler torch-process``): the same
``TorchSamplers`` as in one process, on a loop that takes the parent's
messages (``workers.sampler.process.messages``) between two steps.
"""

from __future__ import annotations

import logging
import os
import time
from concurrent.futures import Future
from multiprocessing.connection import Connection

import torch
from torch import Tensor

from treadle.common.engine.domain import SampleResult
from treadle.common.logs import configure_logging
from treadle.workers.engine.base_models import BaseModel
from treadle.workers.engine.versions import WeightSnapshot
from treadle.workers.model.llama import LlamaParams
from treadle.workers.model.lora import LoraAdapter
from treadle.workers.sampler.backend import ResumeJob, SampleJob
from treadle.workers.sampler.process.messages import (
    AddBase,
    AddSnapshot,
    BaseKey,
    Cancel,
    Done,
    FailAll,
    Ready,
    Released,
    ResumeJobMsg,
    SampleJobMsg,
    Stats,
    StatsPlease,
    Stop,
    Streamed,
    Swap,
    ToChild,
)
from treadle.workers.sampler.process.shm import shipped_buffers, sole_holder, unflatten
from treadle.workers.sampler.state import SamplerLimits
from treadle.workers.sampler.torch_backend import STATS_EVERY_S, TorchSamplers


def child_main(
    inbox: Connection,
    outbox: Connection,
    limits: SamplerLimits,
    threads: int,
    level: int,
    log_format: str = "text",
) -> None:
    configure_logging(log_format, process="sampler")
    logging.getLogger().setLevel(level)
    if threads > 0:
        torch.set_num_threads(threads)
    outbox.send(Ready(os.getppid()))
    Child(inbox, outbox, limits).run()


class Child:
    def __init__(self, inbox: Connection, outbox: Connection, limits: SamplerLimits) -> None:
        self.inbox, self.outbox = inbox, outbox
        self.core = TorchSamplers(limits)
        self.bases: dict[BaseKey, BaseModel] = {}
        self.snapshots: dict[int, WeightSnapshot] = {}
        self.futures: dict[int, Future[SampleResult]] = {}
        #: snapshot key -> its shared buffers, until no tensor here is on them
        self.held: dict[int, list[Tensor]] = {}
        self.stopping = False
        self._stats_at = 0.0

    def run(self) -> None:
        while not self.stopping:
            busy = self.core.has_work()
            # Idle: sleep until a message comes. Busy: take what has come, then step.
            while self.inbox.poll(0 if busy else STATS_EVERY_S):
                try:
                    msg = self.inbox.recv()
                except EOFError:  # the parent is gone
                    return
                self._handle(msg)
                if self.stopping:
                    return
                busy = True  # take every message already here before the step
            self.core.step_all()
            if busy and not self.core.has_work():
                self._send_stats()  # once more as it goes idle
            elif busy and time.monotonic() - self._stats_at >= STATS_EVERY_S:
                self._send_stats()
                self._release_unused()

    def _handle(self, msg: ToChild) -> None:
        if isinstance(msg, AddBase):
            self.bases[msg.bkey] = msg.base
        elif isinstance(msg, AddSnapshot):
            self._add_snapshot(msg)
        elif isinstance(msg, SampleJobMsg):
            rid = msg.rid
            on_seq = (
                (lambda i, seq, s: self.outbox.send(Streamed(rid, i, seq, s)))
                if msg.stream
                else None
            )
            weights = self.snapshots[msg.skey]
            job = SampleJob(self.bases[msg.bkey], msg.op, weights, msg.target, on_seq)
            self.core.submit(job, self._future(rid))
        elif isinstance(msg, ResumeJobMsg):
            weights = self.snapshots[msg.skey]
            base = self.bases[msg.bkey]
            resume = ResumeJob(base, msg.handles, msg.params, weights, msg.target)
            self.core.resume(resume, self._future(msg.rid))
        elif isinstance(msg, Swap):
            self.core.swap_weights(self.snapshots[msg.skey])
        elif isinstance(msg, Cancel):
            gone = self.futures.pop(msg.rid, None)
            if gone is not None:
                gone.cancel()
        elif isinstance(msg, StatsPlease):
            self._send_stats()
        elif isinstance(msg, FailAll):
            self.core.fail_all(msg.error)
        elif isinstance(msg, Stop):
            self.stopping = True

    def _add_snapshot(self, msg: AddSnapshot) -> None:
        for old in msg.evict:
            self.snapshots.pop(old, None)
        base = self.bases[msg.bkey]
        lora = None
        if msg.adapter is not None:
            tensors, alpha = msg.adapter
            lora = LoraAdapter.from_named_tensors(base.cfg, unflatten(tensors), alpha=alpha)
        weights = base.params
        if msg.params is not None:
            weights = LlamaParams.from_state_dict(base.cfg, unflatten(msg.params))
        self.snapshots[msg.skey] = WeightSnapshot(msg.model_id, msg.version, weights, lora)
        held = shipped_buffers(msg.params, msg.adapter)
        if held:
            self.held[msg.skey] = held
        self._release_unused()

    def _release_unused(self) -> None:
        """Tell the parent which snapshots' buffers no tensor here is on any more
        (evicted, and no row decodes with them): it may write new versions there."""
        gone = [k for k, bufs in self.held.items() if all(sole_holder(b) for b in bufs)]
        for k in gone:
            del self.held[k]
        if gone:
            self.outbox.send(Released(tuple(gone)))

    def _future(self, rid: int) -> Future[SampleResult]:
        fut: Future[SampleResult] = Future()
        self.futures[rid] = fut

        def done(f: Future[SampleResult]) -> None:
            self.futures.pop(rid, None)
            if f.cancelled():
                return  # the parent cancelled it
            err = f.exception()
            self.outbox.send(Done(rid, err if err is not None else f.result()))

        fut.add_done_callback(done)
        return fut

    def _send_stats(self) -> None:
        self._stats_at = time.monotonic()
        self.core.publish_stats()
        stats = self.core.published_stats()
        self.outbox.send(Stats(tuple(((s.base_model, s.dtype), s) for s in stats)))
