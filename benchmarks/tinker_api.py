"""The same RL step through the official tinker SDK over HTTP and through
treadle's SDK over gRPC, one server, one run; and how long a finished result
takes to reach the tinker SDK.

The server is ``treadle serve`` in its own process (ports picked by the OS,
found in its log), both SDKs' clients in this one, as a user's would be;
``--embedded`` runs it in this process instead (then the server's event loop and
engine threads share this process's GIL with both SDKs).

One RL step, both ways, on the same kind of model (the "5m" preset, LoRA rank 8,
a fresh model per path): publish the weights and get a sampler of them, sample
G=4 completions of 8 tokens, importance_sampling forward_backward on them
(advantage = reward - mean, reward = completion length), optim_step. Rounds
alternate the two paths (a block of steps each, the order flipping every round)
so a slow spell of a shared machine hits both; medians of per-step times.

Delay: a retrieve_future answer with a result carries the server's
``time.monotonic()`` when that result was ready (``x-treadle-ready-monotonic``);
the SDK's result poll is stamped with this process's ``time.monotonic()`` when
its answer arrives. CLOCK_MONOTONIC is one clock for every process of a Linux
host, so the two compare across processes. p50 target <= 5 ms: retrieve_future
is answered the moment the result exists, with no poll interval.

Where the gap goes, each from the same run:

* HTTP's own cost: each tinker-path request's httpx call is timed in the SDK,
  and the server's app time comes back in ``Server-Timing: app;dur=<ms>``; the
  SDK's wait minus the app's is what the HTTP path adds per request (requests
  overlap, so its sum per step overstates what it costs a step).
* The protocol: every request of a step is recorded as a span, and the most of
  them that ran one after another is the step's round trips in sequence (the
  tinker SDK: 7 of its 8, a submission then a ``retrieve_future`` per call, the
  sampler of ``save_weights_and_get_sampling_client`` known only from the sync's
  result; treadle's SDK: 3 of its 4). With an empty call each way (``healthz``
  through the tinker SDK's own client, gRPC's health Check through treadle SDK's
  caller, and ``healthz`` through a bare httpx client), the estimate
  ``grpc / (grpc + 7 * empty_http - 3 * empty_grpc)``.
* The clients' CPU: this process's CPU time (every thread) over each path's
  blocks of steps, per step, and the server's over the same blocks. The engine
  keeps most of this machine's 2 cores busy through a step (its two torch
  threads: 1.7-1.8 cores), so CPU a client spends is not hidden behind the
  engine: it lengthens the step, on the chain of round trips or by taking a
  core from the engine.
  ``grpc / (grpc + tinker_cpu - treadle_cpu)`` is the ratio if the tinker SDK's
  extra CPU per step were the whole difference. The SDK is run unmodified, so
  its CPU is not treadle's to cut: where the measured ratio is close to this
  figure and the figure is under 0.9, the target cannot be met on this machine.

Measured on a 2-core machine, the server in its own process (2026-12-03):
the server's answers are not the gap. Each path alone in a client process (30
steps each, one after the other): the server's event-loop thread spent 12.0 ms
a step over HTTP and 11.0 ms over gRPC, the tinker SDK's client 15.9 ms of CPU
a step against treadle SDK's 4.4 ms, and the HTTP step took 79.9 ms against
gRPC's 68.6 ms: the difference (11.3 ms) is the clients' (11.5 ms). A py-spy
profile of the tinker SDK's client (12 s of steps) spreads its time over httpx,
httpcore, h11, anyio, pydantic and its event-loop thread's hand-offs. This
benchmark, the same day: 0.831 measured, 0.836 from the clients' CPU (tinker SDK
21.3 ms, treadle SDK 4.9 ms a step), the server 1.84 cores busy through a gRPC
step. The server's client config turns the SDK's pyqwest transport off: on this
loopback httpx's own transport took 1.67 ms of transport per request against
3.67 ms, the HTTP step 79 ms against 83-86 ms (alone in a client process, two
runs each way).

    python benchmarks/tinker_api.py               # ~5 min on 2 loaded CPU cores
    python benchmarks/tinker_api.py --rounds 6 --steps 4
    python benchmarks/tinker_api.py --embedded    # the server in this process

Targets: tinker/HTTP steps/s >= 0.9 x treadle/gRPC steps/s; delay p50 <= 5 ms.
Exit status 0 when both are met.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("TINKER_TELEMETRY", "0")

import httpx  # noqa: E402
import numpy as np  # noqa: E402
import tinker  # noqa: E402
from _common import THREADS, model_dir, scratch, table  # noqa: E402
from _procs import stop_all, wait_for  # noqa: E402
from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402
from tinker import types as T  # noqa: E402
from tinker.lib import api_future_impl  # noqa: E402
from tinker.lib.client_connection_pool_type import ClientConnectionPoolType  # noqa: E402

import treadle  # noqa: E402
from treadle._rpc import Caller  # noqa: E402
from treadle.server.config import ServerConfig  # noqa: E402
from treadle.server.embedded import EmbeddedServer  # noqa: E402
from treadle.server.http.futures import READY_HEADER  # noqa: E402

RATIO_TARGET = 0.9
DELAY_TARGET_MS = 5.0
G, MAX_TOKENS, LR = 4, 8, 1e-3
PROMPT = [1, 5, 9, 13, 17, 21, 25, 29]

#: request_id -> when the SDK had its answer, and when the server had it ready
#: (both time.monotonic(): CLOCK_MONOTONIC is one clock for every process of a host)
RECEIVED: dict[str, float] = {}
READY: dict[str, float] = {}
#: per HTTP request of the tinker path: bench id -> seconds the SDK's httpx call took,
#: and the seconds the server's app spent on it (its Server-Timing header); the rest
#: is transport + SDK (+ GIL turns when the server shares this process)
CLIENT_S: dict[str, float] = {}
SERVER_S: dict[str, float] = {}
#: the same as SERVER_S for the requests that are not retrieve_future (their app
#: time is the route's own work, not a wait for the engine)
SUBMIT_S: dict[str, float] = {}
#: (start, end) perf_counter seconds of every request of the step being timed: the
#: tinker SDK's HTTP requests, treadle SDK's gRPC calls (``timed`` empties it)
SPANS: list[tuple[float, float]] = []
_send = httpx.AsyncClient.send


def _median_ms(seconds: Iterable[float]) -> float:
    values = list(seconds)
    return statistics.median(values) * 1e3 if values else float("nan")


def _app_ms(header: str) -> float | None:
    for part in header.split(","):
        name, _, params = part.strip().partition(";")
        if name == "app":
            for p in params.split(";"):
                key, _, value = p.strip().partition("=")
                if key == "dur":
                    return float(value)
    return None


async def _timed_send(self, request, **kw):  # type: ignore[no-untyped-def]
    if request.url.path.endswith("/healthz"):  # empty_calls' own, not the workload's
        return await _send(self, request, **kw)
    rid = uuid.uuid4().hex
    t0 = time.perf_counter()
    response = await _send(self, request, **kw)
    t1 = time.perf_counter()
    CLIENT_S[rid] = t1 - t0
    SPANS.append((t0, t1))
    app_ms = _app_ms(response.headers.get("server-timing", ""))
    if app_ms is not None:
        SERVER_S[rid] = app_ms / 1e3
        if not request.url.path.endswith("/retrieve_future"):
            SUBMIT_S[rid] = app_ms / 1e3
    ready = response.headers.get(READY_HEADER)
    if ready is not None and request.url.path.endswith("/retrieve_future"):
        READY[json.loads(request.content)["request_id"]] = float(ready)
    return response


httpx.AsyncClient.send = _timed_send  # type: ignore[method-assign]
_fetch = api_future_impl._APIFuture._fetch_via_rest


async def _stamped_fetch(self, state, iteration):  # type: ignore[no-untyped-def]
    out = await _fetch(self, state, iteration)
    if isinstance(out, api_future_impl._SuccessProto | api_future_impl._SuccessJson):
        RECEIVED[self.request_id] = time.monotonic()
    return out


api_future_impl._APIFuture._fetch_via_rest = _stamped_fetch  # type: ignore[method-assign]
_attempt = Caller._attempt


def _spanned_attempt(self, call, *, attempt, waited):  # type: ignore[no-untyped-def]
    t0 = time.perf_counter()
    if attempt == 0 and not call.out.done():
        call.out.add_done_callback(lambda _: SPANS.append((t0, time.perf_counter())))
    return _attempt(self, call, attempt=attempt, waited=waited)


Caller._attempt = _spanned_attempt  # type: ignore[method-assign]


def serial(spans: list[tuple[float, float]]) -> int:
    """The most requests of a step that ran one after another, none overlapping
    the next (earliest-ending first): the step's round trips in sequence."""
    n, free = 0, float("-inf")
    for t0, t1 in sorted(spans, key=lambda s: s[1]):
        if t0 >= free:
            n, free = n + 1, t1
    return n


def empty_calls(
    sc: tinker.ServiceClient, service: treadle.ServiceClient, n: int, base_url: str
) -> tuple[float, float, float]:
    """Median ms of an empty call from this thread, alternating: ``healthz``
    through the tinker SDK's own client (its event loop thread, its connection
    pool and transport), gRPC's health Check through treadle SDK's caller and
    channel, and the same ``healthz`` through a bare synchronous httpx client
    (keep-alive): what one round trip costs with no treadle code in it, and how
    much of the tinker SDK's is its client's own."""
    holder = sc.holder
    bare = httpx.Client(base_url=base_url)

    async def healthz() -> object:
        with holder.aclient(ClientConnectionPoolType.TRAIN) as client:
            return await client.service.health_check()

    check = health_pb2_grpc.HealthStub(service._channel).Check
    request = health_pb2.HealthCheckRequest()
    ms: dict[str, list[float]] = {"http": [], "grpc": [], "bare": []}
    for i in range(n + 10):
        for name in ("http", "grpc", "bare") if i % 2 == 0 else ("bare", "grpc", "http"):
            t0 = time.perf_counter()
            if name == "http":
                holder.run_coroutine_threadsafe(healthz()).result()
            elif name == "grpc":
                service._caller.call(check, request, lambda r: r).result()
            else:
                bare.get("/api/v1/healthz").raise_for_status()
            if i >= 10:  # the first ones warm up
                ms[name].append((time.perf_counter() - t0) * 1e3)
    bare.close()
    return tuple(statistics.median(ms[k]) for k in ("http", "grpc", "bare"))  # type: ignore[return-value]


@contextlib.contextmanager
def served(
    directory: Path, tmp: Path, embedded: bool
) -> Iterator[tuple[str, str, str, Callable[[], float] | None]]:
    """(gRPC address, HTTP base url, API key, the server process's CPU seconds so
    far) of a server on ``directory``: in this process (``embedded``; no CPU of
    its own) or ``treadle serve`` as a subprocess."""
    if embedded:
        config = ServerConfig(
            data_dir=tmp / "data",
            models={"bench": directory},
            port=0,
            http_port=0,
            threads=THREADS,
            quota_max_models=0,
            quota_calls_in_flight=0,
        )
        srv = EmbeddedServer(config).start()
        assert srv.api_key
        try:
            yield srv.address, srv.http_url, srv.api_key, None
        finally:
            srv.stop()
        return
    env = dict(os.environ, OMP_NUM_THREADS=str(THREADS))
    env.pop("TREADLE_API_KEY", None)
    cmd = [
        *(sys.executable, "-m", "treadle.server.cli", "serve"),
        *("--model", f"bench={directory}", "--port", "0", "--http-port", "0"),
        *("--threads", str(THREADS), "--data-dir", str(tmp / "data")),
        *("--quota-max-models", "0", "--quota-calls-in-flight", "0"),
    ]
    log = tmp / "server.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        key_file = wait_for(log, r"API key is in (\S+) ", proc, 180)
        port = wait_for(log, r"serving .* on \S+:(\d+)", proc, 5)
        http = wait_for(log, r"HTTP API on (\S+) ", proc, 5)
        yield (
            f"127.0.0.1:{port}",
            http,
            Path(key_file).read_text().strip(),
            functools.partial(_cpu_s, proc.pid),
        )
    finally:
        stop_all([proc])


def _cpu_s(pid: int) -> float:
    """A process's CPU seconds so far (user + system, every thread)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _advantages(lengths: list[int]) -> np.ndarray:
    r = np.asarray(lengths, dtype=np.float32)
    return r - r.mean()


def tinker_stepper(sc: tinker.ServiceClient) -> Callable[[], None]:
    tc = sc.create_lora_training_client(base_model="bench", rank=8, seed=0).result()
    params = T.SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0)

    def step() -> None:
        sampler = tc.save_weights_and_get_sampling_client().result()
        seqs = sampler.sample(T.ModelInput.from_ints(PROMPT), G, params).result().sequences
        adv = _advantages([len(s.tokens) for s in seqs])
        data = []
        for s, a in zip(seqs, adv, strict=True):
            tokens = PROMPT + list(s.tokens)
            n = len(PROMPT) - 1
            data.append(
                T.Datum(
                    model_input=T.ModelInput.from_ints(tokens[:-1]),
                    loss_fn_inputs={
                        "target_tokens": T.TensorData.from_numpy(np.asarray(tokens[1:], np.int64)),
                        "logprobs": T.TensorData.from_numpy(
                            np.concatenate([np.zeros(n), s.logprobs]).astype(np.float32)
                        ),
                        "advantages": T.TensorData.from_numpy(
                            np.concatenate([np.zeros(n), np.full(len(s.tokens), a)]).astype(
                                np.float32
                            )
                        ),
                    },
                )
            )
        fb = tc.forward_backward(data, "importance_sampling")
        tc.optim_step(T.AdamParams(learning_rate=LR)).result()
        fb.result()

    return step


def treadle_stepper(service: treadle.ServiceClient) -> Callable[[], None]:
    trainer = service.create_lora_training_client("bench", rank=8, seed=0)
    params = treadle.SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0)

    def step() -> None:
        sampler = trainer.sync_weights()
        seqs = sampler.sample(PROMPT, G, params).result().sequences
        adv = _advantages([len(s.tokens) for s in seqs])
        data = []
        for s, a in zip(seqs, adv, strict=True):
            tokens = PROMPT + list(s.tokens)
            n = len(PROMPT) - 1
            data.append(
                treadle.Datum(
                    model_input=treadle.ModelInput.from_ints(tokens[:-1]),
                    loss_fn_inputs={
                        "target_tokens": tokens[1:],
                        "logprobs": np.concatenate([np.zeros(n), s.logprobs]).astype(np.float32),
                        "advantages": np.concatenate(
                            [np.zeros(n), np.full(len(s.tokens), a)]
                        ).astype(np.float32),
                    },
                )
            )
        fb = trainer.forward_backward(data, "importance_sampling")
        trainer.optim_step(treadle.AdamParams(learning_rate=LR)).result()
        fb.result()

    return step


def timed(
    step: Callable[[], None], n: int, chains: list[tuple[int, int]] | None = None
) -> list[float]:
    """Seconds of each of ``n`` steps; with ``chains``, each step's (requests,
    requests in sequence) appended."""
    out = []
    for _ in range(n):
        SPANS.clear()
        t0 = time.perf_counter()
        step()
        out.append(time.perf_counter() - t0)
        if chains is not None:
            time.sleep(0.002)  # a callback's span lands after the future it settles
            chains.append((len(SPANS), serial(SPANS)))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=2, help="steps per path per round")
    parser.add_argument("--model-dir", default=None)
    parser.add_argument(
        "--empty-calls", type=int, default=200, help="empty calls each way, for the floor"
    )
    parser.add_argument(
        "--embedded",
        action="store_true",
        help="the server in this process (sharing its GIL with both SDKs), not a subprocess",
    )
    args = parser.parse_args()

    directory = model_dir("5m", args.model_dir)
    tmp = scratch("treadle-bench-tinker-")
    with served(directory, tmp, args.embedded) as (address, http_url, key, server_cpu):
        sc = tinker.ServiceClient(base_url=http_url, api_key="tml-" + key)
        service = treadle.ServiceClient(address, api_key=key)
        try:
            paths = {
                "tinker SDK / HTTP": tinker_stepper(sc),
                "treadle SDK / gRPC": treadle_stepper(service),
            }
            for step in paths.values():  # warm-up
                step()
            for stamps in (RECEIVED, READY, CLIENT_S, SERVER_S, SUBMIT_S):
                stamps.clear()
            times: dict[str, list[float]] = {name: [] for name in paths}
            # CPU seconds over each path's blocks: this process (the clients), the server
            cpu: dict[str, list[float]] = {name: [0.0, 0.0] for name in paths}
            chains: dict[str, list[tuple[int, int]]] = {name: [] for name in paths}
            order = list(paths)
            for r in range(args.rounds):
                for name in order if r % 2 == 0 else order[::-1]:
                    c0, s0 = time.process_time(), server_cpu() if server_cpu else 0.0
                    times[name] += timed(paths[name], args.steps, chains[name])
                    cpu[name][0] += time.process_time() - c0
                    cpu[name][1] += (server_cpu() - s0) if server_cpu else float("nan")
            empty_http, empty_grpc, empty_bare = empty_calls(
                sc, service, args.empty_calls, http_url
            )
        finally:
            sc.close("success").result()
            service.close()
    delays_ms = [(got - READY[rid]) * 1e3 for rid, got in RECEIVED.items() if rid in READY]
    med = {name: statistics.median(t) for name, t in times.items()}
    http, grpc_ = med["tinker SDK / HTTP"], med["treadle SDK / gRPC"]
    ratio = grpc_ / http  # HTTP steps/s over gRPC steps/s
    rows = [
        [name, f"{med[name] * 1e3:.1f}", f"{1 / med[name]:.2f}", len(times[name])] for name in paths
    ]
    print(
        f"\nRL step (G={G}, {MAX_TOKENS} tokens, 5m preset, LoRA r8), threads={THREADS}, server {'embedded' if args.embedded else 'in its own process'}, load {os.getloadavg()[0]:.2f}\n"
    )
    print(table(["path", "median step ms", "steps/s", "steps"], rows))
    # The HTTP path's own cost: per request, the SDK's wait minus the server app's
    # time (serialising, the socket, httpx, the SDK's event loop, their GIL turns).
    n_http = len(times["tinker SDK / HTTP"])
    over = [CLIENT_S[r] - SERVER_S[r] for r in CLIENT_S if r in SERVER_S]
    over_step = sum(over) / n_http if n_http else float("nan")
    bound = grpc_ / (grpc_ + over_step)  # the ratio if HTTP cost only this over gRPC
    p50 = statistics.median(delays_ms) if delays_ms else float("nan")
    p90 = float(np.percentile(delays_ms, 90)) if delays_ms else float("nan")
    print(
        f"\nHTTP/gRPC steps/s: {ratio:.3f} (target >= {RATIO_TARGET})\n"
        f"result ready -> tinker SDK has it: p50 {p50:.2f} ms, p90 {p90:.2f} ms over "
        f"{len(delays_ms)} results (target p50 <= {DELAY_TARGET_MS} ms)\n"
        f"HTTP transport + tinker SDK per step: {over_step * 1e3:.1f} ms over "
        f"{len(over) / max(n_http, 1):.1f} requests/step (median "
        f"{statistics.median(over) * 1e3 if over else float('nan'):.2f} ms each); "
        f"the ratio if that were the only difference: {bound:.3f}\n"
        f"server app time per request (Server-Timing, held retrieve_future included): "
        f"median {_median_ms(SERVER_S.values()):.2f} ms; submissions (not retrieve_future) "
        f"median {_median_ms(SUBMIT_S.values()):.2f} ms over {len(SUBMIT_S)}"
    )
    # The protocol's estimate: each path's round trips in sequence per step, at the
    # cost of an empty call measured in this run. The tinker SDK answers a call
    # that does work with a request id and fetches its result with a second
    # request (retrieve_future), and learns the sampler of
    # save_weights_and_get_sampling_client only from that result.
    seq = {n: statistics.median(s for _, s in c) for n, c in chains.items()}
    req = {n: statistics.mean(r for r, _ in c) for n, c in chains.items()}
    s_http, s_grpc = seq["tinker SDK / HTTP"], seq["treadle SDK / gRPC"]
    extra_ms = s_http * empty_http - s_grpc * empty_grpc
    protocol_bound = grpc_ / (grpc_ + extra_ms / 1e3)
    print(
        f"requests a step (mean) / in sequence (median): HTTP {req['tinker SDK / HTTP']:.1f} / "
        f"{s_http:.0f}, gRPC {req['treadle SDK / gRPC']:.1f} / {s_grpc:.0f}\n"
        f"empty call, median of {args.empty_calls}: tinker SDK healthz {empty_http:.2f} ms, "
        f"gRPC health Check (treadle SDK caller) {empty_grpc:.2f} ms, the same healthz "
        f"through a bare httpx client {empty_bare:.2f} ms (the tinker SDK's client adds "
        f"{empty_http - empty_bare:.2f} ms a request)\n"
        f"the protocol's estimate (the same engine and routes, every round trip in sequence "
        f"at the empty call's cost): HTTP adds {extra_ms:.1f} ms a step -> ratio ~ "
        f"{protocol_bound:.3f}"
    )
    # The clients' CPU: with the engine keeping the cores busy, what a client
    # spends lengthens its step; the tinker SDK's extra, were it the whole gap.
    per_step = {n: [c / len(times[n]) * 1e3 for c in cpu[n]] for n in paths}
    (c_http, s_http_cpu), (c_grpc, s_grpc_cpu) = (
        per_step["tinker SDK / HTTP"],
        per_step["treadle SDK / gRPC"],
    )
    cpu_bound = grpc_ / (grpc_ + (c_http - c_grpc) / 1e3)
    print(
        f"CPU a step: this process (the SDK's client) tinker SDK {c_http:.1f} ms, treadle SDK "
        f"{c_grpc:.1f} ms; the server {s_http_cpu:.1f} / {s_grpc_cpu:.1f} ms "
        f"({s_grpc_cpu / (grpc_ * 1e3):.2f} cores busy through a gRPC step)\n"
        f"the ratio if the tinker SDK's extra client CPU were the whole difference: "
        f"{cpu_bound:.3f} (measured {ratio:.3f})"
    )
    return 0 if ratio >= RATIO_TARGET and p50 <= DELAY_TARGET_MS else 1


if __name__ == "__main__":
    sys.exit(main())
