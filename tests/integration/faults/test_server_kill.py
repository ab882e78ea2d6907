"""The server killed (SIGKILL) in the middle of training and started again, for
real: ``treadle serve`` as a process of its own over PostgreSQL and Redis, one
``treadle worker``. The kill comes while a long ``forward_backward`` is on the
worker; the worker lives on and holds the model. The SDK keeps retrying the
call with its seq_id (UNAVAILABLE while no server answers); the restarted server
adopts the model where the worker has it, and the retry gets the recorded
result (or, if the call never reached the worker, applies it): once either way.
A twin model given the same calls without a kill ends with the same logprobs,
so nothing was applied twice and nothing was lost."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from sqlalchemy import create_engine, text

import treadle
from tests.integration.distributed.cluster import datum
from tests.integration.services import (
    REDIS_URL,
    free_port,
    fresh_postgres,
    port_open,
    wait_for_workers,
)

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(420)]

CLI = (sys.executable, "-m", "treadle.server.cli")


def _wait_line(log: Path, pattern: str, proc: subprocess.Popen[bytes], timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = re.search(pattern, log.read_text(errors="replace")) if log.exists() else None
        if found:
            return found.group(1)
        assert proc.poll() is None, log.read_text(errors="replace")[-3000:]
        time.sleep(0.2)
    raise AssertionError(f"no {pattern!r} in {log}:\n{log.read_text(errors='replace')[-3000:]}")


class Server:
    """``treadle serve`` on a fixed port, killed and started again by the test."""

    def __init__(self, tmp: Path, model: Path, database_url: str) -> None:
        self.tmp, self.port, self.runs = tmp, free_port(), 0
        self.cmd = [
            *(*CLI, "serve", "--model", f"tiny={model}", "--port", str(self.port)),
            *("--http-port", "-1"),  # not used here
            *("--threads", "1", "--data-dir", str(tmp / "server"), "--store", str(tmp / "store")),
            *("--database-url", database_url, "--broker", REDIS_URL, "--worker-timeout", "30"),
        ]
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> str:
        """Start it; once serving, the default tenant's key file (the first start
        writes it; a restart says keys are required and returns "")."""
        self.runs += 1
        log = self.tmp / f"server-{self.runs}.log"
        env = dict(os.environ, OMP_NUM_THREADS="1")
        env.pop("TREADLE_API_KEY", None)
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(self.cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        said = r"treadle: (the default tenant's API key is in \S+ |API keys are required)"
        key_file = _wait_line(log, said, self.proc, 240).removesuffix(" ")
        key_file = key_file.split(" is in ")[1] if " is in " in key_file else ""
        deadline = time.monotonic() + 60
        while not port_open("127.0.0.1", self.port):
            assert time.monotonic() < deadline and self.proc.poll() is None
            time.sleep(0.1)
        return key_file

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


@pytest.fixture
def deployment(tmp_path: Path, tiny_model_dir: Path) -> Iterator[tuple[Server, str, str]]:
    if not port_open("127.0.0.1", 6379):
        pytest.skip("Redis is not running on 127.0.0.1:6379")
    with fresh_postgres("treadle_kill") as database_url:
        server = Server(tmp_path, tiny_model_dir, database_url)
        worker: subprocess.Popen[bytes] | None = None
        try:
            key = Path(server.start()).read_text().strip()
            worker_id = f"kill-w1-{os.getpid()}"
            cmd = [
                *(*CLI, "worker", "--model", f"tiny={tiny_model_dir}", "--broker", REDIS_URL),
                *("--database-url", database_url, "--store", str(tmp_path / "store")),
                *("--data-dir", str(tmp_path / worker_id), "--worker-id", worker_id),
                *("--threads", "1", "--heartbeat", "1", "--drain-timeout", "0"),
            ]
            with open(tmp_path / "worker.log", "wb") as out:
                env = dict(os.environ, OMP_NUM_THREADS="1")
                worker = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
            wait_for_workers(database_url, [worker_id], timeout_s=180)
            yield server, key, database_url
        finally:
            if worker is not None and worker.poll() is None:
                worker.terminate()
                try:
                    worker.wait(30)
                except subprocess.TimeoutExpired:
                    worker.kill()
            server.stop()


def test_server_killed_mid_training_applies_the_call_once(
    deployment: tuple[Server, str, str],
) -> None:
    server, key, database_url = deployment
    address = f"127.0.0.1:{server.port}"
    small = [datum([5, 9, 13, 17, 21, 25, 29]), datum([7, 11, 15, 19, 23])]
    rng = np.random.default_rng(0)  # rows of their own: a prefix they shared would be computed once
    big = [datum(list(rng.integers(3, 60, 121))) for _ in range(512)]
    adam = treadle.AdamParams(learning_rate=1e-2)

    # retries that outlast a restart (the server takes tens of seconds to start here)
    client = treadle.ServiceClient(address, api_key=key, max_retries=30)
    try:
        tc = client.create_lora_training_client("tiny", rank=2, seed=7)
        tc.forward_backward(small, "cross_entropy").result()
        assert tc.optim_step(adam).result().step == 1
        fb = tc.forward_backward(big, "cross_entropy")
        step = tc.optim_step(adam)
        time.sleep(1.0)  # the worker has the long call
        server.stop(signal.SIGKILL)
        t0 = time.monotonic()
        server.start()  # same port, same database: the model is adopted
        print(f"\nserver down for {time.monotonic() - t0:.1f} s (its start-up)")
        assert np.isfinite(fb.result(timeout=300).metrics["loss:sum"])
        assert step.result(timeout=300).step == 2
        after = tc.forward_logprobs(small).result(timeout=120).loss_fn_outputs
        assert tc.get_info().version == 2

        # a twin given the same calls, no kill: the same weights
        twin = client.create_lora_training_client("tiny", rank=2, seed=7)
        twin.forward_backward(small, "cross_entropy").result()
        twin.optim_step(adam).result()
        twin.forward_backward(big, "cross_entropy").result(timeout=300)
        assert twin.optim_step(adam).result(timeout=300).step == 2
        expected = twin.forward_logprobs(small).result(timeout=120).loss_fn_outputs
        for x, y in zip(after, expected, strict=True):
            np.testing.assert_array_equal(x.logprobs, y.logprobs)
    finally:
        client.close()

    engine = create_engine(database_url)
    try:
        with engine.connect() as conn:
            ops = conn.execute(
                text("SELECT seq_id, kind, status FROM ops WHERE model_id = :m ORDER BY seq_id"),
                {"m": tc.model_id},
            ).all()
    finally:
        engine.dispose()
    assert [tuple(r) for r in ops] == [
        (1, "forward_backward", "done"),
        (2, "optim_step", "done"),
        (3, "forward_backward", "done"),
        (4, "optim_step", "done"),
        (5, "forward_logprobs", "done"),
    ], ops
