"""Round trip of the smallest ordered call, through the full path: a 1-token
``forward_logprobs`` on a LoRA model, sent by the SDK over gRPC to the server
(auth, the ops-log DB record, usage), ordered by ``seq_id`` in the engine, and back.

Paths, in one run:

- embedded: the engine in the server process (SQLite, as ``treadle serve``).
- celery+redis: the same server with ``--broker redis://``, one ``treadle worker``
  process; the call travels server -> Redis -> worker -> Redis -> server.
- celery+rabbitmq (``--amqp``): the same through RabbitMQ.

The Celery paths use the same database kind as the embedded one unless
``--database-url`` names one (e.g. PostgreSQL); the worker shares it. Targets:
p50 <= 2 ms embedded, <= 10 ms through Celery.

    python benchmarks/dispatch_latency.py             # ~1 min on 2 CPU cores
    python benchmarks/dispatch_latency.py --calls 1000 --amqp

Exit status 0 when every target is met.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402

import treadle  # noqa: E402
from treadle.server.config import ServerConfig  # noqa: E402
from treadle.server.embedded import EmbeddedServer  # noqa: E402
from treadle.workers.model.tiny import build_tiny_model  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from _common import table  # noqa: E402

REDIS = os.environ.get("TREADLE_BENCH_REDIS", "redis://127.0.0.1:6379/0")
AMQP = os.environ.get("TREADLE_BENCH_AMQP", "amqp://guest:guest@127.0.0.1:5672//")
TARGET_MS = {"embedded": 2.0, "celery": 10.0}


def measure(srv: EmbeddedServer, calls: int, warmup: int) -> np.ndarray:
    client = treadle.ServiceClient(srv.address, api_key=srv.api_key)
    try:
        tc = client.create_lora_training_client("tiny", rank=4)
        one = treadle.Datum(
            model_input=treadle.ModelInput.from_ints([5]),
            loss_fn_inputs={"target_tokens": [6]},
        )
        for _ in range(warmup):
            tc.forward_logprobs([one]).result()
        out = np.empty(calls)
        for i in range(calls):
            t0 = time.perf_counter()
            tc.forward_logprobs([one]).result()
            out[i] = time.perf_counter() - t0
        return out * 1e3
    finally:
        client.close()


@contextmanager
def worker(model: Path, broker: str, database_url: str, tmp: Path) -> Iterator[None]:
    worker_id = f"bench-{os.getpid()}-{broker.split(':')[0]}"
    proc = subprocess.Popen(
        [
            *(sys.executable, "-m", "treadle.server.cli", "worker"),
            *("--model", f"tiny={model}", "--broker", broker, "--database-url", database_url),
            *("--store", str(tmp / "checkpoints"), "--data-dir", str(tmp / worker_id)),
            *("--worker-id", worker_id, "--threads", "1", "--heartbeat", "1"),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    try:
        from sqlalchemy import create_engine, text

        engine = create_engine(database_url)
        deadline = time.monotonic() + 120
        while True:
            with engine.connect() as conn:
                row = conn.execute(
                    text("SELECT status FROM workers WHERE id = :id"), {"id": worker_id}
                ).first()
            if row is not None and row[0] == "live":
                break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"worker did not start (exit status {proc.poll()})")
            time.sleep(0.2)
        engine.dispose()
        yield
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=500)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--amqp", action="store_true", help="also measure through RabbitMQ")
    parser.add_argument("--database-url", default="", help="default: a SQLite file")
    args = parser.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="treadle-bench-latency-"))
    model = build_tiny_model(tmp / "tiny", preset="tiny", seed=0)
    rows = []
    paths = [("embedded", "", "embedded"), ("celery+redis", REDIS, "celery")]
    if args.amqp:
        paths.append(("celery+rabbitmq", AMQP, "celery"))
    ok = True
    for name, broker, target_key in paths:
        run_dir = tmp / name  # a database of its own: no models of an earlier path
        database_url = args.database_url or f"sqlite:///{run_dir / 'treadle.db'}"
        config = ServerConfig(
            data_dir=run_dir,
            models={"tiny": model},
            port=0,
            threads=1,
            database_url=database_url,
            store=str(run_dir / "checkpoints"),
            broker=broker,
        )
        with EmbeddedServer(config) as srv:
            if broker:
                with worker(model, broker, database_url, run_dir):
                    ms = measure(srv, args.calls, args.warmup)
            else:
                ms = measure(srv, args.calls, args.warmup)
        p50, p99 = float(np.percentile(ms, 50)), float(np.percentile(ms, 99))
        target = TARGET_MS[target_key]
        ok &= p50 <= target
        rows.append((name, args.calls, p50, p99, float(ms.mean()), f"<= {target:g}", p50 <= target))
    kind = (args.database_url or "sqlite").split(":")[0].split("+")[0]
    print(f"\n1-token forward_logprobs round trip, ms ({os.cpu_count()} CPUs, {kind})\n")
    print(table(["path", "calls", "p50", "p99", "mean", "target p50", "met"], rows))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
