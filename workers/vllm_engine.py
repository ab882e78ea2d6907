"""Starting one vLLM engine for one base model: its settings, sane on CPU and GPU.

vLLM is imported here only when an engine starts (``start_engine``), never at
module import, so importing treadle's workers stays cheap and safe where vLLM
is absent or broken. vLLM's engine core runs in a child process started with
*spawn*: that child re-imports the ``__main__`` module of the program, so a
program that starts an engine must guard its entry point
(``if __name__ == "__main__":``); ``treadle serve`` and ``treadle worker`` do.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from dataclasses import dataclass
from typing import Any

import torch

from treadle.errors import InvalidArgumentError
from treadle.workers.base_models import BaseModel
from treadle.workers.vllm_params import LOGPROBS_MODE

log = logging.getLogger("treadle.vllm")

#: the max LoRA ranks vLLM accepts
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


@dataclass(frozen=True)
class VllmSettings:
    """The vLLM engine's settings (``--vllm-*`` flags).

    ``gpu_memory_utilization``: the share of the GPU's memory vLLM may take, or
    on a CPU host the share of host RAM (0 = the default: 0.9 on a GPU, 0.2 on
    CPU, where the trainer needs the rest). ``kv_cache_gib``: the KV cache's
    size (0 = vLLM's choice on GPU, 1 GiB on CPU). ``max_lora_rank`` /
    ``max_loras``: the largest adapter rank served, and how many adapters may
    share one batch. ``enforce_eager``: no torch.compile / CUDA graphs (starts
    about a minute faster on CPU; compiled decodes ~10% faster on the 110m preset).
    ``reserved_cpus``: cores vLLM keeps off its CPU worker (0 = none; vLLM's
    default reserves one, which leaves one core of two for decoding here).
    """

    gpu_memory_utilization: float = 0.0
    kv_cache_gib: float = 0.0
    max_lora_rank: int = 16
    max_loras: int = 8
    enforce_eager: bool = True
    reserved_cpus: int = 0

    @staticmethod
    def from_options(options: dict[str, Any]) -> VllmSettings:
        known = VllmSettings.__dataclass_fields__
        unknown = [k for k in options if k not in known]
        if unknown:
            raise InvalidArgumentError(f"vllm: unknown settings {unknown}; known: {list(known)}")
        s = VllmSettings(**options)
        if not 0 <= s.gpu_memory_utilization <= 1:
            raise InvalidArgumentError(
                f"vllm_gpu_memory_utilization: must be in (0, 1] (0 = default), "
                f"got {s.gpu_memory_utilization}"
            )
        if s.kv_cache_gib < 0:
            raise InvalidArgumentError(f"vllm_kv_cache_gib: must be >= 0, got {s.kv_cache_gib}")
        if s.max_lora_rank not in LORA_RANKS:
            raise InvalidArgumentError(
                f"vllm_max_lora_rank: vLLM takes one of {LORA_RANKS}, got {s.max_lora_rank}"
            )
        if s.max_loras < 1:
            raise InvalidArgumentError(f"vllm_max_loras: must be >= 1, got {s.max_loras}")
        return s


def vllm_installed() -> bool:
    return importlib.util.find_spec("vllm") is not None


def on_gpu() -> bool:
    return torch.cuda.is_available()


def start_engine(base: BaseModel, settings: VllmSettings, *, max_len: int, max_seqs: int) -> Any:
    """A started ``vllm.LLMEngine`` serving ``base`` (its own HF directory, its dtype),
    with prefix caching, multi-LoRA and the behaviour-logprob mode on."""
    gpu = on_gpu()
    if not gpu:
        kv = settings.kv_cache_gib or 1.0
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, round(kv)))
        os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"] = str(settings.reserved_cpus)
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
    kwargs.update(dtype=dtype, max_lora_rank=settings.max_lora_rank)
    args = EngineArgs(
        model=str(base.path),
        max_model_len=max_len,
        max_num_seqs=max_seqs,
        seed=0,
        enable_prefix_caching=True,
        enable_lora=True,
        max_loras=settings.max_loras,
        gpu_memory_utilization=util,
        enforce_eager=settings.enforce_eager,
        logprobs_mode=LOGPROBS_MODE,
        skip_tokenizer_init=not has_tokenizer,
        disable_log_stats=False,
        **kwargs,
    )
    log.info("vllm: starting an engine for %s (%s, %s)", base.name, dtype, "gpu" if gpu else "cpu")
    return LLMEngine.from_engine_args(args)
