"""The client session a ``ServiceClient`` keeps with the server.

The session is opened on first need (the first model created) and heart-beats
from a daemon thread while the client lives, so the server keeps the models
created through the client loaded between calls: a long reward computation
on the laptop does not get them unloaded. ``close()`` ends it.

The thread stops when its client is closed, when the client is garbage-collected
(``stop()``, from the client's finalizer) and when the interpreter exits
(an ``atexit`` hook); it logs nothing once it was told to stop, so a beat in
flight when the channel closes, or one that fails while the interpreter shuts
down (its log streams may be closed by then), says nothing.
"""

from __future__ import annotations

import atexit
import logging
import os
import platform
import sys
import threading
import weakref
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FuturesTimeout
from typing import TYPE_CHECKING

import treadle
from treadle import _convert
from treadle.errors import TreadleError
from treadle.v1 import session_pb2_grpc

if TYPE_CHECKING:
    import grpc

    from treadle._rpc import Caller

log = logging.getLogger("treadle")

#: every session whose heartbeat thread may run, to stop them all at exit
_LIVE: weakref.WeakSet[SessionKeeper] = weakref.WeakSet()
_EXITING = threading.Event()
#: a heartbeat unanswered this long is worth a warning (it is still waited for)
SLOW_BEAT_S = 60.0


@atexit.register
def _stop_all() -> None:
    """At interpreter exit, before daemon threads are frozen mid-call: stop every
    heartbeat (the server lets the sessions lapse)."""
    _EXITING.set()
    for session in list(_LIVE):
        session.stop()


def _quiet(stop: threading.Event) -> bool:
    """Told to stop, or the interpreter is exiting: beat and log no more."""
    return stop.is_set() or _EXITING.is_set() or sys.is_finalizing()


class SessionKeeper:
    """Opens the client's session on the server and keeps it alive with a
    heartbeat thread (the server's ``ClientSession`` row is what it keeps)."""

    def __init__(
        self, channel: grpc.Channel, caller: Caller, heartbeat_s: float | None = None
    ) -> None:
        self._stub = session_pb2_grpc.SessionServiceStub(channel)
        self._caller = caller
        env = os.environ.get("TREADLE_HEARTBEAT_S")
        self._interval = heartbeat_s or (float(env) if env else None)
        self._lock = threading.Lock()
        #: the running thread's stop signal (each thread has its own: a session
        #: opened again after ``end`` never revives the old thread)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.session_id: str | None = None
        self.beats = 0  # heartbeats the server acknowledged

    def ensure(self) -> str:
        """The session id, opening the session (and its heartbeat thread) if need be."""
        with self._lock:
            if self.session_id is None:
                client = f"treadle-sdk/{treadle.__version__} host={platform.node()}"
                try:
                    info = self._caller.call(
                        self._stub.CreateSession,
                        _convert.create_session_request(client),
                        lambda r: r,
                    ).result()
                except TreadleError as err:
                    if err.code != "UNIMPLEMENTED":
                        raise
                    log.warning("treadle: the server keeps no sessions; not heart-beating")
                    self.session_id = ""  # an older server: models just carry no session
                    return ""
                self.session_id = info.session_id
                interval = self._interval or info.heartbeat_interval_s or 10.0
                self._stop.set()  # a thread of an earlier session, still in a beat
                self._stop = threading.Event()
                self._thread = threading.Thread(
                    target=self._beat,
                    args=(info.session_id, interval, self._stop),
                    name="treadle-heartbeat",
                    daemon=True,
                )
                _LIVE.add(self)
                self._thread.start()
            return self.session_id

    def _beat(self, session_id: str, interval: float, stop: threading.Event) -> None:
        request = _convert.heartbeat_request(session_id)
        failing = False  # warn once per outage, not once per beat
        while not stop.wait(interval) and not _quiet(stop):
            try:
                beat = self._caller.call(self._stub.Heartbeat, request, lambda r: None, retry=False)
                if not self._answered(beat, session_id, interval, stop):
                    return
                self.beats += 1
                failing = False
            except Exception as err:
                if _quiet(stop):  # the channel closed under the beat, or the process exits
                    return
                if isinstance(err, TreadleError) and err.code == "NOT_FOUND":
                    # the server no longer knows it: open anew on need
                    log.warning("treadle: session %s ended on the server", session_id)
                    with self._lock:
                        if self.session_id == session_id:
                            self.session_id = None
                    return
                log.log(  # a timeout has no message: say what it was
                    logging.DEBUG if failing else logging.WARNING,
                    "treadle: heartbeat failed: %s",
                    str(err) or type(err).__name__,
                )
                failing = True

    def _answered(
        self, beat: Future[None], session_id: str, interval: float, stop: threading.Event
    ) -> bool:
        """Wait for the beat's answer (raising its error); False when told to stop
        meanwhile. A slow answer is no failure: the server keeps a model loaded
        for its TTL (an hour by default) after the last beat, so a beat queued
        behind a busy server's work is waited for, and the next one is sent only
        after it (never a pile of beats); a warning only once it is unanswered
        for ``SLOW_BEAT_S``. A server gone or a connection lost fails the call
        (UNAVAILABLE, gRPC's keepalive), and closing the client cancels it."""
        waited, warned = 0.0, False
        while True:
            try:
                beat.result(timeout=interval)
                return True
            except FuturesTimeout:
                if _quiet(stop):
                    return False
                waited += interval
                if waited >= SLOW_BEAT_S and not warned:
                    log.warning(
                        "treadle: heartbeat of session %s unanswered for %.0f s; still waiting",
                        session_id,
                        waited,
                    )
                    warned = True

    def stop(self) -> None:
        """Stop the heartbeats without a word to the server (from a finalizer or at
        exit: no call is made); the thread ends at once, or as soon as its beat
        in flight ends."""
        self._stop.set()

    def join(self, timeout: float) -> bool:
        """Wait for the heartbeat thread to end (after ``stop`` or ``end``); whether
        none is left running."""
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
        return thread is None or not thread.is_alive()

    def end(self) -> None:
        """Stop the heartbeats and end the session (best effort: the server lets a
        silent session lapse anyway). A beat still in flight ends when the
        client closes its channel (``ServiceClient.close`` then joins the thread)."""
        with self._lock:
            session_id, self.session_id = self.session_id, None
            self._stop.set()
        if session_id is None:
            return
        try:
            self._caller.call(
                self._stub.EndSession,
                _convert.end_session_request(session_id),
                lambda r: None,
                retry=False,
            ).result(timeout=5.0)
        except Exception as err:
            log.debug("treadle: could not end session %s: %s", session_id, err)
