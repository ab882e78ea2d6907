"""The seq_ids of one training model on the client: numbering, the calls still
pending, and what a server restart does to them.

Every ordered call says which server instance its numbering was made against
and the lowest seq_id of the model still pending here (``treadle.wire.metadata``). A
restarted server that brought the model back behind that lowest pending call
refuses the call at once with ``ServerRestartedError`` (``server.restarts``):
the calls in between were answered by the old server and died with it, so no
call will ever fill the gap.

Then, by default, the error reaches the caller, and ``TrainingClient.resync()``
renumbers from where the model is back (``reset``): pending calls of the old
numbering are failed, never applied later out of place.

With ``auto_resync`` the client keeps every ordered request it sent since the
model's last ``save_state`` (at most ``log_bytes`` of them) and, on the error,
replays the lost ones with their own seq_ids, in order, before the pending
calls go on: the model ends where it would have without the restart, and each
call is applied once in the model's history as the restarted server sees it.
When the log does not reach back to the restore point (trimmed, or the model
came back at an older checkpoint than the client's last ``save_state``) the
error is raised as without ``auto_resync``.

A call that fails UNAVAILABLE once its retries are spent (the server, the
broker or the network was down) may or may not have reached the model, and the
calls numbered after it wait for it there. So it is kept, and sent again with
its own seq_id and payload just before the next ordered call of the model:
applied by then, the repeat changes nothing (the engine answers a repeat with
the recorded result); not applied, it is applied now, in its place. Either way
it is applied exactly once and leaves no gap. Its caller has had the error; the
answer of the repeat is dropped. A call that fails so while later calls are
already on their way (they wait for it on the server) is sent again shortly
(``RESEND_AFTER_S``), not only at the next call, for as long as they wait.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from functools import partial
from typing import TYPE_CHECKING, Any, NamedTuple

from treadle._rpc import Caller, settle_once
from treadle.errors import AbortedError, ServerRestartedError, TreadleError, UnavailableError
from treadle.wire.metadata import FIRST_PENDING_KEY, INSTANCE_KEY

if TYPE_CHECKING:
    import grpc

log = logging.getLogger("treadle")

#: the replay log's default bound (requests since the last save_state)
RESYNC_LOG_BYTES = 256 * 1024 * 1024
#: how soon an undelivered call that later calls wait for is sent again
RESEND_AFTER_S = 0.5


class _Logged(NamedTuple):
    method: Any
    request: Any
    size: int


class OrderedCalls:
    def __init__(
        self,
        caller: Caller,
        model_id: str,
        next_seq_id: int,
        *,
        auto_resync: bool = False,
        log_bytes: int = RESYNC_LOG_BYTES,
    ) -> None:
        self._caller = caller
        self.model_id = model_id
        self.auto_resync = auto_resync
        self._log_limit = log_bytes
        self._lock = threading.Lock()
        self._next = next_seq_id
        #: the server instance this numbering was made against ("": none said)
        self._instance = caller.server_instance
        #: seq_id -> its call, numbered and not answered yet (None: not sent yet)
        self._pending: dict[int, Future[Any] | None] = {}
        self._log: OrderedDict[int, _Logged] = OrderedDict()
        self._log_size = 0
        self._floor = next_seq_id - 1  # every call numbered after it is in the log
        #: seq_id -> its call, failed UNAVAILABLE: sent again before the next call
        self._undelivered: dict[int, _Logged] = {}
        self._resend_timer: threading.Timer | None = None
        self.last: Future[Any] | None = None  # the latest ordered call sent

    def take(self) -> int:
        """The next seq_id, pending from now on (so a call sent before it, on
        another thread, already counts it)."""
        with self._lock:
            seq = self._next
            self._next += 1
            self._pending[seq] = None
            return seq

    def send(
        self,
        method: grpc.UnaryUnaryMultiCallable,
        request: Any,
        convert: Callable[[Any], Any],
        *,
        commits: bool = False,
    ) -> Future[Any]:
        """Send an ordered call numbered by ``take``; ``commits``: its success is a
        checkpoint of the model (``save_state``), before which the log is not needed."""
        if self.auto_resync:
            self._remember(method, request)
        self._send_undelivered()
        fut = self._dispatch(method, request, convert)
        if commits and self.auto_resync:
            fut.add_done_callback(partial(self._committed, request.seq_id))
        self.last = fut
        return fut

    def reset(self, next_seq_id: int) -> None:
        """Number from ``next_seq_id`` on, against the server answering now; the
        calls still pending of the old numbering fail (ABORTED) and are not sent
        again, so none of them can be applied later in a slot that is not its own."""
        with self._lock:
            self._next = next_seq_id
            self._instance = self._caller.server_instance
            stale = [(seq, f) for seq, f in self._pending.items() if f is not None]
            self._pending.clear()
            self._undelivered.clear()
            self._log.clear()
            self._log_size = 0
            self._floor = next_seq_id - 1
        for seq, fut in stale:
            settle_once(
                fut,
                error=AbortedError(
                    f"seq_id {seq} of model {self.model_id} was numbered before resync(); "
                    f"it was not sent again (the model continues at seq_id {next_seq_id})"
                ),
            )

    # ---- internals ---------------------------------------------------------------

    def _dispatch(self, method: Any, request: Any, convert: Callable[[Any], Any]) -> Future[Any]:
        seq = request.seq_id
        fut = self._caller.call(
            method,
            request,
            convert,
            extra_metadata=partial(self._metadata, seq),
            recover=self._recover,
        )
        with self._lock:
            if seq in self._pending:  # not answered already
                self._pending[seq] = fut
        fut.add_done_callback(partial(self._answered, _Logged(method, request, 0)))
        return fut

    def _metadata(self, seq: int) -> tuple[tuple[str, str], ...]:
        with self._lock:
            if not self._instance:
                return ()
            first = min([*self._pending, *self._undelivered], default=seq)
            return ((INSTANCE_KEY, self._instance), (FIRST_PENDING_KEY, str(first)))

    def _answered(self, call: _Logged, fut: Future[Any]) -> None:
        seq = call.request.seq_id
        error = None if fut.cancelled() else fut.exception()
        ok = not fut.cancelled() and error is None
        waited_for = False
        with self._lock:
            if self._pending.get(seq) is fut and isinstance(error, UnavailableError):
                # maybe never delivered: the calls after it would wait for it
                self._undelivered[seq] = call
                waited_for = any(s > seq and f is not None for s, f in self._pending.items())
            if self._pending.get(seq, fut) is fut:
                self._pending.pop(seq, None)
            if ok and self._caller.server_instance:
                # the server that answered took this numbering: it is the one to name
                self._instance = self._caller.server_instance
        if waited_for:
            self._resend_soon()

    def _resend_soon(self) -> None:
        """Calls sent after an undelivered one wait for it on the server (until its
        gap timeout): send it again shortly rather than at the next call, which
        its caller, waiting on those calls, may never make (a repeat that failed
        again while the server came back). Stops once no later call is pending."""
        with self._lock:
            if self._resend_timer is not None:
                return
            timer = threading.Timer(RESEND_AFTER_S, self._resend_now)
            timer.daemon = True
            self._resend_timer = timer
        timer.start()

    def _resend_now(self) -> None:
        with self._lock:
            self._resend_timer = None
        self._send_undelivered()

    def _send_undelivered(self) -> None:
        """Send again, in order, the calls that failed UNAVAILABLE (``_answered``)."""
        with self._lock:
            again = [self._undelivered.pop(s) for s in sorted(self._undelivered)]
            for call in again:
                self._pending[call.request.seq_id] = None
        if not again:
            return
        log.warning(
            "treadle: model %s: sending seq_id %s again (failed UNAVAILABLE, maybe never "
            "delivered); the model applies each once",
            self.model_id,
            ", ".join(str(c.request.seq_id) for c in again),
        )
        for call in again:
            self._dispatch(call.method, call.request, lambda r: r).add_done_callback(
                partial(self._replayed, call.request.seq_id)
            )

    def _remember(self, method: Any, request: Any) -> None:
        size = request.ByteSize()
        with self._lock:
            self._log[request.seq_id] = _Logged(method, request, size)
            self._log_size += size
            while self._log_size > self._log_limit and self._log:
                seq, dropped = self._log.popitem(last=False)
                self._log_size -= dropped.size
                self._floor = max(self._floor, seq)

    def _committed(self, seq: int, fut: Future[Any]) -> None:
        if fut.cancelled() or fut.exception() is not None:
            return
        with self._lock:
            while self._log and next(iter(self._log)) <= seq:
                _, dropped = self._log.popitem(last=False)
                self._log_size -= dropped.size
            self._floor = max(self._floor, seq)

    def _recover(self, err: TreadleError) -> bool:
        """On ``ServerRestartedError``, with ``auto_resync``: replay the lost calls
        (once per restart, whichever pending call hears of it first) and send
        this one again. False: the error is the caller's."""
        if not isinstance(err, ServerRestartedError) or not self.auto_resync:
            return False
        instance = err.details.get("instance", "")
        with self._lock:
            if instance and instance == self._instance:
                return True  # another pending call heard first: the replay is under way
            start = err.next_seq_id
            first = min(self._pending, default=self._next)
            lost = range(start, first)
            if start <= self._floor or any(s not in self._log for s in lost):
                log.warning(
                    "treadle: model %s: the server restarted and the calls since its "
                    "checkpoint (seq_id %d on) are no longer kept here; not resyncing",
                    self.model_id,
                    start,
                )
                return False
            replay = [self._log[s] for s in lost]
            self._instance = instance or self._caller.server_instance
            for s in lost:
                self._pending[s] = None
        log.warning(
            "treadle: the server restarted; model %s is back at step %d (seq_id %d, %s): "
            "replaying the %d call(s) after it",
            self.model_id,
            err.step,
            err.seq_id,
            err.checkpoint or "its creation state",
            len(replay),
        )
        for entry in replay:
            self._dispatch(entry.method, entry.request, lambda r: r).add_done_callback(
                partial(self._replayed, entry.request.seq_id)
            )
        return True

    def _replayed(self, seq: int, fut: Future[Any]) -> None:
        if not fut.cancelled() and fut.exception() is not None:
            log.warning(
                "treadle: model %s: seq_id %d, sent again, failed: %s",
                self.model_id,
                seq,
                fut.exception(),
            )
