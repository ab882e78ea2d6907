"""``sync_weights`` of a full fine-tune with the sampler in a process of its own:
shared-memory buffers reused (``ShmPool``) vs a fresh buffer per version.

Every published version of a full fine-tune goes to the sampler process in
one shared-memory buffer. A fresh buffer pays its page faults on the first
write; a reused one (whose old version neither process reads any more) does
not. Both sides run here, one after the other, each on an embedded server of
its own (``sampler="torch-process"``, one torch thread): the baseline with reuse
turned off (``shm._SOLE = None``, what a torch without storage
reference counts gets), then as shipped. Each side does ``--syncs`` rounds of
``optim_step`` + ``sync_weights(inflight=True)`` with a ``latest`` sampler
open; the median of the last half is reported (the pool fills first): the
engine's time for the sync, and the client's round trip.

usage: .venv/bin/python benchmarks/sync_weights.py [--syncs 60] [--presets demo 5m]
Runs in about a minute on 2 cores.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

import _common  # noqa: E402  (tables; the thread budget is the server's: one thread)
import numpy as np  # noqa: E402

import treadle  # noqa: E402
from treadle.server.config import ServerConfig  # noqa: E402
from treadle.server.embedded import EmbeddedServer  # noqa: E402
from treadle.workers.engine import ordered as ordered_executor  # noqa: E402
from treadle.workers.model.tiny import build_tiny_model  # noqa: E402
from treadle.workers.sampler.process import shm

SYNC_TIMES: list[float] = []


def _timed_apply(original: Any) -> Any:
    def apply(self: Any, model: Any, seq_id: int, op: Any) -> Any:
        t0 = time.perf_counter()
        out = original(self, model, seq_id, op)
        if type(op).__name__ == "SyncWeightsOp":
            SYNC_TIMES.append(time.perf_counter() - t0)
        return out

    return apply


def side(model_dir: Path, syncs: int, reuse: bool) -> tuple[float, float, int]:
    """(engine ms, client ms) medians over the last half of ``syncs``, and the reuses."""
    sole = shm._SOLE
    if not reuse:
        shm._SOLE = None
    data = _common.scratch("treadle-bench-sync-")
    config = ServerConfig(
        data_dir=data,
        models={"m": model_dir},
        port=0,
        threads=1,
        sampler_slots=16,
        sampler_max_len=64,
        sampler="torch-process",
        sampler_threads=1,
    )
    try:
        with (
            EmbeddedServer(config) as server,
            treadle.ServiceClient(server.address, api_key=str(server.api_key)) as service,
        ):
            trainer = service.create_training_client("m", seed=0)
            trainer.sync_weights()._info.result(60)
            latest = service.create_sampling_client(weights=f"treadle://{trainer.model_id}/latest")
            latest.sample([5, 6, 7], 1, treadle.SamplingParams(max_tokens=2)).result(60)
            SYNC_TIMES.clear()
            client = []
            for _ in range(syncs):
                trainer.optim_step(treadle.AdamParams(learning_rate=1e-4)).result(60)
                t0 = time.perf_counter()
                trainer.sync_weights(inflight=True)._info.result(60)
                client.append(time.perf_counter() - t0)
            reused = service_pool_reuses(server)
        half = syncs // 2
        return (
            float(np.median(SYNC_TIMES[-half:])) * 1e3,
            float(np.median(client[-half:])) * 1e3,
            reused,
        )
    finally:
        shm._SOLE = sole


def service_pool_reuses(server: EmbeddedServer) -> int:
    """Buffers the embedded engine's pool reused."""
    engine = server.ctx.dispatcher.engine
    return int(engine.sampler.pool.reused)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--syncs", type=int, default=60)
    ap.add_argument("--presets", nargs="+", default=["demo", "5m"])
    args = ap.parse_args()
    ordered_executor.OrderedExecutor.apply = _timed_apply(ordered_executor.OrderedExecutor.apply)  # type: ignore[method-assign]
    rows = []
    for preset in args.presets:
        path = build_tiny_model(
            _common.scratch("treadle-bench-sync-model-") / preset, preset=preset, seed=0
        )
        fresh = side(path, args.syncs, reuse=False)
        pooled = side(path, args.syncs, reuse=True)
        rows.append(
            [
                preset,
                fresh[0],
                pooled[0],
                fresh[0] / pooled[0],
                fresh[1],
                pooled[1],
                f"{fresh[2]} / {pooled[2]}",
            ]
        )
    print()
    print(
        _common.table(
            [
                "model (full fine-tune)",
                "engine ms, fresh buffers",
                "engine ms, reused",
                "engine speedup",
                "client ms, fresh",
                "client ms, reused",
                "buffers reused (fresh / pooled)",
            ],
            rows,
        )
    )
    print(
        f"\nsync_weights(inflight=True) after each optim_step; medians of the last {args.syncs // 2}"
    )


if __name__ == "__main__":
    main()
