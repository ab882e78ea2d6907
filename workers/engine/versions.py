"""Published weight versions: what samplers read.

A model's version is the number of optimizer steps applied (base = 0).
``SyncWeights`` publishes the current weights as that version; the store keeps
the latest K per model and releases older ones. A LoRA version is a copy of
the adapter (small); a full fine-tune version is a copy of every weight, except
its version 0 (before any step), which is the base's weights, read only when a
sampler asks for it (``BaseVersion``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from treadle.errors import NotFoundError
from treadle.workers.engine.base_models import BaseModel
from treadle.workers.model.llama import LlamaParams
from treadle.workers.model.lora import LoraAdapter


@dataclass(frozen=True)
class WeightSnapshot:
    model_id: str | None
    version: int
    params: LlamaParams
    adapter: LoraAdapter | None


@dataclass(frozen=True)
class BaseVersion:
    """A published version whose weights are the base's (a full fine-tune not yet
    stepped): the base is read when a sampler first asks for it, not at publish."""

    model_id: str
    version: int
    base: BaseModel

    def resolve(self) -> WeightSnapshot:
        return WeightSnapshot(self.model_id, self.version, self.base.params, None)


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
            entry = entry.resolve()  # the base loads here, once; kept in its place
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
