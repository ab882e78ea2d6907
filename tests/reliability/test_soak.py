"""A 60-second soak in CI (``-m soak`` selects it): four SDK clients run the
mixed loop (forward_backward, forward_logprobs, optim_step, sync_weights,
sample) without pause on one embedded server, in this process. No call may
fail, and after a 20-second warm-up the process's open file descriptors and
resident memory may not grow past their bounds (``FD_GROWTH``, ``RSS_GROWTH_MIB``;
why these numbers, below). ``TREADLE_SOAK_S`` changes the length.

The 10-minute soak of ``benchmarks/load.py --soak 600`` is the long form, with
the server in its own process; its figures are in docs/reliability.md."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import treadle
from treadle.server.embedded import EmbeddedServer

pytestmark = [pytest.mark.soak, pytest.mark.slow, pytest.mark.timeout(300)]

SOAK_S = float(os.environ.get("TREADLE_SOAK_S", "60"))
WARM_UP_S = 20.0
SAMPLE_EVERY_S = 5.0
CLIENTS = 4
#: Descriptors: after warm-up every connection and file a call opens is closed
#: again; the 10-minute soak held the server at 20 +- 1. A leak of one per call
#: would add hundreds here (the loop makes about 10 calls a second even at a
#: load average of 20).
FD_GROWTH = 4
#: Memory: the bounded caches (recorded results per model, the last published
#: versions, the sampler's last 4096 results) still fill after warm-up: the
#: 10-minute soak measured the server's growth at 6.5 MiB/min at most (minutes
#: 1-5), about 4.3 MiB over the 40 s measured here; 24 MiB is over five times
#: that. What it catches depends on the pace: 24 MiB over the calls made after
#: warm-up (printed), e.g. 60 KiB a call at 10 calls a second (a loaded
#: machine), 12 KiB a call at 50.
RSS_GROWTH_MIB = 24.0


def _rss_mib_and_fds() -> tuple[float, int]:
    rss_kb = 0
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss_kb = int(line.split()[1])
    return rss_kb / 1024, len(os.listdir("/proc/self/fd"))


def _client_loop(
    server: EmbeddedServer, index: int, stop: threading.Event, calls: list[int], errors: list[str]
) -> None:
    rng = np.random.default_rng(index)
    adam = treadle.AdamParams(learning_rate=1e-3)
    params = treadle.SamplingParams(max_tokens=4, temperature=1.0)
    with treadle.ServiceClient(server.address, api_key=server.api_key) as client:
        tc = client.create_lora_training_client("tiny", rank=2, seed=index)
        while not stop.is_set():
            tokens = rng.integers(1, 60, size=12).tolist()
            datum = treadle.Datum(
                model_input=treadle.ModelInput.from_ints(tokens[:-1]),
                loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * 11},
            )
            try:
                tc.forward_backward([datum], "cross_entropy").result(timeout=120)
                tc.forward_logprobs([datum]).result(timeout=120)
                tc.optim_step(adam).result(timeout=120)
                sampler = tc.sync_weights()
                sampler.sample(tokens[:6], 2, params).result(timeout=120)
                calls[index] += 5
            except Exception as err:  # every failure is reported below
                errors.append(f"client {index}: {type(err).__name__}: {err}")
                return


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc (Linux)")
def test_a_minute_of_mixed_calls_leaks_nothing(server: EmbeddedServer) -> None:
    stop = threading.Event()
    calls = [0] * CLIENTS
    errors: list[str] = []
    threads = [
        threading.Thread(target=_client_loop, args=(server, i, stop, calls, errors))
        for i in range(CLIENTS)
    ]
    t0 = time.monotonic()
    for th in threads:
        th.start()
    samples: list[tuple[float, float, int]] = []
    while (t := time.monotonic() - t0) < SOAK_S and not errors:
        time.sleep(min(SAMPLE_EVERY_S, max(0.0, SOAK_S - t)))
        samples.append((time.monotonic() - t0, *_rss_mib_and_fds()))
    stop.set()
    for th in threads:
        th.join(180)
    assert errors == [], errors[:5]
    warm = [s for s in samples if s[0] >= WARM_UP_S]
    assert len(warm) >= 2, samples
    rss0, fds0 = warm[0][1], warm[0][2]
    rss_growth = max(r for _, r, _ in warm) - rss0
    fd_growth = max(f for _, _, f in warm) - fds0
    after_warm_up = sum(calls) * (SOAK_S - warm[0][0]) / SOAK_S  # about
    print(
        f"\nsoak {SOAK_S:g} s, {CLIENTS} clients: {sum(calls)} calls, 0 errors; after "
        f"{WARM_UP_S:g} s: RSS {rss0:.0f} -> {warm[-1][1]:.0f} MiB (max +{rss_growth:.1f}), "
        f"fds {fds0} -> {warm[-1][2]} (max +{fd_growth}); the RSS bound catches a leak "
        f"of {RSS_GROWTH_MIB * 1024 / max(after_warm_up, 1):.0f} KiB per call or more"
    )
    assert sum(calls) > 0
    assert fd_growth <= FD_GROWTH, samples
    assert rss_growth <= RSS_GROWTH_MIB, samples
