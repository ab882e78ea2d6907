"""Sizing by memory: the torch sampler's KV cache from the device's free memory,
and the training models a worker takes bounded by what it has left.

The reading is ``free_bytes(device)``: free CUDA memory on a GPU, Linux
``MemAvailable`` on the CPU (``train_memory.available_bytes``). It is looked
up through this module at each use, so a test replaces it with its own.

* **KV cache.** With ``--sampler-slots 0`` (the default: auto) a sampler's
  main cache gets ``--kv-cache-memory-fraction`` of the free memory when it is
  made (0 = the device's default: ``DEFAULT_FRACTION``), less its prefill
  slots and the store of finished turns (``SamplerLimits.turn_cache_slots``,
  allocated as requests ask for it, but planned for here), in whole slots of
  ``max_len`` tokens, at most ``MAX_AUTO_SLOTS`` (on the CPU today's 64: a
  small model keeps the batch it always had). An explicit ``--sampler-slots N``
  wins.
* **Models.** Creating or restoring a model first estimates what it will
  hold between calls (``model_bytes``: the base weights if not loaded yet;
  the trainable tensors, their gradients, Adam's two moments and the
  ``keep_versions`` published copies held on the device), and answers
  RESOURCE_EXHAUSTED with the bytes needed and free when that exceeds the free
  memory, before anything is allocated. Activations are checked per call
  (``workers.trainer.memory``).
* **Published versions** are counted where they are kept. A LoRA version is a
  copy of the adapter on the model's device. A full fine-tune's is kept as the
  sampler backend reads it, and the backend says which memory that takes
  (``SamplerBackend.version_memory``): the torch samplers' clone, the device's;
  the sampler process's shared buffer, the host's RAM (the device: CPU only);
  vLLM's file in ``/dev/shm``, the host's RAM (a tmpfs), on a GPU worker not
  the device's. Versions in the device's memory are counted with the model;
  versions in the host's RAM on a GPU worker are checked against the host's
  free memory (``MemAvailable``) on their own; on the CPU the host's RAM *is*
  the device's memory, so every backend's versions count with the model there
  (a tmpfs file's pages are not in ``MemAvailable``). A file on disk (no
  ``/dev/shm``) is not counted.
"""

from __future__ import annotations

from typing import Protocol

import torch

from treadle.common.engine.domain import ModelSpec
from treadle.common.engine.model_config import ModelConfig
from treadle.errors import InvalidArgumentError, ResourceExhaustedError
from treadle.workers.engine.base_models import BaseModel, BaseModelRegistry, parse_dtype
from treadle.workers.model.kv_cache import KVCache
from treadle.workers.model.lora import TARGETS, UNEMBED_TARGET, targets_for
from treadle.workers.sampler.state import SamplerLimits
from treadle.workers.trainer import memory as train_memory

#: share of free memory a sampler's KV cache takes by default, per device type: on a
#: GPU training shares the device (weights, optimizer state, activations); on the
#: CPU the host's other processes share the RAM
DEFAULT_FRACTION = {"cuda": 0.4, "cpu": 0.25}
#: the most slots auto sizing gives, per device type
MAX_AUTO_SLOTS = {"cuda": 1024, "cpu": 64}
MIB = 2**20


def free_bytes(device: torch.device) -> int:
    """What ``device`` can still hand out now (the reading tests replace)."""
    return train_memory.available_bytes(device)


def kv_slot_bytes(cfg: ModelConfig, max_len: int, dtype: torch.dtype) -> int:
    """K and V of one slot of ``max_len`` tokens, every layer."""
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * max_len * element


def check_fraction(fraction: float) -> None:
    if not 0.0 <= fraction < 1.0:
        raise InvalidArgumentError(
            f"kv_cache_memory_fraction: must be in [0, 1) (0 = the device's default), "
            f"got {fraction}"
        )


def kv_slots(
    cfg: ModelConfig,
    max_len: int,
    dtype: torch.dtype,
    where: torch.device,
    *,
    fraction: float,
    prefill_slots: int,
    turn_cache_slots: int = 0,
) -> int:
    """The main cache's slots when they are sized by memory: ``fraction`` (0: the
    device's default) of the free memory, less ``prefill_slots`` staging slots and
    ``turn_cache_slots`` (the store of finished turns at its bound), at most
    ``MAX_AUTO_SLOTS``. RESOURCE_EXHAUSTED when not even one slot fits."""
    share = fraction or DEFAULT_FRACTION.get(where.type, DEFAULT_FRACTION["cpu"])
    per_slot = kv_slot_bytes(cfg, max_len, dtype)
    free = free_bytes(where)
    aside = prefill_slots + turn_cache_slots
    fits = int(share * free) // per_slot - aside
    if fits < 1:
        raise ResourceExhaustedError(
            f"sampler: the KV cache needs {(1 + aside) * per_slot / MIB:,.1f} MiB for "
            f"one row, {prefill_slots} prefill slots and {turn_cache_slots} slots of kept "
            f"turns of {max_len} tokens; {share:.0%} of the {free / MIB:,.1f} MiB free on "
            f"{where} is less: raise --kv-cache-memory-fraction, lower --sampler-max-len, "
            "or set --sampler-slots"
        )
    return min(fits, MAX_AUTO_SLOTS.get(where.type, MAX_AUTO_SLOTS["cpu"]))


def sampler_caches(base: BaseModel, limits: SamplerLimits, max_len: int) -> tuple[KVCache, KVCache]:
    """A sampler's main KV cache (``limits.num_slots`` slots, or sized by memory when
    0) and its staging cache (``prefill_slots``), on the base weights' device.
    RESOURCE_EXHAUSTED when they cannot be allocated."""
    where, stage_slots = base.device, max(1, limits.prefill_slots)
    slots = limits.num_slots or kv_slots(
        base.cfg,
        max_len,
        base.dtype,
        where,
        fraction=limits.kv_memory_fraction,
        prefill_slots=stage_slots,
        turn_cache_slots=limits.turn_cache_slots,
    )
    try:
        main = KVCache(base.cfg, slots, max_len, dtype=base.dtype, device=where)
        stage = KVCache(base.cfg, stage_slots, max_len, dtype=base.dtype, device=where)
    except (RuntimeError, MemoryError) as err:  # torch.OutOfMemoryError too
        raise ResourceExhaustedError(
            f"sampler: cannot allocate the KV cache ({slots} slots x {max_len} tokens): {err}"
        ) from None
    return main, stage


def lora_params(cfg: ModelConfig, rank: int, targets: tuple[str, ...]) -> int:
    """Scalars of a rank-``rank`` adapter on ``targets``: ``rank x (in + out)`` each."""
    h, i, q, kv = cfg.hidden_size, cfg.intermediate_size, cfg.q_size, cfg.kv_size
    shapes = {
        "q_proj": (h, q),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (q, h),
        "gate_proj": (h, i),
        "up_proj": (h, i),
        "down_proj": (i, h),
    }
    per_layer = sum(rank * sum(shapes[t]) for t in targets if t in shapes)
    head = rank * (h + cfg.vocab_size) if UNEMBED_TARGET in targets else 0
    return cfg.num_layers * per_layer + head


class KeepsVersions(Protocol):
    """What the budget asks a sampler backend (``SamplerBackend.version_memory``)."""

    def version_memory(self, device: torch.device) -> torch.device | None:
        """The memory a full fine-tune's kept version on ``device`` takes (None: none)."""
        ...


def check_model(
    spec: ModelSpec,
    bases: BaseModelRegistry,
    keep_versions: int,
    sampler: KeepsVersions,
    *,
    base_held: bool = False,
) -> None:
    """RESOURCE_EXHAUSTED, before anything is allocated, when the model ``spec``
    creates (or restores) would not fit in the free memory of the bases' device,
    or its ``keep_versions`` published versions not in the memory ``sampler`` keeps
    them in (a full fine-tune's, when that is not the device's: the host's RAM).
    ``base_held``: what a LoRA model reads of its base is held here already, though
    the whole base is not loaded (a group's rank 0 that keeps only its shards)."""
    dtype = parse_dtype(spec.dtype)
    cfg, where = bases.config(spec.base_model), bases.device
    targets = TARGETS
    if spec.is_lora:
        targets = targets_for(
            train_attn=spec.train_attn, train_mlp=spec.train_mlp, train_unembed=spec.train_unembed
        )
    # a LoRA version is an adapter copy on the device; a full fine-tune's as the backend keeps it
    versions_in = where if spec.is_lora else sampler.version_memory(where)
    need = model_bytes(
        cfg,
        dtype,
        lora_rank=spec.lora_rank,
        targets=targets,
        keep_versions=keep_versions if versions_in == where else 0,
        # a full fine-tune reads its own copy without loading the base (``BaseModel``)
        base_loaded=not spec.is_lora or base_held or bases.loaded(spec.base_model, dtype),
    )
    check_model_fits(need, where, f"model {spec.model_id}")
    if versions_in is not None and versions_in != where:
        kept = keep_versions * version_bytes(cfg, dtype, lora_rank=spec.lora_rank, targets=targets)
        check_model_fits(
            kept,
            versions_in,
            f"model {spec.model_id}",
            held=f"{keep_versions} published versions",
            fix="lower --keep-versions, delete a model on this worker, or retry on another worker",
        )


def version_bytes(
    cfg: ModelConfig, dtype: torch.dtype, *, lora_rank: int, targets: tuple[str, ...] = TARGETS
) -> int:
    """One published version: a copy of the adapter, or of a full fine-tune's weights."""
    element = torch.empty((), dtype=dtype).element_size()
    return (lora_params(cfg, lora_rank, targets) if lora_rank > 0 else cfg.num_params()) * element


def model_bytes(
    cfg: ModelConfig,
    dtype: torch.dtype,
    *,
    lora_rank: int,
    targets: tuple[str, ...] = TARGETS,
    keep_versions: int,
    base_loaded: bool,
) -> int:
    """What a model holds between calls on its device: the base weights (unless
    loaded already), its trainable tensors (a full fine-tune's own copy of every
    weight), their gradients, Adam's two moments, and ``keep_versions`` published
    copies (the ones kept on the device: ``check_model``)."""
    element = torch.empty((), dtype=dtype).element_size()
    base = 0 if base_loaded else cfg.num_params() * element
    return base + version_bytes(cfg, dtype, lora_rank=lora_rank, targets=targets) * (
        4 + keep_versions
    )


def check_model_fits(
    need: int,
    where: torch.device,
    what: str,
    *,
    held: str = "weights, gradients, optimizer state, published versions",
    fix: str = "delete or unload a model on this worker, use a smaller LoRA rank, or retry "
    "on another worker",
) -> None:
    """RESOURCE_EXHAUSTED, with the bytes needed and free, when ``need`` (``held``)
    exceeds the free memory of ``where`` now; ``fix`` says what to do."""
    free = free_bytes(where)
    if need <= free:
        return
    raise ResourceExhaustedError(
        f"{what}: needs about {need / MIB:,.1f} MiB on {where} ({held}), "
        f"{free / MIB:,.1f} MiB is free: {fix}"
    )
