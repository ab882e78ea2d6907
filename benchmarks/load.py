"""Load and soak on loopback: N concurrent SDK clients x M mixed calls each, on
the embedded server and on the distributed one (PostgreSQL + Redis, two
``treadle worker`` processes).

Every process is a real one: the server (``treadle serve``) and the workers
run as subprocesses, the clients as threads of this process, each with its own
``ServiceClient`` and LoRA model of the tiny model. A client repeats the mixed
cycle ``forward_backward -> forward_logprobs -> optim_step -> sync_weights ->
sample`` until it has made M calls (or ``--max-seconds`` pass). Printed per
path: calls, errors (target 0) by kind, p50 / p99 latency per RPC, throughput.

``--soak SECONDS`` runs the same mixed loop for that long instead and samples
the resident memory and open file descriptors of every process (server,
workers, this client process) every ``--sample-every`` seconds (default 60);
it prints the samples and each process's slope after the first sample (the
warm-up), per minute. Target: flat within noise.

    python benchmarks/load.py                                  # 64 x 100, both paths
    python benchmarks/load.py --clients 16 --calls 25          # smaller
    python benchmarks/load.py --paths embedded --soak 600      # a 10-minute soak

Exit status 0 when no call failed.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from collections import Counter, defaultdict
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402

import treadle  # noqa: E402
from treadle.workers.model.tiny import build_tiny_model  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from _common import scratch, table  # noqa: E402
from _procs import stop_all, wait_for  # noqa: E402

REDIS = os.environ.get("TREADLE_BENCH_REDIS", "redis://127.0.0.1:6379/0")
PG_ADMIN = os.environ.get("TREADLE_BENCH_PG", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
CLI = (sys.executable, "-m", "treadle.server.cli")
METRICS_LINE = r"metrics on http://127\.0\.0\.1:(\d+)/metrics"
RPCS = ("forward_backward", "forward_logprobs", "optim_step", "sync_weights", "sample")


# ---- processes --------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Deployment:
    address: str
    api_key: str
    pids: dict[str, int]  # process name -> pid (the server, each worker)
    metrics: dict[str, int] = field(default_factory=dict)  # process name -> metrics port


@contextmanager
def _postgres() -> Iterator[str]:
    from sqlalchemy import create_engine, make_url, text

    admin = create_engine(PG_ADMIN, isolation_level="AUTOCOMMIT")
    name = f"treadle_load_{uuid.uuid4().hex[:10]}"
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    try:
        yield make_url(PG_ADMIN).set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


@contextmanager
def deploy(
    path: str, model: Path, tmp: Path, workers: int, json_logs: bool = False
) -> Iterator[Deployment]:
    """``treadle serve`` (and, distributed, its workers) as subprocesses; with
    ``json_logs`` each logs every call (``-v --log-format json``) in ``tmp/path``."""
    cli = (*CLI, "-v") if json_logs else CLI
    logs = ("--log-format", "json") if json_logs else ()
    run = tmp / path
    run.mkdir(parents=True)
    port = _free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("TREADLE_API_KEY", None)
    serve = [
        *cli,
        *("serve", *logs, "--model", f"tiny={model}", "--port", str(port), "--threads", "1"),
        *("--data-dir", str(run / "server"), "--store", str(run / "checkpoints")),
        *("--quota-max-models", "0", "--quota-calls-in-flight", "0"),
        *("--metrics-port", "0", "--http-port", "-1"),  # HTTP is not measured here
    ]
    procs: list[subprocess.Popen[bytes]] = []
    with ExitStack() as stack:
        database_url = ""
        if path == "distributed":
            database_url = stack.enter_context(_postgres())
            serve += ["--database-url", database_url, "--broker", REDIS]
        stack.callback(stop_all, procs)  # before the database is dropped (LIFO)
        log = run / "server.log"
        with open(log, "wb") as out:
            procs.append(subprocess.Popen(serve, stdout=out, stderr=subprocess.STDOUT, env=env))
        key_file = wait_for(log, r"API key is in (\S+) ", procs[0], 180)
        pids = {"server": procs[0].pid}
        metrics = {"server": int(wait_for(log, METRICS_LINE, procs[0], 30))}
        for i in range(workers if path == "distributed" else 0):
            worker_id = f"load-w{i + 1}-{os.getpid()}"
            wlog = run / f"{worker_id}.log"
            cmd = [
                *cli,
                *("worker", *logs, "--model", f"tiny={model}", "--broker", REDIS),
                *("--database-url", database_url, "--store", str(run / "checkpoints")),
                *("--data-dir", str(run / worker_id), "--worker-id", worker_id),
                *("--threads", "1", "--heartbeat", "1", "--drain-timeout", "0"),
                *("--metrics-port", "0"),
            ]
            with open(wlog, "wb") as out:
                proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
            procs.append(proc)
            wait_for(wlog, r"(ready)", proc, 180)
            pids[worker_id] = proc.pid
            metrics[worker_id] = int(wait_for(wlog, METRICS_LINE, proc, 30))
        yield Deployment(f"127.0.0.1:{port}", Path(key_file).read_text().strip(), pids, metrics)


# ---- the clients ------------------------------------------------------------------------


@dataclass
class Results:
    latencies: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    errors: Counter[str] = field(default_factory=Counter)
    examples: dict[str, str] = field(default_factory=dict)  # error kind -> its first message
    lock: threading.Lock = field(default_factory=threading.Lock)

    def record(self, rpc: str, seconds: float, error: BaseException | None) -> None:
        with self.lock:
            if error is None:
                self.latencies[rpc].append(seconds)
            else:
                kind = f"{rpc}: {type(error).__name__}"
                self.errors[kind] += 1
                self.examples.setdefault(kind, (str(error) or repr(error))[:300])


def _datum(rng: np.random.Generator) -> treadle.Datum:
    tokens = rng.integers(1, 60, size=12).tolist()
    return treadle.Datum(
        model_input=treadle.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )


def client_loop(
    dep: Deployment, index: int, calls: int, until: float, results: Results, stop: threading.Event
) -> None:
    """One researcher: its own client and model, the mixed cycle until ``calls``
    calls are made or time is up."""
    rng = np.random.default_rng(index)
    adam = treadle.AdamParams(learning_rate=1e-3)
    params = treadle.SamplingParams(max_tokens=4, temperature=1.0)
    try:
        client = treadle.ServiceClient(dep.address, api_key=dep.api_key)
        tc = client.create_lora_training_client("tiny", rank=2, seed=index)
    except Exception as err:
        results.record("create_model", 0.0, err)
        return
    sampler = None
    made = 0
    with client:
        while made < calls and time.monotonic() < until and not stop.is_set():
            for rpc in RPCS:
                if made >= calls:
                    break
                t0 = time.perf_counter()
                error: BaseException | None = None
                try:
                    if rpc == "forward_backward":
                        tc.forward_backward([_datum(rng)], "cross_entropy").result(timeout=600)
                    elif rpc == "forward_logprobs":
                        tc.forward_logprobs([_datum(rng)]).result(timeout=600)
                    elif rpc == "optim_step":
                        tc.optim_step(adam).result(timeout=600)
                    elif rpc == "sync_weights":
                        sampler = tc.sync_weights()
                        _ = sampler.sampler_id  # blocks until the sync has landed
                    elif sampler is not None:
                        prompt = rng.integers(1, 60, size=6).tolist()
                        sampler.sample(prompt, 2, params).result(timeout=600)
                except Exception as err:
                    error = err
                results.record(rpc, time.perf_counter() - t0, error)
                made += 1


def run_clients(
    dep: Deployment, clients: int, calls: int, seconds: float, stop: threading.Event
) -> tuple[Results, float]:
    results = Results()
    until = time.monotonic() + seconds
    threads = [
        threading.Thread(
            target=client_loop, args=(dep, i, calls, until, results, stop), daemon=True
        )
        for i in range(clients)
    ]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results, time.perf_counter() - t0


# ---- soak: memory and descriptors -------------------------------------------------------


def rss_and_fds(pid: int) -> tuple[float, int]:
    """Resident memory (MiB) and open file descriptors of a process (Linux /proc)."""
    rss_kb = 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss_kb = int(line.split()[1])
    return rss_kb / 1024, len(os.listdir(f"/proc/{pid}/fd"))


def slope_per_min(t_s: list[float], ys: list[float]) -> float:
    if len(t_s) < 2:
        return float("nan")
    return float(np.polyfit(np.asarray(t_s) / 60, np.asarray(ys), 1)[0])


def soak(dep: Deployment, clients: int, seconds: float, every: float) -> tuple[str, Results]:
    pids = {**dep.pids, "clients": os.getpid()}
    stop = threading.Event()
    samples: list[tuple[float, dict[str, tuple[float, int]]]] = []
    box: dict[str, Results] = {}

    def load() -> None:
        box["r"], _ = run_clients(dep, clients, 10**9, seconds, stop)

    runner = threading.Thread(target=load, daemon=True)
    t0 = time.monotonic()
    runner.start()
    while True:
        samples.append((time.monotonic() - t0, {n: rss_and_fds(p) for n, p in pids.items()}))
        if time.monotonic() - t0 >= seconds:
            break
        time.sleep(min(every, max(0.0, seconds - (time.monotonic() - t0))))
    stop.set()
    runner.join()
    rows = []
    for t, by in samples:
        rows.append((f"{t:.0f}", *(f"{by[n][0]:.0f} MiB / {by[n][1]}" for n in pids)))
    out = table(["t (s)", *(f"{n} (rss / fds)" for n in pids)], rows)
    warm = samples[1:]  # the first sample is the warm-up
    slopes = []
    for n in pids:
        ts = [t for t, _ in warm]
        slopes.append(
            (
                n,
                slope_per_min(ts, [by[n][0] for _, by in warm]),
                slope_per_min(ts, [float(by[n][1]) for _, by in warm]),
                f"{warm[0][1][n][0]:.0f} -> {warm[-1][1][n][0]:.0f}" if warm else "-",
            )
        )
    out += "\n\nslope after the first sample, per minute\n\n" + table(
        ["process", "RSS MiB/min", "fds/min", "RSS MiB (first -> last)"], slopes
    )
    return out, box["r"]


# ---- report -----------------------------------------------------------------------------


def report(results: Results, wall_s: float) -> str:
    rows = []
    total = 0
    for rpc in RPCS:
        ms = np.asarray(results.latencies.get(rpc, [])) * 1e3
        total += len(ms)
        if len(ms):
            rows.append((rpc, len(ms), float(np.percentile(ms, 50)), float(np.percentile(ms, 99))))
    errors = sum(results.errors.values())
    rows.append(("all", total, "-", "-"))
    out = table(["rpc", "calls ok", "p50 ms", "p99 ms"], rows)
    out += f"\n\nthroughput {total / wall_s:.1f} calls/s over {wall_s:.1f} s; errors {errors}"
    if results.errors:
        out += "\n" + "\n".join(
            f"  {k}: {v} (first: {results.examples.get(k, '')})"
            for k, v in results.errors.most_common()
        )
    return out


def scrape(port: int) -> dict[str, float]:
    """Each series of a process's metrics endpoint, summed over its labels."""
    from prometheus_client.parser import text_string_to_metric_families

    url = f"http://127.0.0.1:{port}/metrics"
    with urllib.request.urlopen(url, timeout=30) as r:
        text = r.read().decode()
    out: dict[str, float] = defaultdict(float)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if "le" not in sample.labels:
                out[sample.name] += float(sample.value)
    return out


def engine_report(dep: Deployment) -> str:
    """What the processes' own metrics say of the run: where the time went."""
    rows = []
    for name, port in dep.metrics.items():
        m = scrape(port)
        waits = m.get("treadle_queue_wait_seconds_count", 0.0)
        passes = m.get("treadle_training_passes_total", 0.0)
        rows.append(
            (
                name,
                int(m.get("treadle_rpc_calls_total", 0)),
                int(m.get("treadle_engine_models", 0)),
                int(m.get("treadle_tokens_trained_total", 0)),
                int(m.get("treadle_tokens_sampled_total", 0)),
                m.get("treadle_training_pass_calls_total", 0.0) / passes if passes else 0.0,
                1e3 * m.get("treadle_queue_wait_seconds_sum", 0.0) / waits if waits else 0.0,
                m.get("process_resident_memory_bytes", 0.0) / 2**20,
            )
        )
    headers = ["process", "rpcs", "models", "tok trained", "tok sampled", "calls/pass"]
    return table([*headers, "mean queue wait ms", "RSS MiB"], rows)


class SdkWarnings(logging.Handler):
    """Counts the SDK's warnings (heartbeat failures, retries) by their first words."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.counts: Counter[str] = Counter()
        self.examples: dict[str, str] = {}

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        kind = " ".join(text.split()[:3])
        self.counts[kind] += 1
        self.examples.setdefault(kind, text[:300])

    def report(self) -> str:
        if not self.counts:
            return "SDK warnings: none"
        lines = [f"  {k}: {n} (first: {self.examples[k]})" for k, n in self.counts.most_common()]
        return "SDK warnings:\n" + "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--calls", type=int, default=100, help="calls per client")
    parser.add_argument("--paths", default="embedded,distributed")
    parser.add_argument("--workers", type=int, default=2, help="workers of the distributed path")
    parser.add_argument("--max-seconds", type=float, default=900, help="per path, at most")
    parser.add_argument("--soak", type=float, default=0, help="seconds of a soak instead")
    parser.add_argument("--sample-every", type=float, default=60.0)
    parser.add_argument(
        "--json-logs",
        action="store_true",
        help="every process logs each call as JSON (with its request id) in the run's folder",
    )
    args = parser.parse_args()

    tmp = scratch("treadle-bench-load-")
    model = build_tiny_model(tmp / "tiny", preset="tiny", seed=0)
    load = os.getloadavg()
    print(f"{os.cpu_count()} CPUs, load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}")
    failed = 0
    for path in [p for p in args.paths.split(",") if p]:
        warnings = SdkWarnings()
        logging.getLogger("treadle").addHandler(warnings)
        with deploy(path, model, tmp, args.workers, args.json_logs) as dep:
            if args.json_logs:
                print(f"logs of the {path} path in {tmp / path}")
            if args.soak:
                print(f"\n## soak, {path}: {args.clients} clients, {args.soak:g} s\n", flush=True)
                text, results = soak(dep, args.clients, args.soak, args.sample_every)
                print(text)
                wall = args.soak
            else:
                print(
                    f"\n## load, {path}: {args.clients} clients x {args.calls} calls\n", flush=True
                )
                results, wall = run_clients(
                    dep, args.clients, args.calls, args.max_seconds, threading.Event()
                )
            print(report(results, wall), flush=True)
            print(warnings.report(), flush=True)
            logging.getLogger("treadle").removeHandler(warnings)
            print("\nfrom the processes' metrics endpoints\n\n" + engine_report(dep), flush=True)
            failed += sum(results.errors.values())
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
