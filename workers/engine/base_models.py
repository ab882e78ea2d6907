"""Base models a worker serves: one per (name, dtype), frozen, shared by every
tenant's adapter and by the sampler.

A base's weights are read from its checkpoint the first time something needs
them (a LoRA model, a reference forward, a sampler of the base or of a full
fine-tune's version 0) and kept from then on. A full fine-tune takes its own
copy (``BaseModel.weights_copy``) without loading the base: a worker whose base
serves only full fine-tunes holds each model's weights once, not twice.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from pathlib import Path

import torch

from treadle.common.engine.model_config import ModelConfig
from treadle.errors import InvalidArgumentError, NotFoundError
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


class BaseModel:
    """A base checkpoint at one dtype: its config at once, its weights on first use."""

    def __init__(
        self, name: str, path: Path, cfg: ModelConfig, dtype: torch.dtype, device: torch.device
    ) -> None:
        self.name = name
        self.path = path
        self.cfg = cfg
        self.dtype = dtype
        #: where its weights live (``workers.device.device``), loaded or not
        self.device = device
        self._params: LlamaParams | None = None
        self._lock = threading.Lock()  # samplers on other threads may ask first

    @property
    def params(self) -> LlamaParams:
        """The frozen base weights (read from the checkpoint on first use, then kept)."""
        with self._lock:
            if self._params is None:
                self._params = self._read()
            return self._params

    @property
    def loaded(self) -> bool:
        """Whether the base weights are in memory now."""
        return self._params is not None

    def unload(self) -> None:
        """Drop the whole weights (read again on next use): a rank of a group that
        keeps only its shards of them (``workers.trainer.sharded_base``)."""
        with self._lock:
            self._params = None

    def holds(self, params: LlamaParams) -> bool:
        """Whether ``params`` are the base weights themselves (never loads them)."""
        return self._params is params

    def weights_copy(self) -> LlamaParams:
        """An independent copy of the base weights (a full fine-tune's own): a
        clone of the loaded base, or, when nothing has loaded it, read from the
        checkpoint without keeping the base as well."""
        with self._lock:
            loaded = self._params
        if loaded is not None:
            return loaded.clone()
        return self._read()

    def __getstate__(self) -> dict[str, object]:
        """Sent to a sampler process with its weights (loaded now if they were not),
        which torch shares with it instead of the child reading its own copy."""
        state = dict(self.__dict__, _params=self.params)
        del state["_lock"]
        return state

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def _read(self) -> LlamaParams:
        _, params = load_checkpoint(self.path, dtype=self.dtype, device=self.device)
        params.requires_grad_(False)
        return params


class BaseModelRegistry:
    def __init__(
        self, model_dirs: Mapping[str, str | Path], device: torch.device | None = None
    ) -> None:
        self.model_dirs = {name: Path(p) for name, p in model_dirs.items()}
        #: where the weights are loaded (``workers.device.device``)
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
        """Whether ``name``'s weights in ``dtype`` are in memory already (a base is
        read on first use: ``BaseModel.params``)."""
        with self._lock:
            base = self._loaded.get((name, dtype))
        return base is not None and base.loaded

    def get(self, name: str, dtype: torch.dtype) -> BaseModel:
        path = self.path(name)
        with self._lock:
            key = (name, dtype)
            if key not in self._loaded:
                if name not in self._configs:
                    self._configs[name] = load_config(path)
                cfg = self._configs[name]
                self._loaded[key] = BaseModel(name, path, cfg, dtype, self.device)
            return self._loaded[key]
