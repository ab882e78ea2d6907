"""A worker group over two "hosts" (``--nnodes 2 --node-rank K --rdzv-endpoint``;
issue 36): two ``treadle serve`` processes on this machine, node 0 running the
engine and the server, node 1 only its rank. Training through the SDK equals a
one-rank server's; node 1 exits when node 0 stops. A node whose rank cannot read
its base model stops the group's start with the reason (not a hang)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import treadle
from tests.helpers import char_ids, next_token_datum
from tests.integration.services import free_port, port_open
from treadle.server.config import ServerConfig
from treadle.server.embedded import EmbeddedServer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

TIMEOUT = 120.0
TRAIN = [next_token_datum(char_ids(t)) for t in ("12+3=15", "hello world", "9*9=81")]


def _node(
    tmp: Path, model: Path, rank: int, endpoint: str, port: int = 0
) -> tuple[subprocess.Popen[bytes], Path]:
    log = tmp / f"node{rank}.log"
    cmd = [
        *(sys.executable, "-m", "treadle.server.cli", "serve", "--no-auth"),
        *("--model", f"tiny={model}", "--data-dir", str(tmp / f"data{rank}")),
        *("--port", str(port), "--http-port", "-1", "--threads", "1"),
        *("--nnodes", "2", "--node-rank", str(rank), "--rdzv-endpoint", endpoint),
        *("--collective-timeout", "60"),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    return proc, log


def _losses(service: treadle.ServiceClient) -> list[float]:
    tc = service.create_training_client("tiny", seed=1, dtype="float64")
    out = []
    for _ in range(3):
        fb = tc.forward_backward(TRAIN, "cross_entropy")
        tc.optim_step(treadle.AdamParams(learning_rate=2e-3)).result(TIMEOUT)
        out.append(float(fb.result(TIMEOUT).metrics["loss:sum"]))
    return out


def test_two_hosts_train_as_one_rank(tmp_path: Path, tiny_model_dir: Path) -> None:
    endpoint, port = f"127.0.0.1:{free_port()}", free_port()
    node0, log0 = _node(tmp_path, tiny_model_dir, 0, endpoint, port)
    node1, log1 = _node(tmp_path, tiny_model_dir, 1, endpoint)
    try:
        deadline = time.monotonic() + TIMEOUT
        while b"treadle: serving" not in log0.read_bytes() or not port_open("127.0.0.1", port):
            assert node0.poll() is None and time.monotonic() < deadline, log0.read_text()
            time.sleep(0.1)
        assert "a worker of 2 ranks (gloo)" in log0.read_text()
        service = treadle.ServiceClient(f"127.0.0.1:{port}")
        two = _losses(service)
        service.close()
        node0.terminate()
        assert node0.wait(TIMEOUT) == 0
        assert node1.wait(60) == 0, log1.read_text()  # its rank stops with the engine
    finally:
        for proc in (node0, node1):
            if proc.poll() is None:
                proc.kill()
    config = ServerConfig(data_dir=tmp_path / "one", models={"tiny": tiny_model_dir}, port=0)
    srv = EmbeddedServer(config).start()
    try:
        one = _losses(treadle.ServiceClient(srv.address, api_key=srv.api_key))
    finally:
        srv.stop()
    np.testing.assert_allclose(two, one, rtol=1e-5)


def test_a_rank_that_cannot_read_its_model_stops_the_start(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(tiny_model_dir, broken)
    (broken / "config.json").write_text("{ not json")
    endpoint = f"127.0.0.1:{free_port()}"
    node0, log0 = _node(tmp_path, tiny_model_dir, 0, endpoint)
    time.sleep(0.5)
    node1, _ = _node(tmp_path, broken, 1, endpoint)
    try:
        assert node0.wait(TIMEOUT) == 2
        text = log0.read_text()
        assert "the worker's group did not start: rank 1:" in text and "config" in text, text
        node1.wait(60)
    finally:
        for proc in (node0, node1):
            if proc.poll() is None:
                proc.kill()
