"""One cluster per broker for every test in this folder (package scope): a
server, two ``treadle worker`` processes, a fresh PostgreSQL database and an
S3 server (moto). Tests that kill or stop workers start extra ones of their own.
Files run in name order; ``test_placement.py`` needs the two workers untouched,
so its name sorts first."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from treadle.server.config import ServerConfig
from treadle.server.embedded import EmbeddedServer

from ..services import fresh_postgres, moto_s3, port_open, wait_for_workers
from .cluster import (
    BASE,
    BROKERS,
    BUCKET,
    TENANTS,
    WORKER_TIMEOUT_S,
    Cluster,
    create_tenant,
    start_worker,
)


@pytest.fixture(scope="package")
def s3_endpoint() -> Iterator[str]:
    with moto_s3(BUCKET) as url:
        yield url


@pytest.fixture(scope="package", params=list(BROKERS))
def cluster(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    tiny_model_dir: Path,
    s3_endpoint: str,
) -> Iterator[Cluster]:
    name = request.param
    broker, port = BROKERS[name]
    if not port_open("127.0.0.1", port):
        pytest.skip(f"{name} is not running on 127.0.0.1:{port}")
    tmp = tmp_path_factory.mktemp(f"dist-{name}")
    store = f"s3://{BUCKET}/{name}"
    with fresh_postgres() as database_url:
        config = ServerConfig(
            data_dir=tmp / "server",
            models={BASE: tiny_model_dir},
            port=0,
            threads=1,
            database_url=database_url,
            broker=broker,
            store=store,
            s3_endpoint_url=s3_endpoint,
            worker_timeout_s=WORKER_TIMEOUT_S,
        )
        workers: dict[str, subprocess.Popen[bytes]] = {}
        logs: dict[str, Path] = {}
        c = Cluster(
            name,
            EmbeddedServer(config).start(),
            database_url,
            s3_endpoint,
            store,
            workers,
            logs,
            tiny_model_dir,
            broker,
        )
        try:
            for i in (1, 2):
                worker_id = f"{name}-w{i}-{os.getpid()}"
                workers[worker_id], logs[worker_id] = start_worker(
                    worker_id, tiny_model_dir, broker, database_url, store, s3_endpoint, tmp
                )
            try:
                wait_for_workers(database_url, list(workers), timeout_s=120)
            except TimeoutError as err:
                raise AssertionError(f"{err}\n{c.log_tail()}") from None
            c.keys = {t: create_tenant(database_url, t) for t in TENANTS}
            yield c
            for client in c.clients:
                client.close()
        finally:
            for proc in workers.values():
                if proc.poll() is None:
                    proc.terminate()
            for proc in workers.values():
                try:
                    proc.wait(20)
                except subprocess.TimeoutExpired:
                    proc.kill()
            c.server.stop()  # the current one: a test may have restarted it
