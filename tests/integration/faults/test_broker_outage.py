"""A broker outage during training, for real: one server and one ``treadle worker``
over a private Redis (started here on a free port, so the shared one is never
touched) and PostgreSQL. Redis stops for a few seconds while a model trains: the
call in flight fails UNAVAILABLE; once Redis is back, the model's next calls
succeed at once, with nothing applied twice and no gap left behind."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text

import treadle
from tests.integration.distributed.cluster import create_tenant as _create_tenant
from tests.integration.distributed.cluster import datum as _datum
from tests.integration.distributed.cluster import server_config, start_worker, stop_worker
from tests.integration.services import free_port, fresh_postgres, start_listening, wait_for_workers
from treadle.errors import UnavailableError
from treadle.server.embedded import EmbeddedServer

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

BASE = "tiny"
#: long enough that a call waiting for a seq_id that never comes cannot pass for a slow one
GAP_TIMEOUT_S = 30.0


class PrivateRedis:
    """A redis-server of this test alone, without persistence (a restart loses
    every queued message, as a broker restart may)."""

    def __init__(self, tmp: Path) -> None:
        self.port = free_port()
        self.tmp = tmp
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.skip("redis-server is not installed")
        argv = [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", ""]
        argv += ["--appendonly", "no", "--dir", str(self.tmp)]
        self.proc = start_listening(argv, self.port, "redis", timeout_s=20)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(20)
        self.proc = None


@dataclass
class Single:
    server: EmbeddedServer
    redis: PrivateRedis
    worker: subprocess.Popen[bytes]
    log: Path
    key: str
    database_url: str

    def log_tail(self) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-20:])


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[Single]:
    tmp = tmp_path_factory.mktemp("outage")
    redis = PrivateRedis(tmp)
    redis.start()
    store = str(tmp / "store")  # one directory both processes reach
    worker: subprocess.Popen[bytes] | None = None
    try:
        with fresh_postgres() as database_url:
            config = server_config(tmp, tiny_model_dir, database_url, redis.url, store)
            server = EmbeddedServer(config).start()
            worker, log = start_worker(
                f"outage-w-{os.getpid()}",
                tiny_model_dir,
                redis.url,
                database_url,
                store,
                "",
                tmp,
                flags=("--gap-timeout", str(GAP_TIMEOUT_S)),
            )
            try:
                wait_for_workers(database_url, [f"outage-w-{os.getpid()}"], timeout_s=120)
                key = _create_tenant(database_url, "alice")
                yield Single(server, redis, worker, log, key, database_url)
            finally:
                stop_worker(worker)
                server.stop()
    finally:
        redis.stop()


def test_a_broker_outage_leaves_no_gap(single: Single) -> None:
    s = single
    service = treadle.ServiceClient(s.server.address, api_key=s.key, max_retries=3)
    try:
        tok = service.get_tokenizer(BASE)
        data = [_datum(tok.encode("12+3=15")), _datum(tok.encode("7+8=15"))]
        adam = treadle.AdamParams(learning_rate=1e-2)
        tc = service.create_lora_training_client(BASE, rank=4, seed=7)
        for step in (1, 2):
            tc.forward_backward(data, "cross_entropy").result()
            assert tc.optim_step(adam).result().step == step

        s.redis.stop()
        try:
            with pytest.raises(UnavailableError):  # the call in flight: fails, retryable
                tc.forward_backward(data, "cross_entropy").result(timeout=120)
        finally:
            s.redis.start()  # the same port: back after a few seconds

        # The next calls succeed, the failed one included in order exactly once.
        tc.forward_backward(data, "cross_entropy").result(timeout=120)
        assert tc.optim_step(adam).result(timeout=120).step == 3, s.log_tail()
        info = tc.get_info()
        assert info.status == "active" and info.version == 3
        tc.forward_backward(data, "cross_entropy").result(timeout=60)
        assert tc.optim_step(adam).result(timeout=60).step == 4
        # the ops log agrees: the call that failed UNAVAILABLE was applied (once) later
        engine = create_engine(s.database_url)
        try:
            with engine.connect() as conn:
                rows = conn.execute(
                    text(
                        "SELECT seq_id, kind, status FROM ops WHERE model_id = :m ORDER BY seq_id"
                    ),
                    {"m": tc.model_id},
                ).all()
        finally:
            engine.dispose()
        assert [tuple(r) for r in rows] == [
            (i + 1, kind, "done")
            for i, kind in enumerate(
                ["forward_backward", "optim_step"] * 2
                + ["forward_backward"] * 2
                + ["optim_step", "forward_backward", "optim_step"]
            )
        ]
    finally:
        service.close()
