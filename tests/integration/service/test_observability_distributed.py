"""One call followed end to end: the SDK's request id on the server's log line
and on the JSON log lines of the ``treadle worker`` that ran it (through
Celery over Redis, PostgreSQL as the database); and the worker's own metrics
endpoint."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import treadle
from tests.helpers import next_token_datum
from tests.integration.distributed.cluster import server_config, start_worker, stop_worker
from tests.integration.services import REDIS_URL, fresh_postgres, port_open, wait_for_workers
from treadle import _rpc
from treadle.server.embedded import EmbeddedServer

from .test_observability import scrape, value

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

BASE = "tiny"


def _json_lines(path: Path) -> list[dict[str, object]]:
    out = []
    for line in path.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            out.append(json.loads(line))  # every JSON line parses
    return out


@pytest.fixture(scope="module")
def cluster(
    tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path
) -> Iterator[tuple[EmbeddedServer, Path, subprocess.Popen[bytes]]]:
    if not port_open("127.0.0.1", 6379):
        pytest.skip("redis is not running on 127.0.0.1:6379")
    tmp = tmp_path_factory.mktemp("observe-dist")
    store = tmp / "store"
    with fresh_postgres("treadle_obs") as database_url:
        config = server_config(tmp, tiny_model_dir, database_url, REDIS_URL, str(store))
        server = EmbeddedServer(config).start()
        worker_id = f"obs-w1-{os.getpid()}"
        proc, log = start_worker(
            worker_id,
            tiny_model_dir,
            REDIS_URL,
            database_url,
            str(store),
            "",
            tmp,
            flags=("--log-format", "json", "--metrics-port", "0"),
            verbose=True,
        )
        try:
            try:
                wait_for_workers(database_url, [worker_id], timeout_s=120)
            except TimeoutError as err:
                raise AssertionError(f"{err}\n{log.read_text(errors='replace')}") from None
            yield server, log, proc
        finally:
            stop_worker(proc)
            server.stop()


def test_a_calls_request_id_is_on_the_server_and_worker_log_lines(
    cluster: tuple[EmbeddedServer, Path, subprocess.Popen[bytes]],
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    server, log, _ = cluster
    caplog.set_level(logging.INFO, logger="treadle")
    ids = iter(f"rid-dist-{i:04d}" for i in range(1000))
    monkeypatch.setattr(_rpc, "new_request_id", lambda: next(ids))
    with treadle.ServiceClient(server.address, api_key=server.api_key) as client:
        tc = client.create_lora_training_client(BASE, rank=2, seed=0)
        fb = tc.forward_backward([next_token_datum([1, 2, 3, 4, 5])], "cross_entropy")
        fb.result(timeout=120)
    server_lines = {
        getattr(r, "rpc", ""): getattr(r, "request_id", "")
        for r in caplog.records
        if r.name == "treadle.server.access"
    }
    rid = server_lines["TrainingService/ForwardBackward"]
    assert rid.startswith("rid-dist-")

    deadline = time.monotonic() + 30  # the worker's line of the answer may lag the reply
    while True:
        worker_lines = [line for line in _json_lines(log) if line.get("request_id") == rid]
        if any("answered" in str(line["msg"]) for line in worker_lines) or (
            time.monotonic() > deadline
        ):
            break
        time.sleep(0.2)
    assert worker_lines, log.read_text(errors="replace")[-3000:]
    assert {line["logger"] for line in worker_lines} == {"treadle.worker"}
    assert all(line["process"] == "worker" for line in worker_lines)
    assert any("answered OK" in str(line["msg"]) for line in worker_lines), worker_lines
    create_rid = server_lines["TrainingService/CreateModel"]
    assert create_rid != rid
    assert any(line.get("request_id") == create_rid for line in _json_lines(log))


def test_the_worker_serves_its_engines_metrics(
    cluster: tuple[EmbeddedServer, Path, subprocess.Popen[bytes]],
) -> None:
    _, log, _ = cluster
    found = re.search(r"metrics on http://127\.0\.0\.1:(\d+)/metrics", log.read_text())
    assert found, log.read_text(errors="replace")[-3000:]
    text, samples = scrape(int(found.group(1)))
    assert value(samples, "treadle_engine_models") >= 1
    assert value(samples, "treadle_tokens_trained_total", base_model=BASE) >= 4
    assert value(samples, "process_open_fds") > 0
    assert "treadle_rpc_calls_total" not in samples  # RPCs are the server's
