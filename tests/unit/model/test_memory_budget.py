"""Sizing by memory with an injected reading: the KV cache's auto slots, the
model-size estimate, and a model refused before anything is allocated."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from treadle.common.engine.domain import ModelSpec
from treadle.errors import ResourceExhaustedError
from treadle.workers.device import memory_budget
from treadle.workers.device.memory_budget import KeepsVersions
from treadle.workers.engine.base_models import BaseModel, BaseModelRegistry
from treadle.workers.engine.loop import Engine, EngineConfig
from treadle.workers.sampler.process.proxy import ProcessTorchBackend
from treadle.workers.sampler.state import SamplerLimits
from treadle.workers.sampler.torch_backend import InlineTorchBackend, ThreadTorchBackend
from treadle.workers.sampler.torch_sampler import TorchSampler
from treadle.workers.trainer.trainer import TrainingModel
from treadle.workers.vllm.backend import VllmBackend
from treadle.workers.vllm.settings import VllmSettings

torch.set_num_threads(1)
MAX_LEN = 64


def reading(monkeypatch: pytest.MonkeyPatch, free: int) -> None:
    monkeypatch.setattr(memory_budget, "free_bytes", lambda device: free)


def test_slot_bytes_are_what_the_cache_holds(base: BaseModel) -> None:
    sampler = TorchSampler(base, limits=SamplerLimits(num_slots=3, max_len=MAX_LEN))
    per_slot = memory_budget.kv_slot_bytes(base.cfg, MAX_LEN, torch.float32)
    assert sampler.cache.nbytes() == 3 * per_slot


def test_auto_slots_take_the_fraction_of_free_memory(
    base: BaseModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    per_slot = memory_budget.kv_slot_bytes(base.cfg, MAX_LEN, torch.float32)
    # half the memory holds 10 main slots and the 2 prefill slots, with room to spare
    reading(monkeypatch, 2 * (12 * per_slot + per_slot // 2))
    limits = SamplerLimits(
        num_slots=0, max_len=MAX_LEN, prefill_slots=2, kv_memory_fraction=0.5, turn_cache_slots=0
    )
    assert TorchSampler(base, limits=limits).cache.num_slots == 10
    # the CPU's default share, a quarter of 25 slots' worth: 6 slots, 2 of them prefill
    default = SamplerLimits(num_slots=0, max_len=MAX_LEN, prefill_slots=2, turn_cache_slots=0)
    assert TorchSampler(base, limits=default).cache.num_slots == 6 - 2


def test_the_store_of_kept_turns_is_planned_for(
    base: BaseModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store of finished turns, at its bound, is set aside like the prefill slots."""
    per_slot = memory_budget.kv_slot_bytes(base.cfg, MAX_LEN, torch.float32)
    reading(monkeypatch, 2 * (12 * per_slot + per_slot // 2))
    limits = SamplerLimits(
        num_slots=0, max_len=MAX_LEN, prefill_slots=2, kv_memory_fraction=0.5, turn_cache_slots=3
    )
    sampler = TorchSampler(base, limits=limits)
    assert sampler.cache.num_slots == 10 - 3
    assert sampler.prefix.max_kept_tokens == 3 * MAX_LEN
    # no room once it is set aside: the error counts it
    too_many = SamplerLimits(
        num_slots=0, max_len=MAX_LEN, prefill_slots=2, kv_memory_fraction=0.5, turn_cache_slots=10
    )
    with pytest.raises(ResourceExhaustedError, match="10 slots of kept turns"):
        TorchSampler(base, limits=too_many)


def test_auto_slots_keep_the_cpu_default_on_a_small_model(
    base: BaseModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    reading(monkeypatch, 64 * 2**30)
    limits = SamplerLimits(num_slots=0, max_len=MAX_LEN)
    assert TorchSampler(base, limits=limits).cache.num_slots == 64  # today's default


def test_an_explicit_slot_count_wins(base: BaseModel, monkeypatch: pytest.MonkeyPatch) -> None:
    reading(monkeypatch, 1)  # nothing free by the reading: the explicit count is not checked
    limits = SamplerLimits(num_slots=5, max_len=MAX_LEN, kv_memory_fraction=0.5)
    assert TorchSampler(base, limits=limits).cache.num_slots == 5


def test_no_room_for_one_row_is_resource_exhausted(
    base: BaseModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    per_slot = memory_budget.kv_slot_bytes(base.cfg, MAX_LEN, torch.float32)
    reading(monkeypatch, 4 * per_slot)
    limits = SamplerLimits(num_slots=0, max_len=MAX_LEN, prefill_slots=8)
    with pytest.raises(ResourceExhaustedError, match=r"MiB free on cpu.*kv-cache-memory-fraction"):
        TorchSampler(base, limits=limits)


@pytest.mark.parametrize("rank", [0, 4])
def test_the_estimate_counts_what_a_model_allocates(base: BaseModel, rank: int) -> None:
    spec = ModelSpec("m", "t", "tiny", rank, float(rank), 0, "float32")
    model = TrainingModel(spec, base)
    trainable = sum(t.numel() for t in model.trainable.values())
    need = memory_budget.model_bytes(
        base.cfg, torch.float32, lora_rank=rank, keep_versions=2, base_loaded=True
    )
    assert need == trainable * 4 * (4 + 2)  # weights, gradients, 2 moments, 2 versions
    fresh = memory_budget.model_bytes(
        base.cfg, torch.float32, lora_rank=rank, keep_versions=2, base_loaded=False
    )
    assert fresh - need == base.cfg.num_params() * 4


def _spec(model_id: str, rank: int) -> ModelSpec:
    return ModelSpec(model_id, "t", "tiny", rank, float(rank), 0, "float32")


def test_a_model_that_does_not_fit_is_refused_before_allocating(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = Engine(EngineConfig({"tiny": tiny_model_dir}, threads=1, keep_versions=2)).start()
    try:
        cfg = engine.bases.config("tiny")
        # a full fine-tune reads its own copy of the weights, never the base's
        full = memory_budget.model_bytes(
            cfg, torch.float32, lora_rank=0, keep_versions=2, base_loaded=True
        )
        reading(monkeypatch, full - 1)
        with pytest.raises(ResourceExhaustedError, match=r"needs about [\d.,]+ MiB .* MiB is free"):
            engine.create_model(_spec("big", 0)).result(timeout=30)
        assert not engine.bases.loaded("tiny", torch.float32)  # not even the base weights
        assert not engine.has_model("big")
        # the worker keeps serving: a LoRA model fits the same memory, and works
        engine.create_model(_spec("small", 4)).result(timeout=30)
        assert engine.has_model("small")
        # the base is loaded now; a full fine-tune still needs its own tensors
        with_base = memory_budget.model_bytes(
            cfg, torch.float32, lora_rank=0, keep_versions=2, base_loaded=True
        )
        reading(monkeypatch, with_base)
        engine.create_model(_spec("big", 0)).result(timeout=30)
        assert engine.has_model("big")
    finally:
        engine.stop()


def test_the_flags_carry_the_fraction_and_check_its_range(tmp_path: Path) -> None:
    import argparse

    from treadle.errors import InvalidArgumentError
    from treadle.server.config import ServerConfig
    from treadle.workers.engine.flags import (
        add_engine_flags,
        check_engine_settings,
        engine_config,
        engine_settings,
    )

    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    defaults = engine_settings(parser.parse_args(["--device", "cpu"]))
    assert (defaults["sampler_slots"], defaults["kv_cache_memory_fraction"]) == (0, 0.0)
    args = ["--device", "cpu", "--kv-cache-memory-fraction", "0.3"]
    made = engine_config(
        ServerConfig(data_dir=tmp_path, **engine_settings(parser.parse_args(args))), {}, None
    )
    assert made.kv_cache_memory_fraction == 0.3
    with pytest.raises(InvalidArgumentError, match="kv_cache_memory_fraction: out of range"):
        ServerConfig(data_dir=tmp_path, **{**defaults, "kv_cache_memory_fraction": 1.5})
    with pytest.raises(InvalidArgumentError, match="sampler_slots: out of range"):
        check_engine_settings(replace(made, sampler_slots=-1))


def test_a_lora_model_on_shards_held_here_needs_no_whole_base(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a group's rank 0 that keeps only its shards of a sharded base (vLLM samples):
    # the whole base is not loaded, and a new LoRA model reads the shards held already
    bases = BaseModelRegistry({"tiny": tiny_model_dir})
    spec = _spec("lora", 4)
    adapter_only = memory_budget.model_bytes(
        bases.config("tiny"), torch.float32, lora_rank=4, keep_versions=2, base_loaded=True
    )
    reading(monkeypatch, adapter_only)
    sampler = InlineTorchBackend(SamplerLimits())
    memory_budget.check_model(spec, bases, 2, sampler, base_held=True)
    with pytest.raises(ResourceExhaustedError):  # the whole base would be read first
        memory_budget.check_model(spec, bases, 2, sampler)


GPU, HOST = torch.device("cuda"), torch.device("cpu")


def _backends() -> dict[str, KeepsVersions]:
    limits = SamplerLimits()
    return {
        "torch": InlineTorchBackend(limits),
        "torch-thread": ThreadTorchBackend(limits),
        "torch-process": ProcessTorchBackend(limits),
        "vllm": VllmBackend(limits, VllmSettings()),
    }


def test_each_backend_says_which_memory_a_kept_version_takes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The torch samplers clone on the device; the sampler process's shared buffer
    and vLLM's file in /dev/shm are host RAM (none of it the GPU's)."""
    got = {name: (b.version_memory(GPU), b.version_memory(HOST)) for name, b in _backends().items()}
    assert got == {
        "torch": (GPU, HOST),
        "torch-thread": (GPU, HOST),
        "torch-process": (HOST, HOST),
        "vllm": (HOST, HOST) if Path("/dev/shm").is_dir() else (None, None),
    }
    # no /dev/shm: vLLM's files go to the temporary directory, taken as a disk's
    monkeypatch.setattr("treadle.workers.vllm.full._scratch_parent", lambda: None)
    assert _backends()["vllm"].version_memory(GPU) is None


def _readings(monkeypatch: pytest.MonkeyPatch, **free: int) -> None:
    monkeypatch.setattr(memory_budget, "free_bytes", lambda device: free[device.type])


def test_a_full_fine_tune_counts_its_versions_where_the_backend_keeps_them(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a GPU worker the torch sampler's versions are device tensors, vLLM's are
    files in host RAM: a GPU with room for the model but not its versions takes it
    under vLLM, and the host's free memory bounds vLLM's versions instead."""
    monkeypatch.setattr("treadle.workers.vllm.full._scratch_parent", lambda: Path("/dev/shm"))
    backends = _backends()
    cfg = BaseModelRegistry({"tiny": tiny_model_dir}).config("tiny")
    one = memory_budget.version_bytes(cfg, torch.float32, lora_rank=0)
    alone = memory_budget.model_bytes(
        cfg, torch.float32, lora_rank=0, keep_versions=0, base_loaded=True
    )
    on_gpu = BaseModelRegistry({"tiny": tiny_model_dir}, device=GPU)  # no weights read
    full = _spec("full", 0)
    _readings(monkeypatch, cuda=alone, cpu=2 * one)
    memory_budget.check_model(full, on_gpu, 2, backends["vllm"])
    with pytest.raises(ResourceExhaustedError, match="on cuda"):
        memory_budget.check_model(full, on_gpu, 2, backends["torch"])
    _readings(monkeypatch, cuda=alone + 2 * one, cpu=0)
    memory_budget.check_model(full, on_gpu, 2, backends["torch"])
    # vLLM's versions need the host's RAM: refused there, naming them
    _readings(monkeypatch, cuda=10 * alone, cpu=2 * one - 1)
    with pytest.raises(ResourceExhaustedError, match=r"on cpu \(2 published versions\).*--keep-v"):
        memory_budget.check_model(full, on_gpu, 2, backends["vllm"])
    # a LoRA version is an adapter copy on the device, whichever backend samples it
    lora = _spec("lora", 4)
    adapter = memory_budget.model_bytes(
        cfg, torch.float32, lora_rank=4, keep_versions=2, base_loaded=True
    )
    base = cfg.num_params() * 4
    _readings(monkeypatch, cuda=base + adapter - 1, cpu=10 * alone)
    with pytest.raises(ResourceExhaustedError, match="on cuda"):
        memory_budget.check_model(lora, on_gpu, 2, backends["vllm"])
    # on the CPU the host's RAM is the device's memory: every backend counts them there
    on_cpu = BaseModelRegistry({"tiny": tiny_model_dir})
    _readings(monkeypatch, cpu=alone + 2 * one - 1)
    for backend in backends.values():
        with pytest.raises(ResourceExhaustedError, match="on cpu"):
            memory_budget.check_model(full, on_cpu, 2, backend)
        _readings(monkeypatch, cpu=alone + 2 * one)
        memory_budget.check_model(full, on_cpu, 2, backend)
        _readings(monkeypatch, cpu=alone + 2 * one - 1)
