"""Device checks of the decode step's host reads and of sizing by memory (part of
``tests/gpu/checks.py``'s ``CHECKS``).

* decode reads: one device read per decode step. On CUDA, torch's sync debug
  mode reports every synchronisation (a read, or a blocking host-to-device
  copy); on the CPU, ``DeviceReads`` counts the reads of the same code.
* memory: a KV cache sized by a fraction of the real free memory stays within
  it, and a model refused for memory allocates nothing on the device.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch.overrides import TorchFunctionMode

from treadle.common.engine.domain import SampleOp, SampleResult, SamplerTarget, SamplingConfig
from treadle.errors import ResourceExhaustedError
from treadle.workers.device import memory_budget

if TYPE_CHECKING:
    from tests.gpu.checks import Ctx

#: the tensor methods and functions that read a value back to the host
READS = frozenset(
    {"cpu", "tolist", "item", "numpy", "__bool__", "__int__", "__float__", "__index__", "equal"}
)


class DeviceReads(TorchFunctionMode):
    """Counts host reads of tensors, except of tensors that already are a read's
    result (or views and conversions of one: the host copy)."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []
        self._host: dict[int, torch.Tensor] = {}

    def __torch_function__(
        self, func: Callable[..., Any], types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        name = getattr(func, "__name__", "")
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        from_host = any(id(t) in self._host for t in tensors)
        # ``.to("cpu")`` reads back; ``.to(device)`` moves to the step's own device
        # (a no-op there), which on the CPU cannot be told from a read: not counted
        to_cpu = name == "to" and "cpu" in [*args[1:], (kwargs or {}).get("device")]
        if (name in READS or to_cpu) and not from_host:
            self.reads.append(name)
        if isinstance(out, torch.Tensor) and (from_host or name in READS or to_cpu):
            self._host[id(out)] = out  # kept alive so the id is not reused
        return out


def _reads_of(device: str, step: Callable[[], None]) -> int:
    if device == "cpu":
        with DeviceReads() as mode:
            step()
        return len(mode.reads)
    torch.cuda.synchronize(device)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in seen)


def check_decode_reads(ctx: Ctx, dtype: str, steps: int = 5) -> str:
    """A decode step of base and LoRA rows, greedy and top-k/top-p, reads the device once."""
    from tests.gpu.checks import _engine, _spec

    engine = _engine(ctx, dtype)
    engine._create_model(_spec("m", dtype), None, 1)
    futs: list[Future[SampleResult]] = []
    params = [
        SamplingConfig(max_tokens=24, seed=1, ignore_eos=True),
        SamplingConfig(max_tokens=24, seed=2, ignore_eos=True, top_k=5, top_p=0.9),
        SamplingConfig(max_tokens=24, temperature=0.0, ignore_eos=True),
    ]
    for i, p in enumerate(params):
        for target in (SamplerTarget("tiny"), SamplerTarget("tiny", "m", None, "t")):
            fut: Future[SampleResult] = Future()
            engine._admit_sample(target, SampleOp(np.arange(5, 11 + i), 2, p), fut)
            futs.append(fut)
    (sampler,) = engine.sampler.core.samplers.values()
    while sampler.queue or sampler.prefilling:
        sampler.step()
    rows = len(sampler.running)
    counts = [_reads_of(ctx.device, sampler.step) for _ in range(steps)]
    assert counts == [1] * steps, f"device reads per decode step: {counts}"
    while sampler.has_work():
        sampler.step()
    assert all(s.tokens.size == 24 for f in futs for s in f.result(0).sequences)
    return f"{dtype}: 1 device read per decode step ({rows} rows, {steps} steps)"


def check_memory_sizing(ctx: Ctx, dtype: str) -> str:
    """Auto KV slots fit the fraction of the real free memory; a model refused for
    memory allocates nothing."""
    from tests.gpu.checks import _engine, _spec

    where = torch.device(ctx.device)
    engine = _engine(ctx, dtype, sampler_slots=0, kv_cache_memory_fraction=0.01)
    free = memory_budget.free_bytes(where)
    fut: Future[SampleResult] = Future()
    op = SampleOp(np.arange(5, 9), 1, SamplingConfig(max_tokens=2, seed=0))
    engine._admit_sample(SamplerTarget("tiny"), op, fut)
    (sampler,) = engine.sampler.core.samplers.values()
    kv = sampler.cache.nbytes() + sampler.prefix.stage.nbytes()
    assert kv <= 0.01 * free or sampler.cache.num_slots == memory_budget.MAX_AUTO_SLOTS.get(
        where.type
    ), (kv, free)
    allocated = torch.cuda.memory_allocated(where) if where.type == "cuda" else 0
    reading = memory_budget.free_bytes
    memory_budget.free_bytes = lambda device: 1024  # type: ignore[assignment]
    try:
        engine._create_model(_spec("big", dtype, rank=0), None, 1)
        raise AssertionError("a model larger than the free memory was created")
    except ResourceExhaustedError as err:
        assert "MiB" in str(err), err
    finally:
        memory_budget.free_bytes = reading  # type: ignore[assignment]
    if where.type == "cuda":
        assert torch.cuda.memory_allocated(where) == allocated
    engine._create_model(_spec("small", dtype), None, 1)  # and it keeps serving
    return (
        f"{dtype}: {sampler.cache.num_slots} auto slots, {kv / 2**20:.1f} MiB of "
        f"{free / 2**20:,.0f} MiB free; a refused model allocated nothing"
    )
