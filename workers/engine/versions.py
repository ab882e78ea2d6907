"""Published weight versions: what samplers read.

A model's version is the number of optimizer steps applied (base = 0).
``SyncWeights`` publishes the current weights as that version; the store keeps
the latest K per model and releases older ones. A LoRA version is a copy of
the adapter (small); a full fine-tune version is a copy of every weight (in
memory, or a file: ``workers.model.published``), except its version 0 (before any
step), which is the base's weights, read only when something reads its tensors
(a torch sampler, a reference pass); vLLM loads the base from its checkpoint and
never does.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from treadle.errors import NotFoundError
from treadle.workers.engine.base_models import BaseModel
from treadle.workers.model.llama import LlamaParams
from treadle.workers.model.lora import LoraAdapter
from treadle.workers.model.published import WeightsFile


@dataclass(frozen=True)
class WeightSnapshot:
    """Weights a sampler (or a reference pass) reads: ``weights`` are the tensors in
    memory, or the base's (a ``BaseModel``: its weights read from its checkpoint the
    first time ``params`` is asked for, and kept by the base), or a file
    (``WeightsFile``: read whole each time ``params`` is asked for); ``adapter``:
    a LoRA version's adapter on them."""

    model_id: str | None
    version: int
    weights: LlamaParams | BaseModel | WeightsFile
    adapter: LoraAdapter | None

    @property
    def params(self) -> LlamaParams:
        """The tensors (this reads the base or the file where they are not in memory)."""
        if isinstance(self.weights, BaseModel):
            return self.weights.params
        if isinstance(self.weights, WeightsFile):
            return self.weights.read()
        return self.weights

    @property
    def dtype(self) -> torch.dtype:
        """The weights' dtype (reads nothing)."""
        return self.weights.dtype

    def on_base(self, base: BaseModel) -> bool:
        """Whether the weights are ``base``'s own (reads nothing)."""
        if isinstance(self.weights, BaseModel):
            return self.weights is base
        return isinstance(self.weights, LlamaParams) and base.holds(self.weights)


@dataclass(frozen=True)
class BaseVersion:
    """A published version whose weights are the base's (a full fine-tune not yet
    stepped): nothing is read at publish, nor when the version is asked for (the
    base's weights are read when something reads ``params``)."""

    model_id: str
    version: int
    base: BaseModel

    def resolve(self) -> WeightSnapshot:
        return WeightSnapshot(self.model_id, self.version, self.base, None)


class VersionStore:
    def __init__(self, keep_latest: int = 4) -> None:
        self.keep_latest = max(1, keep_latest)
        self._by_model: dict[str, OrderedDict[int, WeightSnapshot | BaseVersion]] = {}

    def publish(self, snapshot: WeightSnapshot | BaseVersion) -> list[int]:
        """Add (or replace) a version; returns the versions released to stay within K."""
        assert snapshot.model_id is not None
        versions = self._by_model.setdefault(snapshot.model_id, OrderedDict())
        versions.pop(snapshot.version, None)
        versions[snapshot.version] = snapshot
        released = []
        while len(versions) > self.keep_latest:
            old, _ = versions.popitem(last=False)
            released.append(old)
        return released

    def get(self, model_id: str, version: int | None) -> WeightSnapshot:
        """A pinned version, or the latest when ``version`` is None."""
        versions = self._by_model.get(model_id)
        if not versions:
            raise NotFoundError(f"model {model_id} has no published weights")
        if version is None:
            version = next(reversed(versions))
        if version not in versions:
            raise NotFoundError(
                f"weights treadle://{model_id}/v/{version} not found (kept versions: {list(versions)})"
            )
        entry = versions[version]
        if isinstance(entry, BaseVersion):
            entry = entry.resolve()  # once, kept in its place (one object per version)
            versions[version] = entry
        return entry

    def versions(self, model_id: str) -> list[int]:
        return list(self._by_model.get(model_id, {}))

    def drop(self, model_id: str) -> None:
        self._by_model.pop(model_id, None)

    def __len__(self) -> int:
        """Models with versions kept here."""
        return len(self._by_model)


class ReferenceCache:
    """The last few reference weights a model's ``ForwardLogprobs`` loaded from checkpoints.

    A KL loop asks for the same reference every step; reading it again each time
    would cost a checkpoint read per step (a whole model for a full fine-tune).
    Bounded (least recently used goes first) and owned by the training model, so
    deleting or unloading the model releases it. Keys name the checkpoint and
    when it was written, so a state saved again under the same name is re-read.
    """

    def __init__(self, size: int = 2) -> None:
        self.size = max(1, size)
        self._entries: OrderedDict[tuple[object, ...], WeightSnapshot] = OrderedDict()
        self.loads = 0  # how many times ``get`` had to load (tests, metrics)

    def get(self, key: tuple[object, ...], load: Callable[[], WeightSnapshot]) -> WeightSnapshot:
        snap = self._entries.get(key)
        if snap is None:
            snap = load()
            self.loads += 1
            self._entries[key] = snap
            while len(self._entries) > self.size:
                self._entries.popitem(last=False)
        self._entries.move_to_end(key)
        return snap

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        self._entries.clear()
