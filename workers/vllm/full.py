"""Full fine-tune versions on vLLM: one engine per full fine-tune model, its
versions swapped into that engine's weights through vLLM's weight-reload API.

A full fine-tune's version is a whole set of weights, and a vLLM engine holds
one, so each full fine-tune model being sampled gets an engine of its own
(``--vllm-max-full-models`` at once; an idle one is closed to make room), and
the base model's engine stays shared by the base and every LoRA tenant. In its
engine a model's versions take turns:

* the engine holds one version (``loaded``); rows of that version run;
* a row of another version waits (``waiting``), and once a row waits, new rows
  of the held version wait behind it too, so no version starves;
* a version is a safetensors checkpoint directory (``WeightsFile``, in
  ``/dev/shm`` where it exists), written when ``sync_weights`` publishes it, one
  tensor at a time as they come (``keep_version``: on a worker group, as rank 0
  gathers them from the shards), so the process keeps none of its tensors;
* when no row runs, the first waiting row's version is loaded in place from its
  directory with ``collective_rpc("reload_weights", weights_path=...)`` (vLLM's
  public worker call that reloads weights for RL: its loader reads the file one
  tensor at a time into vLLM's own weights, each tensor-parallel worker taking
  its part), then the prefix cache is reset, so no prompt KV computed under
  other weights is reused, and every waiting row of that version is sent (a
  version held in memory, one shipped here from another worker, is written to a
  scratch directory first);
* an in-flight update (``sync_weights(inflight=True)``) moves the model's
  ``latest`` rows to the new version: they are aborted and wait for it with
  the tokens they have, and continue under it from their next token (their
  context recomputed under the new weights); the version of every token is
  recorded as it is sampled, so the spans show the switch. Rows pinned to the
  old version finish under it first.

Not thread-safe: the backend's loop thread owns it.
"""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from treadle.common.engine.model_config import ModelConfig
from treadle.workers.engine.base_models import BaseModel
from treadle.workers.engine.versions import WeightSnapshot
from treadle.workers.model.loading import save_params
from treadle.workers.model.published import (
    WeightsFile,
    WholeWeights,
    remove_orphans,
    version_dir,
)
from treadle.workers.vllm.rows import VllmRow

log = logging.getLogger("treadle.vllm")


def is_full(weights: WeightSnapshot, base: BaseModel) -> bool:
    """Whether ``weights`` is a full fine-tune's (its own weights, no adapter); never
    reads the base's weights (nor a version's file) to tell."""
    return weights.adapter is None and not weights.on_base(base)


def keep_version(weights: WholeWeights) -> WeightsFile:
    """A full fine-tune's published version as the directory vLLM reloads it from,
    each tensor written as it comes (``VllmBackend.keep_weights``)."""
    return WeightsFile.write(weights, _scratch_parent())


def version_memory() -> torch.device | None:
    """The memory a version's file (``keep_version``) takes: the host's RAM when it
    is in ``/dev/shm`` (a tmpfs), none when it is on the system's temporary directory
    (taken as a disk's)."""
    return torch.device("cpu") if _scratch_parent() is not None else None


def remove_orphan_versions() -> None:
    """Versions left by a process killed before it removed them (``remove_orphans``)."""
    for path in remove_orphans(_scratch_parent()):
        log.info("vllm: removed %s, left by a process that is gone", path)


def _scratch_parent() -> Path | None:
    shm = Path("/dev/shm")
    return shm if shm.is_dir() else None


def _scratch() -> Path:
    return version_dir("scratch", _scratch_parent())


class FullVersions:
    """Which version of one full fine-tune model its engine holds, and the rows waiting
    for another."""

    def __init__(self, model_id: str, cfg: ModelConfig) -> None:
        self.model_id = model_id
        self.cfg = cfg
        self.loaded: WeightSnapshot | None = None  # None: the engine holds the base weights
        self.waiting: list[VllmRow] = []
        self.swaps = 0
        self.swap_s = 0.0
        self.last_used = time.monotonic()
        self._dir: Path | None = None

    def holds(self, weights: WeightSnapshot) -> bool:
        return self.loaded is not None and self.loaded.weights is weights.weights

    def admit(self, row: VllmRow) -> bool:
        """Whether the row may be sent now (else it waits)."""
        self.last_used = time.monotonic()
        if not self.waiting and self.holds(row.weights):
            return True
        self.waiting.append(row)
        return False

    def requeue(self, rows: list[VllmRow]) -> None:
        """Rows moved to new weights: they wait first, ahead of later arrivals."""
        self.waiting[:0] = rows

    def next_rows(self, llm: Any, running: int) -> list[VllmRow]:
        """When nothing runs: the waiting rows of the next version, its weights loaded."""
        if running or not self.waiting:
            return []
        weights = self.waiting[0].weights
        if not self.holds(weights):
            self._load(llm, weights)
        ready = [r for r in self.waiting if r.weights.weights is weights.weights]
        self.waiting = [r for r in self.waiting if r.weights.weights is not weights.weights]
        return ready

    def drop(self, rows: list[VllmRow]) -> None:
        gone = {id(r) for r in rows}
        self.waiting = [r for r in self.waiting if id(r) not in gone]

    def _load(self, llm: Any, weights: WeightSnapshot) -> None:
        t0 = time.perf_counter()
        scratch = None
        if isinstance(weights.weights, WeightsFile):  # written when it was published
            path = weights.weights.directory
        else:  # in memory (shipped here from another worker): written now
            path = scratch = _scratch()
        try:
            if scratch is not None:
                save_params(weights.params, self.cfg, scratch)
            llm.collective_rpc("reload_weights", kwargs={"weights_path": str(path)})
            llm.reset_prefix_cache()
        except BaseException:
            if scratch is not None:
                shutil.rmtree(scratch, ignore_errors=True)
            raise
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
        self._dir, self.loaded = scratch, weights
        self.swaps += 1
        self.swap_s += time.perf_counter() - t0
        log.info(
            "vllm: %s v%d loaded into its engine in %.2f s",
            self.model_id,
            weights.version,
            time.perf_counter() - t0,
        )

    def close(self) -> None:
        self.loaded = None
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None
