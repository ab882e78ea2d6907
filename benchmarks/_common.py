"""Shared helpers of the benchmarks: a fixed thread budget, this machine's limits
measured in the same run, a locally built model, and Markdown tables."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

THREADS = 2  # every benchmark runs on the same fixed budget (CI's 2-core runner)
os.environ.setdefault("OMP_NUM_THREADS", str(THREADS))
# OpenMP's wait policy is left as `treadle serve` leaves it (the runtime's
# default). Set OMP_WAIT_POLICY=PASSIVE from outside to make waiting threads
# sleep (it helped a heavily shared machine, and made two-thread small calls
# 3x slower on a quiet one); both sides of every comparison run in this one
# process, under the same policy.
OMP_WAIT_POLICY = os.environ.get("OMP_WAIT_POLICY", "default")

import torch  # noqa: E402

# In the benchmark's own process only. A child started with spawn (vLLM's engine
# core and worker, the torch-process sampler) re-imports the benchmark's main
# module and with it this one; vLLM's CPU worker binds its OpenMP threads to the
# one core left after the reserved one, and a set_num_threads(2) there put two
# spinning threads on it: raw LLM.generate on the 5m preset decoded 156-168 tok/s
# instead of 3,100-4,700 (multiprocessing.parent_process() is None in vLLM's
# children too, so the process that first imported this module is remembered).
_OWNER = "TREADLE_BENCH_PID"
os.environ.setdefault(_OWNER, str(os.getpid()))
if os.environ[_OWNER] == str(os.getpid()):
    torch.set_num_threads(THREADS)


def scratch(prefix: str) -> Path:
    """A new temporary directory, removed when this process exits (a benchmark's
    models, data directories and logs: the 110m preset alone is ~0.45 GB)."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def model_dir(preset: str, given: str | None) -> Path:
    """A random-weight Llama of ``preset`` built on the spot, in a directory removed
    at exit (or reused from ``given``, which stays)."""
    from treadle.workers.model.tiny import build_tiny_model

    if given:
        path = Path(given)
        if (path / "config.json").exists():
            return path
    else:
        path = scratch(f"treadle-bench-{preset}-")
    return build_tiny_model(path, preset=preset, seed=0)


def best_time(fn: Callable[[], object], repeat: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def matmul_gflops(dtype: torch.dtype = torch.float32, n: int = 1024) -> float:
    """Peak-ish matmul throughput of this machine at ``dtype`` (best of a few runs)."""
    a = torch.randn(n, n).to(dtype)
    b = torch.randn(n, n).to(dtype)
    return 2 * n**3 / best_time(lambda: a @ b) / 1e9


def memory_gbs() -> float:
    """Copy bandwidth (read + write) of a 256 MB buffer, GB/s."""
    src = torch.ones(64 * 2**20)
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / best_time(lambda: dst.copy_(src), repeat=3) / 1e9


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    def fmt(v: object) -> str:
        if isinstance(v, float):
            return f"{v:,.3g}" if abs(v) < 10 else f"{v:,.0f}"
        return str(v)

    cells = [[fmt(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    lines = [
        "| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)) + " |",
        "|" + "|".join("-" * (w + 2) for w in widths) + "|",
    ]
    for r in cells:
        lines.append("| " + " | ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) + " |")
    return "\n".join(lines)


def hf_generate(
    model: torch.nn.Module, ids: torch.Tensor, new_tokens: int, eos: int, n: int = 1
) -> None:
    """The HF baseline every sampler benchmark runs: ``generate`` sampling at
    temperature 1 (no top-k/top-p), ``n`` sequences per prompt, each exactly
    ``new_tokens`` long (EOS suppressed)."""
    with torch.no_grad():
        out = model.generate(  # type: ignore[operator]
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            num_return_sequences=n,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            suppress_tokens=[eos],
            pad_token_id=0,
        )
    assert out.shape == (ids.shape[0] * n, ids.shape[1] + new_tokens)
