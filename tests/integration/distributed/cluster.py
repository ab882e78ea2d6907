"""The distributed deployment the tests in this folder share: its handle
(`Cluster`), and the helpers to start workers, place models and read state."""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import re
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from sqlalchemy import create_engine, text

import treadle
from tests.helpers import next_token_datum
from treadle.server.config import ServerConfig
from treadle.server.embedded import EmbeddedServer

from ..services import AMQP_URL, REDIS_URL, S3_ENV, wait_for_workers

BASE = "tiny"
BUCKET = "treadle-dist"
BROKERS = {"redis": (REDIS_URL, 6379), "rabbitmq": (AMQP_URL, 5672)}
TENANTS = ("alice", "bob", "carol")
WORKER_TIMEOUT_S = 5.0


@dataclass
class Cluster:
    name: str
    server: EmbeddedServer
    database_url: str
    s3_endpoint: str
    store: str
    workers: dict[str, subprocess.Popen[bytes]]
    logs: dict[str, Path]
    model_dir: Path
    broker: str
    keys: dict[str, str] = field(default_factory=dict)
    clients: list[treadle.ServiceClient] = field(default_factory=list)

    def client(self, tenant: str, **kwargs: object) -> treadle.ServiceClient:
        client = treadle.ServiceClient(self.server.address, api_key=self.keys[tenant], **kwargs)  # type: ignore[arg-type]
        self.clients.append(client)
        return client

    def sql(self, query: str, **params: object) -> list[tuple[object, ...]]:
        engine = create_engine(self.database_url)
        try:
            with engine.connect() as conn:
                return [tuple(r) for r in conn.execute(text(query), params)]
        finally:
            engine.dispose()

    def worker_of(self, model_id: str) -> str:
        ((worker_id,),) = self.sql("SELECT worker_id FROM models WHERE id = :m", m=model_id)
        return str(worker_id)

    def log_tail(self) -> str:
        return "\n".join(
            f"--- {w} ---\n" + "\n".join(p.read_text(errors="replace").splitlines()[-15:])
            for w, p in self.logs.items()
        )


def create_tenant(database_url: str, name: str) -> str:
    """A tenant and its key, made by the admin CLI as an operator would."""
    from treadle.server.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        assert main(["admin", "--database-url", database_url, "create-tenant", name]) == 0
    return out.getvalue().strip().splitlines()[-1]


def server_config(
    tmp: Path, model: Path, database_url: str, broker: str, store: str, **more: Any
) -> ServerConfig:
    """An embedded server of a distributed deployment: PostgreSQL, a broker, a shared
    store, one engine thread, workers dead after 10 s without a heartbeat unless ``more``
    says otherwise."""
    settings: dict[str, Any] = {"threads": 1, "worker_timeout_s": 10.0, **more}
    return ServerConfig(
        data_dir=tmp / "server",
        models={BASE: model},
        port=0,
        database_url=database_url,
        broker=broker,
        store=store,
        **settings,
    )


def start_worker(
    worker_id: str,
    model: Path,
    broker: str,
    database_url: str,
    store: str,
    s3: str,
    tmp: Path,
    *,
    drain_timeout_s: float = 0.0,  # the fixture's workers stop at once at teardown
    flags: Sequence[str] = (),
    verbose: bool = False,
) -> tuple[subprocess.Popen[bytes], Path]:
    """A ``treadle worker`` process (one thread, heartbeat 0.5 s) logging to
    ``tmp/<worker_id>.log``; ``flags`` are added to its command line."""
    log = tmp / f"{worker_id}.log"
    cmd = [
        *(sys.executable, "-m", "treadle.server.cli", *(("-v",) if verbose else ()), "worker"),
        *("--model", f"{BASE}={model}", "--broker", broker, "--database-url", database_url),
        *("--store", store, "--s3-endpoint-url", s3, "--data-dir", str(tmp / worker_id)),
        *("--worker-id", worker_id, "--heartbeat", "0.5", "--threads", "1"),
        *("--drain-timeout", str(drain_timeout_s), *flags),
    ]
    env = dict(os.environ, **S3_ENV, OMP_NUM_THREADS="1")
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    return proc, log


def calls_served(log: Path, kind: str) -> int:
    """Calls of ``kind`` a ``start_worker(..., verbose=True)`` worker answered OK."""
    return log.read_text(errors="replace").count(f": {kind} answered OK")


def calls_received(log: Path, kind: str) -> int:
    """Calls of ``kind`` the same worker admitted (logged once started, before answered)."""
    return len(re.findall(rf"call \S+: {kind}$", log.read_text(errors="replace"), re.M))


def stop_worker(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM, then SIGKILL after 20 s."""
    if proc.poll() is None:
        proc.terminate()
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        proc.kill()


#: the datum the distributed tests train on
datum = next_token_datum


def saved_state(c: Cluster, model_id: str, name: str) -> dict[str, torch.Tensor]:
    from treadle.common.s3_store import S3Store

    store = S3Store(c.store, endpoint_url=c.s3_endpoint)
    ((tenant_id,),) = c.sql("SELECT tenant_id FROM models WHERE id = :m", m=model_id)
    local = store.fetch(store.state_path(str(tenant_id), model_id, name))
    try:
        weights = load_file(str(local / "weights.safetensors"))
        optim = load_file(str(local / "optimizer.safetensors"))
        return {
            **{f"w.{k}": v for k, v in weights.items()},
            **{f"o.{k}": v for k, v in optim.items()},
        }
    finally:
        store.release(local, "")


def weights_hash(tc: treadle.TrainingClient, directory: Path) -> str:
    """sha256 of the model's adapter tensors (exported through the store), by name."""
    exported = tc.export_weights(directory)
    tensors = load_file(str(exported / "adapter_model.safetensors"))
    digest = hashlib.sha256()
    for name in sorted(tensors):
        digest.update(name.encode())
        digest.update(tensors[name].contiguous().numpy().tobytes())
    return digest.hexdigest()


def one_more_worker(
    c: Cluster, name: str, tmp: Path, *, drain_timeout_s: float, s3_endpoint: str = ""
) -> str:
    """Start another worker in the cluster, live when this returns; its id.
    ``s3_endpoint``: the S3 it talks to, when not the cluster's (a proxy)."""
    worker_id = f"{c.name}-{name}-{os.getpid()}"
    c.workers[worker_id], c.logs[worker_id] = start_worker(
        worker_id, c.model_dir, c.broker, c.database_url, c.store, s3_endpoint or c.s3_endpoint,
        tmp, drain_timeout_s=drain_timeout_s,
    )  # fmt: skip
    wait_for_workers(c.database_url, [worker_id], timeout_s=120)
    return worker_id


def placed_on(
    c: Cluster, service: treadle.ServiceClient, worker_id: str, seed: int
) -> treadle.TrainingClient:
    """A new model on ``worker_id`` (a worker just started is the least loaded)."""
    for _ in range(10):
        tc = service.create_lora_training_client(BASE, rank=4, seed=seed)
        if c.worker_of(tc.model_id) == worker_id:
            return tc
    raise AssertionError(f"no model was placed on {worker_id}")


def wait_status(c: Cluster, worker_id: str, status: str, timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while c.sql("SELECT status FROM workers WHERE id = :w", w=worker_id) != [(status,)]:
        assert time.monotonic() < deadline, f"{worker_id} never {status}\n{c.log_tail()}"
        time.sleep(0.1)
