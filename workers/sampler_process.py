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
import math
import os
import queue
import threading
import time
import traceback
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.multiprocessing as mp
from torch import Tensor

from treadle.errors import InternalError, TreadleError, UnavailableError
from treadle.workers.base_models import BaseModel
from treadle.workers.domain import SampleResult
from treadle.workers.model.config import ModelConfig
from treadle.workers.model.llama import LlamaParams
from treadle.workers.model.lora import LoraAdapter
from treadle.workers.sampler_backend import (
    EngineThread,
    OnSequence,
    ResumeRequest,
    SampleRequest,
    TensorsCopy,
)
from treadle.workers.sampler_state import SamplerLimits, SamplerStats
from treadle.workers.torch_backend import TorchSamplers
from treadle.workers.versions import WeightSnapshot

log = logging.getLogger("treadle.engine")

BaseKey = tuple[str, str]  # (base model name, dtype name)
#: snapshots the child keeps mapped for new requests (rows keep their own alive)
KEEP_SNAPSHOTS = 16
STATS_EVERY_S = 0.25
RESTART_EVERY_S = 10.0  # a child that keeps dying is not restarted in a loop


Flat = tuple[Tensor, list[tuple[str, tuple[int, ...], int]]]


def _new_shared(numel: int, dtype: torch.dtype) -> Tensor:
    return torch.empty(numel, dtype=dtype).share_memory_()


def _flat(
    named: dict[str, Tensor], alloc: Callable[[int, torch.dtype], Tensor] = _new_shared
) -> Flat | dict[str, Tensor]:
    """One shared-memory buffer holding every tensor (one file descriptor to pass,
    not one per tensor), with each tensor's (name, shape, offset); tensors of
    mixed dtypes travel as they are. Tensors that already are one such buffer
    (``shared_copy``) are passed as they are, without a copy."""
    tensors = list(named.values())
    if len({t.dtype for t in tensors}) != 1:
        return named
    already = _as_flat(named)
    if already is not None:
        return already
    total = sum(t.numel() for t in tensors)
    buf = alloc(total, tensors[0].dtype)
    layout, offset = [], 0
    for name, t in named.items():
        n = t.numel()
        buf[offset : offset + n].copy_(t.detach().reshape(-1))
        layout.append((name, tuple(t.shape), offset))
        offset += n
    return buf, layout


def _as_flat(named: dict[str, Tensor]) -> Flat | None:
    """``named`` as (buffer, layout) if the tensors fill one shared storage back to
    back, in order (what ``shared_copy`` makes); else None."""
    first = next(iter(named.values()))
    storage = first.untyped_storage()
    if not storage.is_shared():
        return None
    layout, offset = [], 0
    for name, t in named.items():
        same = t.untyped_storage().data_ptr() == storage.data_ptr()
        if not same or not t.is_contiguous() or t.storage_offset() != offset:
            return None
        layout.append((name, tuple(t.shape), offset))
        offset += t.numel()
    if offset * first.element_size() != storage.nbytes():
        return None
    return torch.empty(0, dtype=first.dtype).set_(storage, 0, (offset,), (1,)), layout


def shared_copy(
    named: dict[str, Tensor], alloc: Callable[[int, torch.dtype], Tensor] = _new_shared
) -> dict[str, Tensor]:
    """Detached copies of ``named``, in one shared-memory buffer when they share a
    dtype: a full fine-tune's snapshot made so goes to the sampler process without
    a second copy (and parent and child then hold one copy of it, not two)."""
    flat = _flat({k: t.detach() for k, t in named.items()}, alloc)
    if isinstance(flat, dict):
        return {k: t.clone() for k, t in flat.items()}
    return _unflat(flat)


def _unflat(flat: Flat | dict[str, Tensor]) -> dict[str, Tensor]:
    if isinstance(flat, dict):
        return flat
    buf, layout = flat
    out = {}
    for name, shape, offset in layout:
        n = math.prod(shape)
        out[name] = buf[offset : offset + n].view(shape)
    return out


def _storage_refs(t: Tensor) -> int | None:
    """How many references hold ``t``'s storage, as torch counts them (None where
    this torch does not tell)."""
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    return None if use_count is None else int(use_count(t.untyped_storage()._cdata))


def _calibrate() -> int | None:
    """The count of a storage held by one tensor alone, if a view adds exactly one
    (checked once, so a torch that counts otherwise turns reuse off, never on)."""
    t = torch.empty(1)
    alone = _storage_refs(t)
    view = t[:]
    with_view = _storage_refs(t)
    del view
    if alone is None or with_view != alone + 1 or _storage_refs(t) != alone:
        return None
    return alone


_SOLE = _calibrate()


def _sole_holder(buf: Tensor) -> bool:
    """Whether ``buf`` is the only tensor on its storage (no view of it is alive);
    False where torch does not tell (then nothing is reused)."""
    return _SOLE is not None and _storage_refs(buf) == _SOLE


class ShmPool:
    """The shared-memory buffers of published versions, reused once nobody reads them.

    A new shared buffer costs its page faults on the first write: 10.4 ms for a
    17.6 MB buffer (the 5M model) here, against 0.5 ms to copy into one already
    mapped. A full fine-tune publishes a version every step, so each new version
    goes into a buffer of an old one that nobody reads any more, when there is
    one. A buffer is *lent* while the child may read it (shipped under a
    snapshot key, until the child reports the key released: no tensor of its
    own on it any more), and free once it is not lent and the parent holds no
    view of it either (the version store let the version go). At most ``keep``
    free ones are kept.
    """

    def __init__(self, keep: int = 4) -> None:
        self.keep = keep
        self._lock = threading.Lock()
        self._bufs: dict[int, Tensor] = {}  # data_ptr -> every buffer handed out, kept
        self._lent: dict[int, list[int]] = {}  # snapshot key -> data_ptrs the child may read
        self.reused = 0

    def take(self, numel: int, dtype: torch.dtype) -> Tensor:
        if _SOLE is None:  # no way to tell when a buffer is free: never keep one
            return _new_shared(numel, dtype)
        with self._lock:
            lent = {p for ptrs in self._lent.values() for p in ptrs}
            free = [p for p, b in self._bufs.items() if p not in lent and _sole_holder(b)]
            for p in free:
                b = self._bufs[p]
                if b.numel() == numel and b.dtype == dtype:
                    self.reused += 1
                    return b[:]
            for p in free[: max(0, len(free) - self.keep)]:
                del self._bufs[p]  # unmapped as the last tensor on it goes
            buf = _new_shared(numel, dtype)
            self._bufs[buf.data_ptr()] = buf
            # a view, never the pool's own tensor: whoever holds it counts as a reader
            return buf[:]

    def lend(self, skey: int, bufs: list[Tensor]) -> None:
        with self._lock:
            self._lent[skey] = [b.data_ptr() for b in bufs]

    def returned(self, skeys: Sequence[int]) -> None:
        with self._lock:
            for skey in skeys:
                self._lent.pop(skey, None)

    def forget_child(self) -> None:
        """A new child holds nothing: no buffer is lent any more."""
        with self._lock:
            self._lent.clear()


def _shipped_buffers(params: Any, adapter: Any) -> list[Tensor]:
    """The shared buffers a snapshot message carries: its params' and its adapter's
    (each a ``Flat``, or tensors sent one by one, or None)."""
    flats = [params, None if adapter is None else adapter[0]]
    return [f[0] for f in flats if isinstance(f, tuple)]


def _base_key(base: BaseModel) -> BaseKey:
    return base.name, str(base.dtype).removeprefix("torch.")


@dataclass
class _Pending:
    future: Future[SampleResult]
    on_sequence: OnSequence | None


class ProcessTorchBackend:
    """The parent's side: a ``SamplerBackend`` whose samplers step in the child."""

    name = "torch-process"

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
        self._outbox: queue.SimpleQueue[tuple[Any, ...] | None] = queue.SimpleQueue()
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
            target=_child_main,
            args=(
                to_child_r,
                from_child_w,
                self.limits,
                self.torch_threads,
                log.getEffectiveLevel(),
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
        if hello != ("ready", os.getpid()):
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
        self._outbox.put(("fail_all", error))
        self._outbox.put(("stop",))
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

    def copy_weights(self) -> TensorsCopy | None:
        return self.shared_copy

    def submit(self, request: SampleRequest, future: Future[SampleResult]) -> None:
        rid = self._track(future, request.on_sequence)
        if rid is None:
            return
        skey = self._ship(request.base, request.weights)
        stream = request.on_sequence is not None
        msg = ("submit", rid, _base_key(request.base), request.op, skey, request.requester, stream)
        self._outbox.put(msg)

    def resume(self, request: ResumeRequest, future: Future[SampleResult]) -> None:
        rid = self._track(future, None)
        if rid is None:
            return
        skey = self._ship(request.base, request.weights)
        bkey = _base_key(request.base)
        msg = ("resume", rid, bkey, request.handles, request.params, skey, request.requester)
        self._outbox.put(msg)

    def publish(self, base: BaseModel, weights: WeightSnapshot, *, inflight: bool) -> None:
        if not inflight:
            return  # shipped with the first request that reads it
        self._restart_if_dead()
        if self._dead is None:
            self._outbox.put(("swap", self._ship(base, weights)))

    def release(self, model_id: str, versions: Sequence[int]) -> None:
        """Nothing to do: the child lets a version go when no row reads it
        (``KEEP_SNAPSHOTS``), and its buffers come back to the pool then."""

    def fail_all(self, error: TreadleError) -> None:
        if self._dead is None:
            self._outbox.put(("fail_all", error))

    def stats(self) -> list[SamplerStats]:
        """Asked of the child now (1 s at most; a dead child's last ones)."""
        self.refresh_stats(1.0)
        with self._lock:
            return list(self._stats.values())

    def shared_copy(self, named: dict[str, Tensor]) -> dict[str, Tensor]:
        """``shared_copy`` into a buffer from the pool: how the engine snapshots a
        full fine-tune's version for this child."""
        return shared_copy(named, self.pool.take)

    def refresh_stats(self, timeout: float = 1.0) -> None:
        """Ask the child for its samplers' stats now; wait for them (up to ``timeout``)."""
        if self._dead is not None:
            return
        with self._stats_seen:
            seen = self._stats_count
            self._outbox.put(("stats",))
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
                self._outbox.put(("cancel", rid))

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
            self._outbox.put(("base", bkey, base))
            self._bases.add(bkey)
        held = self._snaps.get(id(snapshot))
        if held is not None and held[1]() is snapshot:
            self._snaps.move_to_end(id(snapshot))
            return held[0]
        skey = next(self._ids)
        take = self.pool.take
        params = None
        if snapshot.params is not base.params:
            params = _flat(snapshot.params.state_dict(), take)
        adapter = None
        if snapshot.adapter is not None:
            adapter = (_flat(dict(snapshot.adapter.named_tensors()), take), snapshot.adapter.alpha)
        lent = _shipped_buffers(params, adapter)
        self.pool.lend(skey, lent)
        wire = (snapshot.model_id, snapshot.version, params, adapter)
        self._snaps[id(snapshot)] = (skey, weakref.ref(snapshot))
        evict = []
        while len(self._snaps) > KEEP_SNAPSHOTS:
            evict.append(self._snaps.popitem(last=False)[1][0])
        self._outbox.put(("snapshot", skey, bkey, wire, evict))
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
                log.error("sampler process: cannot send %s: %s", msg[0], err)
                if msg[0] in ("submit", "resume"):
                    self._settle(msg[1], InternalError(f"sampler process: {err}"))

    def _recv_loop(self) -> None:
        while True:
            try:
                msg = self._recv_conn.recv()
            except (EOFError, OSError):
                self._died("the sampler process exited")
                return
            kind = msg[0]
            try:
                if kind == "seq":
                    _, rid, index, seq, seconds = msg
                    with self._lock:
                        pending = self._pending.get(rid)
                    if pending is not None and pending.on_sequence is not None:
                        pending.on_sequence(index, seq, seconds)
                elif kind == "done":
                    self._settle(msg[1], msg[2])
                elif kind == "released":
                    self.pool.returned(msg[1])
                elif kind == "stats":
                    with self._lock:
                        self._stats.update(msg[1])
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


# ---- the child ------------------------------------------------------------------------


def _child_main(
    inbox: Connection, outbox: Connection, limits: SamplerLimits, threads: int, level: int
) -> None:
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if threads > 0:
        torch.set_num_threads(threads)
    outbox.send(("ready", os.getppid()))
    _Child(inbox, outbox, limits).run()


class _Child:
    """The child's side: the same ``TorchSamplers`` as in one process, on a loop
    that takes the parent's messages between two steps."""

    def __init__(self, inbox: Connection, outbox: Connection, limits: SamplerLimits) -> None:
        self.inbox, self.outbox = inbox, outbox
        self.core = TorchSamplers(limits)
        self.bases: dict[BaseKey, BaseModel] = {}
        self.snapshots: dict[int, tuple[BaseKey, WeightSnapshot]] = {}
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

    def _handle(self, msg: tuple[Any, ...]) -> None:
        kind = msg[0]
        if kind == "base":
            _, bkey, base = msg
            self.bases[bkey] = base
        elif kind == "snapshot":
            _, skey, bkey, (model_id, version, params, adapter), evict = msg
            for old in evict:
                self.snapshots.pop(old, None)
            base = self.bases[bkey]
            lora = None
            if adapter is not None:
                tensors, alpha = adapter
                lora = LoraAdapter.from_named_tensors(base.cfg, _unflat(tensors), alpha=alpha)
            weights = base.params
            if params is not None:
                weights = LlamaParams.from_state_dict(base.cfg, _unflat(params))
            self.snapshots[skey] = (bkey, WeightSnapshot(model_id, version, weights, lora))
            held = _shipped_buffers(params, adapter)
            if held:
                self.held[skey] = held
            self._release_unused()
        elif kind == "submit":
            _, rid, bkey, op, skey, requester, stream = msg
            on_seq = (
                (lambda i, seq, s: self.outbox.send(("seq", rid, i, seq, s))) if stream else None
            )
            weights = self.snapshots[skey][1]
            request = SampleRequest(self.bases[bkey], op, weights, requester, on_seq)
            self.core.submit(request, self._future(rid))
        elif kind == "resume":
            _, rid, bkey, handles, params, skey, requester = msg
            weights = self.snapshots[skey][1]
            resume = ResumeRequest(self.bases[bkey], handles, params, weights, requester)
            self.core.resume(resume, self._future(rid))
        elif kind == "swap":
            self.core.swap_weights(self.snapshots[msg[1]][1])
        elif kind == "cancel":
            gone = self.futures.pop(msg[1], None)
            if gone is not None:
                gone.cancel()
        elif kind == "stats":
            self._send_stats()
        elif kind == "fail_all":
            self.core.fail_all(msg[1])
        elif kind == "stop":
            self.stopping = True

    def _release_unused(self) -> None:
        """Tell the parent which snapshots' buffers no tensor here is on any more
        (evicted, and no row decodes with them): it may write new versions there."""
        gone = [k for k, bufs in self.held.items() if all(_sole_holder(b) for b in bufs)]
        for k in gone:
            del self.held[k]
        if gone:
            self.outbox.send(("released", gone))

    def _future(self, rid: int) -> Future[SampleResult]:
        fut: Future[SampleResult] = Future()
        self.futures[rid] = fut

        def done(f: Future[SampleResult]) -> None:
            self.futures.pop(rid, None)
            if f.cancelled():
                return  # the parent cancelled it
            err = f.exception()
            self.outbox.send(("done", rid, err if err is not None else f.result()))

        fut.add_done_callback(done)
        return fut

    def _send_stats(self) -> None:
        self._stats_at = time.monotonic()
        self.core.publish_stats()
        stats = self.core.published_stats()
        self.outbox.send(("stats", [((s.base_model, s.dtype), s) for s in stats]))
