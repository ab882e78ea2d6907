"""Where the engine's tensors live: the ``--device`` choice, the dtype each device
runs, host copies for checkpoints, and what an out-of-memory error means.

``auto`` is CUDA when torch sees a GPU, else the CPU. Everything a worker
creates (base weights, adapters, optimizer state, full fine-tune copies,
published versions, the KV cache, sampling state) is made on the resolved
device; the host sees tensors only where a file is written (``host_copies``).

Imports torch only (no server package), like the rest of the engine.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from treadle.errors import InvalidArgumentError, ResourceExhaustedError

#: what ``--device`` accepts (``cuda:N`` too)
CHOICES = ("auto", "cpu", "cuda")


def resolve(name: str) -> torch.device:
    """The device ``name`` stands for on this machine; INVALID_ARGUMENT (naming the
    flag) when it does not exist here: ``cuda`` without CUDA, ``cuda:7`` on a
    host with fewer GPUs, or a name that is not a device."""
    name = name.strip().lower()
    if name == "auto":
        return torch.device("cuda", torch.cuda.current_device()) if _has_cuda() else cpu()
    if name == "cpu":
        return cpu()
    if name == "cuda" or name.startswith("cuda:"):
        index_text = name.partition(":")[2]
        if name.endswith(":") or (index_text and not index_text.isdigit()):
            raise InvalidArgumentError(f"device: {name!r} is not a device; use cuda or cuda:N")
        if not _has_cuda():
            raise InvalidArgumentError(
                f"device: {name!r} asked for, but torch sees no CUDA device on this machine "
                f"(torch {torch.__version__}, CUDA build {torch.version.cuda or 'none'}); "
                "use --device cpu, or install a CUDA build of torch on a GPU host"
            )
        count = torch.cuda.device_count()
        index = int(index_text) if index_text else torch.cuda.current_device()
        if index >= count:
            raise InvalidArgumentError(
                f"device: {name!r} does not exist; this machine has {count} CUDA "
                f"device{'s' if count != 1 else ''} (cuda:0..cuda:{count - 1})"
            )
        return torch.device("cuda", index)
    raise InvalidArgumentError(f"device: {name!r}; choose from auto, cpu, cuda, cuda:N")


def canonical(name: str) -> str:
    """``resolve(name)`` as a string: ``cpu`` or ``cuda:N``."""
    device = resolve(name)
    return "cpu" if device.type == "cpu" else f"cuda:{device.index}"


def cpu() -> torch.device:
    return torch.device("cpu")


def default_dtype(device: torch.device) -> str:
    """bfloat16 on a GPU (where its kernels run fastest), float32 on the CPU."""
    return "bfloat16" if device.type == "cuda" else "float32"


def check_dtype(device: torch.device, dtype: str) -> None:
    """INVALID_ARGUMENT when ``device`` cannot compute in ``dtype``."""
    if device.type != "cuda":
        return
    if dtype == "bfloat16" and not torch.cuda.is_bf16_supported(including_emulation=False):
        name = torch.cuda.get_device_name(device)
        raise InvalidArgumentError(
            f"dtype: bfloat16 is not supported by {name} ({device}); use --dtype float32"
        )


def is_cpu_only(device: torch.device) -> bool:
    """The CPU-only tricks (weight prepacking, measured thread choice, one thread
    per pass) apply: the device is the CPU."""
    return device.type == "cpu"


def host_copies(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Contiguous host copies of ``tensors``, for a file (checkpoint, export).

    CPU tensors are returned as they are (made contiguous); device tensors are
    copied into pinned host memory without a synchronisation per tensor, then
    the device is synchronised once before any of them is read.
    """
    out: dict[str, torch.Tensor] = {}
    devices: set[torch.device] = set()
    for name, t in tensors.items():
        t = t.detach()
        if t.device.type == "cpu":
            out[name] = t.contiguous()
            continue
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t, non_blocking=True)
        out[name] = host
        devices.add(t.device)
    for device in devices:
        torch.cuda.synchronize(device)
    return out


def upload(host: torch.Tensor, where: torch.device) -> torch.Tensor:
    """``host`` (a CPU tensor the caller no longer changes) on ``where``, without the
    host waiting for the device: on CUDA it is staged in pinned memory and copied
    asynchronously, in stream order (a plain ``.to(device)`` of pageable memory
    waits for the stream to drain first). On the CPU ``host`` itself."""
    if where.type == "cpu":
        return host
    return host.pin_memory().to(where, non_blocking=True)


def is_oom(err: BaseException) -> bool:
    """``err`` is the device running out of memory (CUDA's, or the allocator's)."""
    return isinstance(err, torch.OutOfMemoryError)


def out_of_memory(
    what: str, err: BaseException, device: torch.device | None
) -> ResourceExhaustedError:
    """The RESOURCE_EXHAUSTED a call that ran out of device memory answers, after
    releasing what the allocator caches (the call's tensors are gone by now)."""
    release(device)
    first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return ResourceExhaustedError(
        f"{what}: out of device memory ({first}); the call was not applied and the model "
        "is at its last applied step: retry with a smaller batch (fewer or shorter "
        "sequences), or on a worker with more free memory"
    )


def release(device: torch.device | None) -> None:
    """Hand the allocator's cached, unused blocks back to the device."""
    if device is not None and device.type == "cuda" and torch.cuda.is_available():
        torch.cuda.empty_cache()


def _has_cuda() -> bool:
    return bool(torch.cuda.is_available()) and torch.cuda.device_count() > 0
