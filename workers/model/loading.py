"""Reading and writing HF-format checkpoints (``config.json`` + safetensors).

The engine loads weights itself, without instantiating a transformers model:
``safe_open`` reads only the tensors the config calls for, straight into the
requested dtype, from one ``model.safetensors`` or the shards listed in
``model.safetensors.index.json``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor

from treadle.common.engine.model_config import ModelConfig
from treadle.errors import InvalidArgumentError
from treadle.workers.device.device import host_copies
from treadle.workers.model.llama import LlamaParams, param_shapes

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

#: Tensors some checkpoints carry that the forward recomputes or never uses.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def load_config(model_dir: str | Path) -> ModelConfig:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise InvalidArgumentError(f"model_dir: {path} does not exist")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise InvalidArgumentError(f"model_dir: {path} is not valid JSON ({e})") from None
    return ModelConfig.from_hf_dict(raw)


def _weight_files(model_dir: Path) -> dict[str, Path]:
    """HF tensor name -> the safetensors file holding it."""
    single = model_dir / SINGLE_FILE
    index = model_dir / INDEX_FILE
    if single.is_file():
        with safe_open(str(single), framework="pt") as f:
            return {name: single for name in f.keys()}  # noqa: SIM118 (safe_open is no dict)
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = {name: model_dir / shard for name, shard in weight_map.items()}
        absent = sorted({str(p.name) for p in files.values() if not p.is_file()})
        if absent:
            raise InvalidArgumentError(f"model_dir: shards {absent} listed in {index} are missing")
        return files
    raise InvalidArgumentError(f"model_dir: {model_dir} has neither {SINGLE_FILE} nor {INDEX_FILE}")


def load_checkpoint(
    model_dir: str | Path,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> tuple[ModelConfig, LlamaParams]:
    """Config and weights of a HF checkpoint directory, weights cast to ``dtype``.

    A tied checkpoint that still stores ``lm_head.weight`` loads fine (the copy
    is dropped); any other tensor the config does not explain is an error, as
    it means the checkpoint is a variant this forward does not implement.
    """
    model_dir = Path(model_dir)
    cfg = load_config(model_dir)
    files = _weight_files(model_dir)
    wanted = param_shapes(cfg)
    unexpected = [
        n
        for n in files
        if n not in wanted
        and not n.endswith(_IGNORED_SUFFIXES)
        and not (n == "lm_head.weight" and cfg.tie_word_embeddings)
    ]
    if unexpected:
        raise InvalidArgumentError(
            f"model_dir: tensors {unexpected[:5]} are not part of a {cfg.arch} model"
        )
    missing = [n for n in wanted if n not in files]
    if missing:
        raise InvalidArgumentError(f"model_dir: {model_dir} lacks tensors {missing[:5]}")

    by_file: dict[Path, list[str]] = {}
    for name in wanted:
        by_file.setdefault(files[name], []).append(name)
    tensors: dict[str, Tensor] = {}
    for path, names in by_file.items():
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in names:
                tensors[name] = f.get_tensor(name).to(dtype=dtype, device=device)
    return cfg, LlamaParams.from_state_dict(cfg, tensors)


def save_params(params: LlamaParams, cfg: ModelConfig, out_dir: str | Path) -> Path:
    """Write ``config.json`` + ``model.safetensors`` (HF names), a checkpoint both
    ``load_checkpoint`` and transformers' ``from_pretrained`` read back."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = host_copies(dict(params.named_tensors()))
    save_file(tensors, str(out / SINGLE_FILE), metadata={"format": "pt"})
    save_config(cfg, params.dtype, out)
    return out


def save_config(cfg: ModelConfig, dtype: torch.dtype, out_dir: Path) -> Path:
    """``config.json`` of a checkpoint in ``out_dir`` whose weights are ``dtype``."""
    hf = cfg.to_hf_dict() | {"dtype": str(dtype).removeprefix("torch.")}
    path = out_dir / "config.json"
    path.write_text(json.dumps(hf, indent=2) + "\n")
    return path
