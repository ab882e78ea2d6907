"""What a worker group's rank 0 holds for the calls that read a model whole
(issue 36): a LoRA base kept beside its shards, and the transient peak of
``forward_logprobs``, ``save_state`` and a merged export, per rank, 2 ranks.

Each scenario runs in a fresh process (this script with ``--one KIND``): the
engine of a worker of 2 ranks (``build_engine``, as ``treadle serve --ranks 2``
builds it, one torch thread a rank) with one model of the ``--preset`` (110m) in
float32, one ``forward_backward`` (cross-entropy, ``--batch`` x ``--length``
random tokens) and one ``optim_step``; then each read in turn:

* ``full``: a full fine-tune (its weights, gradients and Adam moments sharded),
  ``--sampler torch`` (its published version a copy in rank 0's memory);
* ``full-vllm``: the same with ``--sampler vllm`` (its published version a file
  vLLM's weight reload reads, in ``/dev/shm`` where it exists: not in any rank's
  RSS; its size is reported apart);
* ``lora-torch``: a LoRA model of rank 16 on the sharded base, ``--sampler torch``
  (rank 0's sampler reads the base there: rank 0 keeps it whole);
* ``lora-vllm``: the same with ``--sampler vllm`` (vLLM loads its own copy; no
  vLLM engine starts here, nothing is sampled: its own memory is not counted).

Every process's malloc returns a freed tensor's pages at once
(``MALLOC_MMAP_THRESHOLD_``, ``host_allocator="system"``), so a rank's RSS is
what it holds live. For each read: its wall time, each rank's peak RSS during the call (the kernel's
``VmHWM``, reset through ``/proc/PID/clear_refs`` before the call) and that peak
above the rank's RSS just before the call (memory the allocator kept from
earlier calls and reuses is not counted there), and what it still holds after
the call (RSS after less RSS before: a published version kept in memory). A full fine-tune's first
``reference`` read shards its base (every rank reads it whole once); the
second is what each later one costs. For
the LoRA scenarios also the base bytes rank 0 holds (its whole copy, if kept,
and its shard) and each rank's RSS after the step.

    python benchmarks/ranks_reads.py                    # 110m, 4 x 256
    python benchmarks/ranks_reads.py --preset 5m        # quick
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import model_dir, table  # noqa: E402

KINDS = ("full", "full-vllm", "lora-torch", "lora-vllm")
GIB = 2**30
#: glibc maps every block from 64 KB up from the kernel and unmaps it when freed
#: (a fixed threshold: no dynamic raise), so a rank's RSS follows its live tensors
MMAP_THRESHOLD = 64 * 1024


def _status(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    return 0


def _measured(pids: list[int], run: Callable[[], object]) -> dict[str, object]:
    before = [_status(pid, "VmRSS") for pid in pids]
    for pid in pids:  # the peak RSS from now on (Linux >= 4.0)
        Path(f"/proc/{pid}/clear_refs").write_text("5")
    t0 = time.perf_counter()
    run()
    seconds = time.perf_counter() - t0
    peaks = [_status(pid, "VmHWM") for pid in pids]
    above = [p - b for p, b in zip(peaks, before, strict=True)]
    kept = [_status(pid, "VmRSS") - b for pid, b in zip(pids, before, strict=True)]
    return {"s": seconds, "peak_above": above, "peak": peaks, "kept": kept}


def _base_held(model: object, loaded: bool) -> dict[str, int]:
    from torch.distributed.tensor import DTensor

    base = model.base  # type: ignore[attr-defined]
    cfg = base.cfg
    whole = cfg.num_params() * 4 if loaded else 0
    sharding = model.sharding  # type: ignore[attr-defined]
    shard = sum(
        t.to_local().numel() * t.element_size()
        for _, t in sharding.params().named_tensors()
        if isinstance(t, DTensor)
    )
    return {"whole": whole, "shard": shard}


def one(kind: str, model: Path, batch: int, length: int) -> dict[str, object]:
    import numpy as np
    import torch

    from treadle.common.engine.domain import (
        AdamConfig,
        DatumData,
        ForwardBackwardOp,
        ForwardLogprobsOp,
        ModelSpec,
        OptimStepOp,
        SaveStateOp,
        SyncWeightsOp,
    )
    from treadle.workers.engine.config import EngineConfig
    from treadle.workers.group.launch import build_engine
    from treadle.workers.model.published import WeightsFile

    sampler = "vllm" if kind.endswith("-vllm") else "torch"
    lora = 0 if kind.startswith("full") else 16
    config = EngineConfig(
        base_models={"m": model}, ranks=2, threads=1, sampler=sampler, host_allocator="system"
    )
    engine = build_engine(config).start()
    out = Path(tempfile.mkdtemp(prefix="treadle-reads-"))
    try:
        engine.create_model(ModelSpec("m1", "t", "m", lora, 0.0, 0, "float32")).result()
        rng = np.random.default_rng(0)
        vocab = engine.bases.config("m").vocab_size
        data = tuple(
            DatumData(
                rng.integers(3, vocab, length),
                {"target_tokens": rng.integers(3, vocab, length), "weights": np.ones(length)},
            )
            for _ in range(batch)
        )
        seq = iter(range(1, 100))

        def submit(op: object) -> object:
            n = next(seq)
            return engine.submit("m1", n, op, f"c{n}").result()  # type: ignore[arg-type]

        submit(ForwardBackwardOp(data, "cross_entropy", {}))
        submit(OptimStepOp(AdamConfig(learning_rate=1e-5)))
        pids = [os.getpid(), *(p.pid for p in multiprocessing.active_children() if p.pid)]
        result: dict[str, object] = {
            "kind": kind,
            "rss_after_step": [_status(pid, "VmRSS") for pid in pids],
        }
        if lora:
            loaded = engine.bases.loaded("m", torch.float32)
            result["base_held"] = _base_held(engine.models["m1"], loaded)
        reference = ForwardLogprobsOp(data, reference=True)
        reads = {
            "forward_logprobs": lambda: submit(ForwardLogprobsOp(data)),
            "forward_logprobs reference, 1st": lambda: submit(reference),
            "forward_logprobs reference, 2nd": lambda: submit(reference),
            "sync_weights": lambda: submit(SyncWeightsOp()),
            "save_state": lambda: submit(SaveStateOp("s", str(out / "state"))),
            "export merged": lambda: engine.export_weights(
                "m1", out / "merged", merged=True
            ).result(),
        }
        result["reads"] = {name: _measured(pids, run) for name, run in reads.items()}
        published = engine.versions.get("m1", 1).weights
        if isinstance(published, WeightsFile):  # the version's bytes: a file, not in a rank
            result["version_file"] = published.nbytes
        return result
    finally:
        engine.stop()
        subprocess.run(["rm", "-rf", str(out)], check=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="110m")
    parser.add_argument("--model-dir", default=None)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("--one", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    model = model_dir(args.preset, args.model_dir)
    if args.one:
        print(json.dumps(one(args.one, model, args.batch, args.length)))
        return
    results = []
    for kind in args.kinds.split(","):
        cmd = [sys.executable, __file__, "--one", kind, "--model-dir", str(model)]
        cmd += ["--batch", str(args.batch), "--length", str(args.length)]
        env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(MMAP_THRESHOLD))
        out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
        results.append(json.loads(out.strip().splitlines()[-1]))
    print(
        f"{args.preset}, float32, 2 ranks of 1 thread, {args.batch} x {args.length} tokens; "
        "peak RSS above the RSS before the call, GiB"
    )
    rows = [
        [
            r["kind"],
            name,
            f"{m['s']:.1f}",
            " / ".join(f"{p / GIB:.3f}" for p in m["peak_above"]),
            " / ".join(f"{p / GIB:.2f}" for p in m["peak"]),
            " / ".join(f"{p / GIB:.3f}" for p in m["kept"]),
        ]
        for r in results
        for name, m in r["reads"].items()
    ]
    head = [
        "model",
        "call",
        "s",
        "peak above GiB (rank 0 / 1)",
        "peak RSS GiB (0 / 1)",
        "kept after GiB (0 / 1)",
    ]
    print(table(head, rows))
    for r in results:
        if "version_file" in r:
            print(f"{r['kind']}: the published version's file, {r['version_file'] / GIB:.3f} GiB")
    lora_rows = [
        [
            r["kind"],
            f"{r['base_held']['whole'] / GIB:.3f}",
            f"{r['base_held']['shard'] / GIB:.3f}",
            " / ".join(f"{p / GIB:.2f}" for p in r["rss_after_step"]),
        ]
        for r in results
        if "base_held" in r
    ]
    if lora_rows:
        head = ["model", "rank 0: whole base GiB", "rank 0: base shard GiB", "RSS GiB (0 / 1)"]
        print(table(head, lora_rows))


if __name__ == "__main__":
    main()
