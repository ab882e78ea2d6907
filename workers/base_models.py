"""Base models a worker serves: loaded once per (name, dtype), frozen, shared by
every tenant's adapter and by the sampler."""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from treadle.errors import InvalidArgumentError, NotFoundError
from treadle.workers.model.config import ModelConfig
from treadle.workers.model.llama import LlamaParams
from treadle.workers.model.loading import load_checkpoint, load_config

DTYPES: Mapping[str, torch.dtype] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
}


def parse_dtype(name: str, field: str = "dtype") -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise InvalidArgumentError(
            f"{field}: unknown dtype {name!r}; choose from {sorted(DTYPES)}"
        ) from None


@dataclass(frozen=True)
class BaseModel:
    name: str
    path: Path
    cfg: ModelConfig
    params: LlamaParams
    dtype: torch.dtype


class BaseModelRegistry:
    def __init__(
        self, model_dirs: Mapping[str, str | Path], device: torch.device | None = None
    ) -> None:
        self.model_dirs = {name: Path(p) for name, p in model_dirs.items()}
        #: where the weights are loaded (``workers.device``)
        self.device = device or torch.device("cpu")
        self._loaded: dict[tuple[str, torch.dtype], BaseModel] = {}
        self._configs: dict[str, ModelConfig] = {}
        self._lock = threading.Lock()

    def names(self) -> list[str]:
        return sorted(self.model_dirs)

    def path(self, name: str) -> Path:
        if name not in self.model_dirs:
            raise NotFoundError(f"base_model: {name!r} is not served here; served: {self.names()}")
        return self.model_dirs[name]

    def config(self, name: str) -> ModelConfig:
        path = self.path(name)
        with self._lock:
            if name not in self._configs:
                self._configs[name] = load_config(path)
            return self._configs[name]

    def loaded(self, name: str, dtype: torch.dtype) -> bool:
        """Whether ``name``'s weights in ``dtype`` are in memory already."""
        with self._lock:
            return (name, dtype) in self._loaded

    def get(self, name: str, dtype: torch.dtype) -> BaseModel:
        path = self.path(name)
        with self._lock:
            key = (name, dtype)
            if key not in self._loaded:
                cfg, params = load_checkpoint(path, dtype=dtype, device=self.device)
                params.requires_grad_(False)
                self._loaded[key] = BaseModel(name, path, cfg, params, dtype)
            return self._loaded[key]
