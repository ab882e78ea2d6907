"""The client session a ``ServiceClient`` keeps with the server.

The session is opened on first need (the first model created) and heart-beats
from a daemon thread while the client lives, so the server keeps the models
created through the client loaded between calls: a long reward computation
on the laptop does not get them unloaded. ``close()`` ends it.
"""

from __future__ import annotations

import logging
import os
import platform
import threading
from typing import TYPE_CHECKING

import treadle
from treadle import _convert
from treadle.errors import TreadleError
from treadle.v1 import session_pb2_grpc

if TYPE_CHECKING:
    import grpc

    from treadle._rpc import Caller

log = logging.getLogger("treadle")


class ClientSession:
    def __init__(
        self, channel: grpc.Channel, caller: Caller, heartbeat_s: float | None = None
    ) -> None:
        self._stub = session_pb2_grpc.SessionServiceStub(channel)
        self._caller = caller
        env = os.environ.get("TREADLE_HEARTBEAT_S")
        self._interval = heartbeat_s or (float(env) if env else None)
        self._lock = threading.Lock()
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
                self._stop.clear()
                self._thread = threading.Thread(
                    target=self._beat,
                    args=(info.session_id, interval),
                    name="treadle-heartbeat",
                    daemon=True,
                )
                self._thread.start()
            return self.session_id

    def _beat(self, session_id: str, interval: float) -> None:
        request = _convert.heartbeat_request(session_id)
        failing = False  # warn once per outage, not once per beat
        while not self._stop.wait(interval):
            try:
                self._caller.call(
                    self._stub.Heartbeat, request, lambda r: None, retry=False
                ).result(timeout=max(interval, 5.0))
                self.beats += 1
                failing = False
            except TreadleError as err:
                if err.code == "NOT_FOUND":  # the server no longer knows it: open anew on need
                    log.warning("treadle: session %s ended on the server", session_id)
                    with self._lock:
                        if self.session_id == session_id:
                            self.session_id = None
                    return
                log.log(
                    logging.DEBUG if failing else logging.WARNING,
                    "treadle: heartbeat failed: %s",
                    err,
                )
                failing = True
            except Exception as err:  # a timeout; the next beat may get through
                log.log(
                    logging.DEBUG if failing else logging.WARNING,
                    "treadle: heartbeat failed: %s",
                    err or type(err).__name__,
                )
                failing = True

    def end(self) -> None:
        """Stop the heartbeats and end the session (best effort: the server lets a
        silent session lapse anyway)."""
        with self._lock:
            session_id, self.session_id = self.session_id, None
            self._stop.set()
            thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout=1.0)
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
