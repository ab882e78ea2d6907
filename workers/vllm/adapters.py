"""Published LoRA versions as vLLM adapters.

Every published LoRA version (one ``LoraAdapter`` object in a
``WeightSnapshot``) becomes one vLLM adapter: a PEFT directory written from
its tensors (``adapter_config.json`` + ``adapter_model.safetensors``, the same
files ``treadle export`` writes) and a new integer id, never reused, so vLLM's
adapter cache can never serve an older version's weights under a newer id.
Rows of any number of adapters and versions share vLLM's batches (its
multi-LoRA kernels). A version the engine released (``release``) is unloaded
from vLLM and its directory removed once no running sample reads it.

Not thread-safe: the backend's loop thread owns it.
"""

from __future__ import annotations

import shutil
import tempfile
import weakref
from dataclasses import dataclass, field
from pathlib import Path

from treadle.workers.model.lora import LoraAdapter
from treadle.workers.trainer.export import write_peft


@dataclass
class VllmAdapter:
    lora_id: int
    name: str
    path: Path
    model_id: str
    version: int
    users: int = 0  # running samples that read it
    released: bool = False
    ref: weakref.ref[LoraAdapter] | None = field(default=None, repr=False)


class AdapterRegistry:
    """The adapters of one vLLM engine, under ``root`` (a temporary directory made
    when the first adapter is written, removed by ``close``)."""

    def __init__(self, base_name: str, root: Path | None = None) -> None:
        self.base_name = base_name
        self._root = root
        self._next_id = 1
        self._by_object: dict[int, VllmAdapter] = {}  # id(LoraAdapter) -> adapter
        self.loaded = 0  # adapters written (metrics, tests)
        self.unloaded = 0

    def adapter_for(self, model_id: str, version: int, lora: LoraAdapter) -> VllmAdapter:
        """The vLLM adapter of this published version, written on first use."""
        known = self._by_object.get(id(lora))
        if known is not None and known.ref is not None and known.ref() is lora:
            return known
        lora_id = self._next_id
        self._next_id += 1
        path = self.root() / f"{lora_id}"
        write_peft(lora, path, self.base_name)
        adapter = VllmAdapter(lora_id, f"{model_id}/v/{version}#{lora_id}", path, model_id, version)
        adapter.ref = weakref.ref(lora)
        self._by_object[id(lora)] = adapter
        self.loaded += 1
        return adapter

    def release(self, model_id: str, versions: set[int]) -> None:
        for a in self._by_object.values():
            if a.model_id == model_id and a.version in versions:
                a.released = True

    def collectable(self) -> list[VllmAdapter]:
        """Released (or garbage-collected) adapters no running sample reads: forgotten
        here, their directories removed; the caller unloads them from vLLM."""
        gone = [
            a
            for a in self._by_object.values()
            if a.users == 0 and (a.released or a.ref is None or a.ref() is None)
        ]
        for a in gone:
            self._by_object = {k: v for k, v in self._by_object.items() if v is not a}
            shutil.rmtree(a.path, ignore_errors=True)
            self.unloaded += 1
        return gone

    def root(self) -> Path:
        if self._root is None:
            self._root = Path(tempfile.mkdtemp(prefix="treadle-vllm-lora-"))
        return self._root

    def close(self) -> None:
        if self._root is not None:
            shutil.rmtree(self._root, ignore_errors=True)
            self._root = None
        self._by_object.clear()
