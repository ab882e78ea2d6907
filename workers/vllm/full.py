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
* when no row runs, the first waiting row's version is written as a
  safetensors checkpoint (to ``/dev/shm`` where it exists) and loaded in place
  with ``collective_rpc("reload_weights", weights_path=...)`` (vLLM's public
  worker call that reloads weights for RL), then the prefix cache is reset, so
  no prompt KV computed under other weights is reused, and every waiting row
  of that version is sent;
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
import tempfile
import time
from pathlib import Path
from typing import Any

from treadle.common.engine.model_config import ModelConfig
from treadle.workers.engine.base_models import BaseModel
from treadle.workers.engine.versions import WeightSnapshot
from treadle.workers.model.loading import save_params
from treadle.workers.vllm.rows import VllmRow

log = logging.getLogger("treadle.vllm")


def is_full(weights: WeightSnapshot, base: BaseModel) -> bool:
    """Whether ``weights`` is a full fine-tune's (its own weights, no adapter); never
    loads the base's weights to tell."""
    return weights.adapter is None and not base.holds(weights.params)


def _scratch() -> Path:
    shm = Path("/dev/shm")
    parent = shm if shm.is_dir() else None
    return Path(tempfile.mkdtemp(prefix="treadle-vllm-full-", dir=parent))


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
        return self.loaded is not None and self.loaded.params is weights.params

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
        ready = [r for r in self.waiting if r.weights.params is weights.params]
        self.waiting = [r for r in self.waiting if r.weights.params is not weights.params]
        return ready

    def drop(self, rows: list[VllmRow]) -> None:
        gone = {id(r) for r in rows}
        self.waiting = [r for r in self.waiting if id(r) not in gone]

    def _load(self, llm: Any, weights: WeightSnapshot) -> None:
        t0 = time.perf_counter()
        out = _scratch()
        try:
            save_params(weights.params, self.cfg, out)
            llm.collective_rpc("reload_weights", kwargs={"weights_path": str(out)})
            llm.reset_prefix_cache()
        except BaseException:
            shutil.rmtree(out, ignore_errors=True)
            raise
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
        self._dir, self.loaded = out, weights
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
