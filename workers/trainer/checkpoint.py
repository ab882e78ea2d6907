"""Training state on disk: weights + optimizer state + step, as safetensors plus
a JSON manifest, so a checkpoint is readable without treadle.

    <dir>/manifest.json          format, base model, LoRA rank/alpha, dtype, step, seq_id
    <dir>/weights.safetensors    trainable tensors (PEFT names for LoRA, HF names for full)
    <dir>/optimizer.safetensors  AdamW exp_avg.* / exp_avg_sq.*
    <dir>/adapter_config.json    (LoRA) PEFT's config, so the weights load as an adapter
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from treadle.common.engine.domain import LoadResult, SaveResult
from treadle.common.manifest import FORMAT, read_manifest
from treadle.errors import FailedPreconditionError
from treadle.workers.device import device
from treadle.workers.model import streamed_file
from treadle.workers.trainer.trainer import TrainingModel
from treadle.workers.trainer.whole import MOMENTS, WEIGHTS, WholeTensors


def save_state(
    model: TrainingModel,
    directory: str | Path,
    seq_id: int,
    tensors: WholeTensors | None = None,
) -> SaveResult:
    """Write atomically: into a sibling temp dir, then rename over ``directory``.

    A full fine-tune's weights and Adam moments are written one tensor at a time
    as ``tensors`` gives them whole (on a group, each gathered in turn, so rank 0
    holds one whole tensor beyond its shards, never the whole model; default: the
    model's own, held whole); a LoRA model's adapter and moments (whole on every
    rank) at once. The files are the same either way."""
    final = Path(directory)
    tmp = final.with_name(final.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    if model.adapter is None:
        source = tensors if tensors is not None else WholeTensors(model, moments=True)
        weights_file = tmp / "weights.safetensors"
        streamed_file.write(weights_file, source.entries(WEIGHTS), source.weights())
        optim_file = tmp / "optimizer.safetensors"
        streamed_file.write(optim_file, source.entries(MOMENTS), source.moments())
    else:
        weights = device.host_copies(model.trainable)
        save_file(weights, str(tmp / "weights.safetensors"))
        optim = device.host_copies(model.optimizer.state_tensors())
        save_file(optim, str(tmp / "optimizer.safetensors"))
    spec = model.spec
    manifest = {
        "format": FORMAT,
        "base_model": spec.base_model,
        "lora_rank": spec.lora_rank,
        "lora_alpha": spec.lora_alpha or float(spec.lora_rank),
        "train_attn": spec.train_attn,
        "train_mlp": spec.train_mlp,
        "train_unembed": spec.train_unembed,
        "dtype": spec.dtype,
        "seed": spec.seed,
        "step": model.version,
        "optimizer_step": model.optimizer.step_count,
        "seq_id": seq_id,
        "model_id": spec.model_id,
        "created_at": time.time(),
    }
    (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2))
    if model.adapter is not None:
        (tmp / "adapter_config.json").write_text(
            json.dumps(
                {**model.adapter.peft_config(), "base_model_name_or_path": spec.base_model},
                indent=2,
            )
        )
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    size = sum(f.stat().st_size for f in final.iterdir())
    return SaveResult(step=model.version, seq_id=seq_id, size_bytes=size)


def load_state(
    model: TrainingModel, directory: str | Path, *, optimizer: bool = True
) -> LoadResult:
    """Replace the model's trainable weights, optimizer state and step.

    Without ``optimizer`` (or from a weights-only checkpoint, one without
    ``optimizer.safetensors``) the weights and step are loaded and the Adam
    moments start fresh, as the tinker SDK's ``load_state`` documents.
    """
    return apply_state(model, read_state(model, directory, optimizer=optimizer))


@dataclass(frozen=True)
class ReadState:
    """A checkpoint read and checked against a model, not yet applied."""

    manifest: dict[str, Any]
    weights: dict[str, torch.Tensor]
    optim: dict[str, torch.Tensor] | None


def read_state(model: TrainingModel, directory: str | Path, *, optimizer: bool) -> ReadState:
    """``load_state``'s reading and every check, changing nothing."""
    manifest = read_manifest(directory)
    spec = model.spec
    if manifest["base_model"] != spec.base_model or int(manifest["lora_rank"]) != spec.lora_rank:
        raise FailedPreconditionError(
            f"path: checkpoint is for base {manifest['base_model']!r} rank {manifest['lora_rank']}, "
            f"model is base {spec.base_model!r} rank {spec.lora_rank}"
        )
    weights = load_file(str(Path(directory) / "weights.safetensors"))
    optim_file = Path(directory) / "optimizer.safetensors"
    optim = load_file(str(optim_file)) if optimizer and optim_file.exists() else None
    missing = sorted(set(model.trainable) - set(weights))
    extra = sorted(set(weights) - set(model.trainable))
    if extra:
        raise FailedPreconditionError(
            f"path: checkpoint adapts modules this model does not ({extra[:3]}); "
            "create the model from the state instead (from_state)"
        )
    if missing:
        raise FailedPreconditionError(f"path: checkpoint lacks tensors {missing[:3]}")
    return ReadState(manifest, weights, optim)


@torch.no_grad()
def apply_state(model: TrainingModel, state: ReadState) -> LoadResult:
    """Put a ``read_state`` into the model (held whole)."""
    for name, param in model.trainable.items():
        param.copy_(state.weights[name].to(dtype=param.dtype))
        param.grad = None
    if state.optim is None:
        model.optimizer.reset_moments()
    else:
        model.optimizer.load_state_tensors(state.optim, int(state.manifest["optimizer_step"]))
    model.version = int(state.manifest["step"])
    return LoadResult(step=model.version)
