"""The torch samplers in a process of their own (``--sampler torch-process``):
``ProcessTorchBackend``, one host of ``workers.torch_backend.TorchSamplers``.

With a sampler thread (``--sampler torch-thread``) sampling overlaps training,
but both threads share one interpreter lock: a small model's decode step and
training step are mostly Python dispatch, so each waits for the other's
(``benchmarks/sampler_contention.py`` measured the trainer 1.45x slower beside
a sampler thread and 1.22x beside a sampler process). Here the samplers live
in a child process (``spawn``ed: the parent runs gRPC threads, which must not
be forked), and the engine talks to them in messages:

* weights travel once, by reference: a base model's tensors and every weight
  snapshot the samplers read are moved into shared memory when first sent
  (``torch.multiprocessing``), so the child maps the same pages the trainer
  published, and a LoRA snapshot's base weights are the child's copy of the
  base (one forward for every adapter and version, as in one process);
* requests, resumes and in-flight updates (``swap_weights``) are sent in the
  order the engine makes them, so an update lands between two decode steps and
  before any request sent after it, as on a sampler thread;
* the child answers with each finished sequence (streams), each request's
  result or error, and the samplers' stats (at most four times a second while
  busy, and on request).

The messages are typed (``workers.sampler.process.messages``), the child's loop is
``workers.sampler.process.child``, the shared-memory buffers ``workers.sampler.process.shm``.

The parent sends from one thread (a queue: a future's cancel callback may run
anywhere, and must never block on the pipe) and receives on another, which
settles the futures and calls stream callbacks. If the child dies (a crash
in a native kernel, the OOM killer), every request in flight fails with
UNAVAILABLE, its partial rollouts are gone (their handles are NOT_FOUND), and
the next request starts a new child (at most one start every
``RESTART_EVERY_S``; sooner, requests are UNAVAILABLE).
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import threading
import time
import traceback
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch
import torch.multiprocessing as mp

from treadle.common.engine.domain import SampleResult
from treadle.common.engine.model_config import ModelConfig
from treadle.common.engine.stats import SamplerStats
from treadle.common.logs import current_log_format
from treadle.errors import InternalError, TreadleError, UnavailableError
from treadle.workers.engine.base_models import BaseModel
from treadle.workers.engine.versions import WeightSnapshot
from treadle.workers.model.params import LlamaParams
from treadle.workers.model.published import WeightsFile, WholeWeights
from treadle.workers.sampler.backend import (
    EngineThread,
    OnSequence,
    ResumeJob,
    SampleJob,
)
from treadle.workers.sampler.process.child import child_main
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
from treadle.workers.sampler.process.shm import ShmPool, flatten, shared_fill, shipped_buffers
from treadle.workers.sampler.state import SamplerLimits

log = logging.getLogger("treadle.engine")

#: snapshots the child keeps mapped for new requests (rows keep their own alive)
KEEP_SNAPSHOTS = 16
RESTART_EVERY_S = 10.0  # a child that keeps dying is not restarted in a loop


def _base_key(base: BaseModel) -> BaseKey:
    return base.name, str(base.dtype).removeprefix("torch.")


@dataclass
class _Pending:
    future: Future[SampleResult]
    on_sequence: OnSequence | None


class ProcessTorchBackend:
    """The parent's side: a ``SamplerBackend`` whose samplers step in the child."""

    name = "torch-process"
    reads_base_weights = True

    def __init__(
        self,
        limits: SamplerLimits,
        *,
        torch_threads: int = 0,
        start_timeout_s: float = 120.0,
    ) -> None:
        self.limits = limits
        self.torch_threads = torch_threads
        self._stats: dict[BaseKey, SamplerStats] = {}
        self._start_timeout_s = start_timeout_s
        self._ids = itertools.count(1)
        self._pending: dict[int, _Pending] = {}
        self._lock = threading.Lock()
        self._outbox: queue.SimpleQueue[ToChild | None] = queue.SimpleQueue()
        self._bases: set[BaseKey] = set()
        # snapshots the child holds: parent id -> (key, the snapshot, weakly)
        self._snaps: OrderedDict[int, tuple[int, weakref.ref[WeightSnapshot]]] = OrderedDict()
        self.pool = ShmPool()
        self._stats_seen = threading.Condition()
        self._stats_count = 0
        self._dead: str | None = None
        self._stopping = False
        self._proc: Any = None
        self._threads: list[threading.Thread] = []
        self._started_at = 0.0
        self.restarts = 0

    # ---- lifecycle -----------------------------------------------------------------

    def start(self, engine: EngineThread | None = None) -> None:
        """Spawn the child (it steps on its own: ``engine`` is not needed)."""
        self._spawn()

    def _spawn(self) -> None:
        self._started_at = time.monotonic()
        ctx = mp.get_context("spawn")
        to_child_r, to_child_w = ctx.Pipe(duplex=False)
        from_child_r, from_child_w = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(
            target=child_main,
            args=(
                to_child_r,
                from_child_w,
                self.limits,
                self.torch_threads,
                log.getEffectiveLevel(),
                current_log_format(),
            ),
            name="treadle-sampler",
            daemon=True,
        )
        self._proc.start()
        to_child_r.close()
        from_child_w.close()
        self._send_conn, self._recv_conn = to_child_w, from_child_r
        try:
            if not self._recv_conn.poll(self._start_timeout_s):
                raise UnavailableError("sampler process: did not start")
            hello = self._recv_conn.recv()
        except (EOFError, OSError):
            raise UnavailableError(
                f"sampler process: exited at start (code {self._proc.exitcode}); a script "
                "that starts it needs `if __name__ == '__main__':` (it is spawned)"
            ) from None
        if hello != Ready(os.getpid()):
            raise InternalError(f"sampler process: unexpected greeting {hello!r}")
        self._threads = [
            threading.Thread(target=self._send_loop, name="treadle-sampler-send", daemon=True),
            threading.Thread(target=self._recv_loop, name="treadle-sampler-recv", daemon=True),
        ]
        for t in self._threads:
            t.start()
        log.info(
            "sampler process %d started (%d torch threads)", self._proc.pid, self.torch_threads
        )

    def close(self, error: TreadleError, timeout: float = 10.0) -> None:
        """Fail what is still running with ``error``, then end the child."""
        if self._proc is None:
            return
        self._stopping = True
        self._outbox.put(FailAll(error))
        self._outbox.put(Stop())
        self._outbox.put(None)
        self._proc.join(timeout)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(timeout)
        for t in self._threads:
            t.join(timeout)
        self._fail_pending(error)

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else int(self._proc.pid)

    # ---- the samplers' operations ---------------------------------------------------

    def max_context(self, cfg: ModelConfig) -> int:
        return self.limits.context_of(cfg)

    def keep_weights(self, weights: WholeWeights) -> LlamaParams | WeightsFile:
        """Into one shared-memory buffer from the pool, each tensor as it comes: the
        child maps it (parent and child hold one copy, not two)."""
        tensors = shared_fill(weights.entries, weights.tensors, self.pool.take)
        return LlamaParams.from_state_dict(weights.cfg, tensors)

    def version_memory(self, device: torch.device) -> torch.device | None:
        """Host RAM (the shared buffer: one copy for parent and child), which is the
        device's memory: this backend runs on the CPU only."""
        return torch.device("cpu")

    def submit(self, job: SampleJob, future: Future[SampleResult]) -> None:
        rid = self._track(future, job.on_sequence)
        if rid is None:
            return
        skey = self._ship(job.base, job.weights)
        stream = job.on_sequence is not None
        bkey = _base_key(job.base)
        self._outbox.put(SampleJobMsg(rid, bkey, job.op, skey, job.target, stream))

    def resume(self, job: ResumeJob, future: Future[SampleResult]) -> None:
        rid = self._track(future, None)
        if rid is None:
            return
        skey = self._ship(job.base, job.weights)
        bkey = _base_key(job.base)
        msg = ResumeJobMsg(rid, bkey, job.handles, job.params, skey, job.target)
        self._outbox.put(msg)

    def publish(self, base: BaseModel, weights: WeightSnapshot, *, inflight: bool) -> None:
        if not inflight:
            return  # shipped with the first request that reads it
        self._restart_if_dead()
        if self._dead is None:
            self._outbox.put(Swap(self._ship(base, weights)))

    def release(self, model_id: str, versions: Sequence[int]) -> None:
        """Nothing to do: the child lets a version go when no row reads it
        (``KEEP_SNAPSHOTS``), and its buffers come back to the pool then."""

    def fail_all(self, error: TreadleError) -> None:
        if self._dead is None:
            self._outbox.put(FailAll(error))

    def training(self) -> None:
        """Nothing to free: the child's KV cache is preallocated."""

    def stats(self) -> list[SamplerStats]:
        """Asked of the child now (1 s at most; a dead child's last ones)."""
        self.refresh_stats(1.0)
        with self._lock:
            return list(self._stats.values())

    def refresh_stats(self, timeout: float = 1.0) -> None:
        """Ask the child for its samplers' stats now; wait for them (up to ``timeout``)."""
        if self._dead is not None:
            return
        with self._stats_seen:
            seen = self._stats_count
            self._outbox.put(StatsPlease())
            self._stats_seen.wait_for(lambda: self._stats_count > seen, timeout)

    # ---- parent internals ------------------------------------------------------------

    def _restart_if_dead(self) -> None:
        """Start a new child in place of a dead one (on the engine thread, which
        makes every call that sends work), unless the last start was too recent."""
        if self._dead is None or self._stopping:
            return
        if time.monotonic() - self._started_at < RESTART_EVERY_S:
            return  # requests stay UNAVAILABLE until then
        log.warning("sampler process: restarting (%s)", self._dead)
        self._outbox.put(None)  # ends the old send loop
        for t in self._threads:
            t.join(5.0)
        if self._proc is not None and self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5.0)
        self._outbox = queue.SimpleQueue()
        self._bases.clear()
        self._snaps.clear()
        self.pool.forget_child()
        try:
            self._spawn()
        except TreadleError as err:
            log.error("sampler process: restart failed: %s", err)
            return
        with self._lock:
            self._dead = None
        self.restarts += 1

    def _track(self, future: Future[SampleResult], on_sequence: OnSequence | None) -> int | None:
        self._restart_if_dead()
        rid = next(self._ids)
        with self._lock:  # _died marks the child dead under this lock too
            dead = self._dead
            if dead is None:
                self._pending[rid] = _Pending(future, on_sequence)
        if dead is not None:
            future.set_exception(UnavailableError(f"sampler process: {dead}"))
            return None

        def cancelled(f: Future[SampleResult]) -> None:
            if f.cancelled():  # the child frees its rows and sends nothing back
                with self._lock:
                    self._pending.pop(rid, None)
                self._outbox.put(Cancel(rid))

        future.add_done_callback(cancelled)
        return rid

    def _ship(self, base: BaseModel, snapshot: WeightSnapshot) -> int:
        """The child's key of ``snapshot``, sending it (and its base) the first time.

        Tensors move into shared memory as they are pickled; a snapshot whose
        params are the base's (LoRA, or the base itself) sends none of them.
        Runs on the engine thread only (every caller does), so the order of
        ``_outbox`` is the order of the engine's decisions."""
        bkey = _base_key(base)
        if bkey not in self._bases:
            self._outbox.put(AddBase(bkey, base))
            self._bases.add(bkey)
        held = self._snaps.get(id(snapshot))
        if held is not None and held[1]() is snapshot:
            self._snaps.move_to_end(id(snapshot))
            return held[0]
        skey = next(self._ids)
        take = self.pool.take
        params = None
        if not base.holds(snapshot.params):
            params = flatten(snapshot.params.state_dict(), take)
        adapter = None
        if snapshot.adapter is not None:
            tensors = dict(snapshot.adapter.named_tensors())
            adapter = (flatten(tensors, take), snapshot.adapter.alpha)
        self.pool.lend(skey, shipped_buffers(params, adapter))
        self._snaps[id(snapshot)] = (skey, weakref.ref(snapshot))
        evict = []
        while len(self._snaps) > KEEP_SNAPSHOTS:
            evict.append(self._snaps.popitem(last=False)[1][0])
        version = snapshot.version
        msg = AddSnapshot(skey, bkey, snapshot.model_id, version, params, adapter, tuple(evict))
        self._outbox.put(msg)
        return skey

    def _send_loop(self) -> None:
        while True:
            msg = self._outbox.get()
            if msg is None:
                return
            try:
                self._send_conn.send(msg)
            except (OSError, ValueError) as err:  # the child is gone
                self._died(f"sending failed ({err})")
                return
            except Exception as err:  # e.g. something that does not pickle: a bug
                log.error("sampler process: cannot send %s: %s", type(msg).__name__, err)
                if isinstance(msg, SampleJobMsg | ResumeJobMsg):
                    self._settle(msg.rid, InternalError(f"sampler process: {err}"))

    def _recv_loop(self) -> None:
        while True:
            try:
                msg = self._recv_conn.recv()
            except (EOFError, OSError):
                self._died("the sampler process exited")
                return
            kind = type(msg).__name__
            try:
                if isinstance(msg, Streamed):
                    with self._lock:
                        pending = self._pending.get(msg.rid)
                    if pending is not None and pending.on_sequence is not None:
                        pending.on_sequence(msg.index, msg.sequence, msg.seconds)
                elif isinstance(msg, Done):
                    self._settle(msg.rid, msg.outcome)
                elif isinstance(msg, Released):
                    self.pool.returned(msg.skeys)
                elif isinstance(msg, Stats):
                    with self._lock:
                        self._stats.update(msg.stats)
                    with self._stats_seen:
                        self._stats_count += 1
                        self._stats_seen.notify_all()
            except Exception:  # a callback's bug: keep receiving
                log.error("sampler process: handling %s failed\n%s", kind, traceback.format_exc())

    def _settle(self, rid: int, outcome: Any) -> None:
        with self._lock:
            pending = self._pending.pop(rid, None)
        if pending is None or pending.future.done():
            return
        if isinstance(outcome, BaseException):
            pending.future.set_exception(outcome)
        else:
            pending.future.set_result(outcome)

    def _died(self, why: str) -> None:
        with self._lock:
            first = self._dead is None
            if first:
                self._dead = why
        if first and not self._stopping:
            log.error("sampler process: %s", why)
        self._fail_pending(UnavailableError(f"sampler process: {why}"))
        with self._stats_seen:
            self._stats_seen.notify_all()

    def _fail_pending(self, error: TreadleError) -> None:
        with self._lock:
            pending = list(self._pending.values())
            self._pending.clear()
        for p in pending:
            if not p.future.done():
                p.future.set_exception(error)
