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
from pathlib import Path

import torch
from safetensors.torch import save_file

from treadle.errors import InvalidArgumentError
from treadle.workers.device import device
from treadle.workers.model.llama import LlamaParams
from treadle.workers.model.loading import save_params
from treadle.workers.model.lora import LoraAdapter
from treadle.workers.trainer.trainer import TrainingModel

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
def export_merged(model: TrainingModel, out_dir: str | Path) -> list[Path]:
    out = Path(out_dir)
    cfg = model.cfg
    if model.adapter is not None:
        tensors = model.adapter.merge_into(model.params)
        if "lm_head.weight" in tensors and cfg.tie_word_embeddings:
            cfg = dataclasses.replace(cfg, tie_word_embeddings=False)  # the head was adapted
        params = LlamaParams.from_state_dict(cfg, tensors)
    else:
        params = model.params
    save_params(params, cfg, out)
    written = [out / "config.json", out / "model.safetensors"]
    for name in TOKENIZER_FILES:
        src = model.base.path / name
        if src.is_file():
            shutil.copyfile(src, out / name)
            written.append(out / name)
    return written
