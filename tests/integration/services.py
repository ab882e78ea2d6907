"""Real services for the distributed tests: an S3 server (moto) on a free loopback
port, a fresh PostgreSQL database per run, and reachability checks for the
brokers. Context managers, so test modules pick the fixture scope they need."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

PG_ADMIN_URL = os.environ.get(
    "TREADLE_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
)
REDIS_URL = os.environ.get("TREADLE_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
AMQP_URL = os.environ.get("TREADLE_TEST_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672//")
#: moto accepts any credentials; these keep boto3 from looking for real ones
S3_ENV = {
    "AWS_ACCESS_KEY_ID": "treadle-test",
    "AWS_SECRET_ACCESS_KEY": "treadle-test",
    "AWS_DEFAULT_REGION": "us-east-1",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def port_open(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) == 0


def require_port(host: str, port: int, what: str) -> None:
    if not port_open(host, port):
        pytest.skip(f"{what} is not running at {host}:{port}")


def start_listening(
    argv: list[str], port: int, what: str, timeout_s: float = 30.0
) -> subprocess.Popen[bytes]:
    """``argv`` started (its output discarded) and listening on 127.0.0.1:``port``;
    stopped again, and RuntimeError, if it exits or is not listening in time."""
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + timeout_s
    while not port_open("127.0.0.1", port):
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_process(proc, 10)
            raise RuntimeError(f"{what} did not start")
        time.sleep(0.05)
    return proc


def stop_process(proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    """SIGTERM, then SIGKILL if it has not exited after ``timeout_s``."""
    proc.terminate()
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()


def _moto_server() -> str:
    found = shutil.which("moto_server", path=str(Path(sys.executable).parent)) or shutil.which(
        "moto_server"
    )
    if found is None:
        pytest.skip("moto_server (moto[server]) is not installed")
    return found


@contextmanager
def moto_s3(bucket: str = "treadle-test") -> Iterator[str]:
    """A moto S3 server on a free loopback port with ``bucket`` created; yields the
    endpoint URL. Sets the fake credentials in this process's environment."""
    import boto3

    for key, value in S3_ENV.items():
        os.environ.setdefault(key, value)
    port = free_port()
    proc = start_listening(
        [_moto_server(), "-H", "127.0.0.1", "-p", str(port)], port, "moto_server"
    )
    endpoint = f"http://127.0.0.1:{port}"
    try:
        boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=bucket)
        yield endpoint
    finally:
        stop_process(proc, 10)


@contextmanager
def fresh_postgres(prefix: str = "treadle_dist") -> Iterator[str]:
    """A new database on the test PostgreSQL, dropped afterwards; yields its URL."""
    from sqlalchemy import create_engine, make_url, text
    from sqlalchemy.exc import OperationalError

    admin = create_engine(
        PG_ADMIN_URL, isolation_level="AUTOCOMMIT", connect_args={"connect_timeout": 3}
    )
    name = f"{prefix}_{uuid.uuid4().hex[:12]}"
    try:
        with admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{name}"'))
    except OperationalError as exc:
        admin.dispose()
        pytest.skip(f"PostgreSQL unreachable at {PG_ADMIN_URL}: {exc.orig}")
    try:
        yield make_url(PG_ADMIN_URL).set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def wait_for_workers(database_url: str, ids: list[str], timeout_s: float = 90.0) -> None:
    """Until every worker id is registered live (a worker registers once its Celery
    consumer is up)."""
    from sqlalchemy import create_engine, text

    engine = create_engine(database_url)
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            with engine.connect() as conn:
                live = {
                    row[0]
                    for row in conn.execute(text("SELECT id FROM workers WHERE status = 'live'"))
                }
            if set(ids) <= live:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"workers {sorted(set(ids) - live)} did not come up")
            time.sleep(0.2)
    finally:
        engine.dispose()
