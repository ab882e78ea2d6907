"""The SDK's session heartbeat thread ends with its client: on ``close()`` (even
with a beat in flight that the server never answers), when the client is
garbage-collected, and at interpreter exit, where it must log nothing (the
process's log streams may be closed by then: pytest's capture, for one).

A fake ``SessionService`` (gRPC, in this process) stands for the server, so no
model is loaded."""

from __future__ import annotations

import gc
import logging
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest

import treadle
from treadle.v1 import session_pb2, session_pb2_grpc

INTERVAL_S = 0.05


class FakeSessions(session_pb2_grpc.SessionServiceServicer):
    """Opens sessions; its heartbeats answer at once, or block while ``hang`` is set."""

    def __init__(self) -> None:
        self.hang = threading.Event()
        self.release = threading.Event()
        self.beats = 0

    def CreateSession(self, request: object, context: object) -> session_pb2.SessionInfo:  # noqa: N802
        return session_pb2.SessionInfo(session_id="sess-1", heartbeat_interval_s=INTERVAL_S)

    def Heartbeat(self, request: object, context: object) -> session_pb2.HeartbeatResponse:  # noqa: N802
        self.beats += 1
        if self.hang.is_set():
            self.release.wait(30)
        return session_pb2.HeartbeatResponse()

    def EndSession(self, request: object, context: object) -> session_pb2.EndSessionResponse:  # noqa: N802
        return session_pb2.EndSessionResponse()


@pytest.fixture
def fake() -> Iterator[tuple[FakeSessions, grpc.Server, str]]:
    sessions = FakeSessions()
    server = grpc.server(futures.ThreadPoolExecutor(4))
    session_pb2_grpc.add_SessionServiceServicer_to_server(sessions, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield sessions, server, f"127.0.0.1:{port}"
    sessions.release.set()
    server.stop(0)


def _client(address: str) -> treadle.ServiceClient:
    return treadle.ServiceClient(address, api_key="k", heartbeat_s=INTERVAL_S, max_retries=0)


def _heartbeat_thread(client: treadle.ServiceClient) -> threading.Thread:
    assert client.session_id == "sess-1"  # opens the session: the thread starts
    thread = client._session._thread  # type: ignore[union-attr]
    assert thread is not None and thread.is_alive()
    return thread


def _wait_for(cond: object, timeout: float = 10.0) -> None:
    done = threading.Event()
    for _ in range(int(timeout / 0.01)):
        if cond():  # type: ignore[operator]
            return
        done.wait(0.01)
    raise AssertionError("condition not met")


def test_close_ends_the_thread_with_a_beat_in_flight(
    fake: tuple[FakeSessions, grpc.Server, str], caplog: pytest.LogCaptureFixture
) -> None:
    """The server stops answering (a beat hangs past the join in ``end``): closing
    the client still ends the thread, and the beat it cut short logs nothing."""
    sessions, _, address = fake
    client = _client(address)
    thread = _heartbeat_thread(client)
    _wait_for(lambda: sessions.beats >= 2)
    sessions.hang.set()
    seen = sessions.beats
    _wait_for(lambda: sessions.beats > seen)  # a beat is in flight now, unanswered
    caplog.set_level(logging.DEBUG, logger="treadle")
    caplog.clear()
    client.close()  # closing the channel fails the beat in flight (CANCELLED)
    thread.join(5.0)
    assert not thread.is_alive()
    sessions.release.set()
    threading.Event().wait(10 * INTERVAL_S)  # a thread left over would beat and log here
    assert [r.getMessage() for r in _ours(caplog) if "heartbeat" in r.getMessage()] == []


def _ours(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    """The SDK's records: another library's background thread (the tinker SDK's
    session heartbeat, left over from an earlier test whose server is gone) may log
    into the same capture."""
    return [r for r in caplog.records if r.name.split(".")[0] == "treadle"]


def test_a_slow_heartbeat_is_waited_for_not_failed(
    fake: tuple[FakeSessions, grpc.Server, str], caplog: pytest.LogCaptureFixture
) -> None:
    """A busy server answers a beat after 6 s (past the 5 s the SDK waited
    before): no failure, no warning, no second beat meanwhile; beats go on."""
    sessions, _, address = fake
    caplog.set_level(logging.DEBUG, logger="treadle")
    with _client(address) as client:
        _heartbeat_thread(client)
        _wait_for(lambda: sessions.beats >= 2)
        sessions.hang.set()
        seen = sessions.beats
        _wait_for(lambda: sessions.beats > seen)  # this beat waits in the server
        threading.Event().wait(6.0)
        assert sessions.beats == seen + 1  # no beat was sent beside the one waiting
        sessions.hang.clear()
        sessions.release.set()
        acked = client._session.beats  # type: ignore[union-attr]
        _wait_for(lambda: client._session.beats > acked + 2)  # type: ignore[union-attr]
    assert [r.getMessage() for r in _ours(caplog) if r.levelno >= logging.WARNING] == []


def test_close_ends_the_thread_of_a_client_whose_server_went_away(
    fake: tuple[FakeSessions, grpc.Server, str], caplog: pytest.LogCaptureFixture
) -> None:
    sessions, server, address = fake
    client = _client(address)
    thread = _heartbeat_thread(client)
    caplog.set_level(logging.DEBUG, logger="treadle")
    server.stop(0)  # beats now fail UNAVAILABLE (connection refused)
    _wait_for(lambda: any("heartbeat failed" in r.getMessage() for r in _ours(caplog)))
    client.close()
    assert not thread.is_alive()


def test_a_garbage_collected_client_leaves_no_heartbeat_thread(
    fake: tuple[FakeSessions, grpc.Server, str],
) -> None:
    sessions, _, address = fake
    client = _client(address)
    thread = _heartbeat_thread(client)
    _wait_for(lambda: sessions.beats >= 2)
    del client
    gc.collect()
    thread.join(5.0)
    assert not thread.is_alive()


SCRIPT = """
import atexit, logging, sys, threading
from concurrent import futures

import grpc

after_exit = []
shutting_down = threading.Event()


class Record(logging.Handler):
    def emit(self, record):
        if shutting_down.is_set():
            after_exit.append(record.getMessage())


def last():  # registered first: runs after every other exit hook, treadle's too
    shutting_down.set()
    threading.Event().wait(0.5)  # a heartbeat thread left running beats here
    print("logged after exit began:", len(after_exit), after_exit[:2], flush=True)


atexit.register(last)
logging.getLogger("treadle").setLevel(logging.DEBUG)
logging.getLogger("treadle").addHandler(Record())

sys.path.insert(0, {here!r})
from test_sdk_heartbeat_thread import FakeSessions, session_pb2_grpc  # noqa: E402

import treadle  # noqa: E402

sessions = FakeSessions()
server = grpc.server(futures.ThreadPoolExecutor(2))
session_pb2_grpc.add_SessionServiceServicer_to_server(sessions, server)
port = server.add_insecure_port("127.0.0.1:0")
server.start()
client = treadle.ServiceClient(f"127.0.0.1:{{port}}", api_key="k", heartbeat_s=0.05)
assert client.session_id == "sess-1"
server.stop(0).wait()  # the server goes away; the client is never closed
threading.Event().wait(0.3)
"""


def test_no_heartbeat_logs_once_the_interpreter_exits(tmp_path: object) -> None:
    """A client never closed, its server gone, at interpreter exit: its thread
    stops before the process's exit hooks run on (nothing logged after)."""
    here = str(__import__("pathlib").Path(__file__).parent)
    code = textwrap.dedent(SCRIPT.format(here=here))
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "logged after exit began: 0 []" in out.stdout, out.stdout + out.stderr[-2000:]
