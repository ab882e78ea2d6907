"""A training model's weights as files other tools load, without treadle.

    PEFT adapter (LoRA):   adapter_config.json + adapter_model.safetensors (PEFT names)
    merged checkpoint:     config.json + model.safetensors (HF names, ``W + scale * B A``
                           folded in for LoRA) + the base model's tokenizer files

so ``peft.PeftModel.from_pretrained(base, dir)`` or
``transformers.AutoModelForCausalLM.from_pretrained(dir)`` reads them as they are.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors.torch import save_file

from treadle.errors import InvalidArgumentError
from treadle.workers.device import device
from treadle.workers.model import streamed_file
from treadle.workers.model.loading import SINGLE_FILE, save_config
from treadle.workers.model.lora import LoraAdapter
from treadle.workers.trainer.trainer import TrainingModel
from treadle.workers.trainer.whole import WEIGHTS, WholeTensors

#: the embedding's HF name (a tied head's merged copy follows it)
EMBED = "model.embed_tokens.weight"

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
#: Files of the base model copied beside a merged checkpoint (those that exist).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "generation_config.json",
)


@torch.no_grad()
def export_peft(model: TrainingModel, out_dir: str | Path) -> list[Path]:
    if model.adapter is None:
        raise InvalidArgumentError(
            "merged: the model is a full fine-tune and has no adapter; export it with merged=True"
        )
    return write_peft(model.adapter, out_dir, model.spec.base_model)


@torch.no_grad()
def write_peft(adapter: LoraAdapter, out_dir: str | Path, base_model: str) -> list[Path]:
    """One adapter as a PEFT directory (also how the vLLM sampler backend loads a version)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = device.host_copies(dict(adapter.named_tensors()))
    save_file(tensors, str(out / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    config = {
        **adapter.peft_config(),
        "base_model_name_or_path": base_model,
        "inference_mode": True,
    }
    (out / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return [out / ADAPTER_CONFIG, out / ADAPTER_WEIGHTS]


@torch.no_grad()
def export_merged(
    model: TrainingModel, out_dir: str | Path, tensors: WholeTensors | None = None
) -> list[Path]:
    """The merged checkpoint, written one tensor at a time as ``tensors`` gives them
    whole (on a group, each gathered in turn: rank 0 never holds the whole model;
    default: the model's own, held whole), each merged with the adapter there."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    source = tensors if tensors is not None else WholeTensors(model)
    cfg = model.cfg
    entries = source.entries(WEIGHTS)
    named: Iterable[tuple[str, torch.Tensor]] = source.weights()
    adapter = model.adapter
    if adapter is not None:
        tied = all(e.name != "lm_head.weight" for e in entries)
        named = adapter.merged(named, tied=tied)
        if tied and adapter.adapts_head:  # its own head now, after the embedding
            at = next(i for i, e in enumerate(entries) if e.name == EMBED) + 1
            entries.insert(at, dataclasses.replace(entries[at - 1], name="lm_head.weight"))
            cfg = dataclasses.replace(cfg, tie_word_embeddings=False)
    streamed_file.write(out / SINGLE_FILE, entries, named, metadata={"format": "pt"})
    save_config(cfg, entries[0].dtype, out)
    written = [out / "config.json", out / SINGLE_FILE]
    for name in TOKENIZER_FILES:
        src = model.base.path / name
        if src.is_file():
            shutil.copyfile(src, out / name)
            written.append(out / name)
    return written
