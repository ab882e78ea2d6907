"""What an engine tells the operator about itself: its device and memory, the
models it holds, and its scheduler's queue per tenant.

A ``treadle worker`` writes its report with each heartbeat (``common.db.workers``),
so every server reads it from the database; the embedded server asks its
in-process engine directly. The fair-share deficits are the engine's own: each
worker runs its own scheduler, so a tenant's deficit is a per-worker figure, never
a fleet total.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from treadle.common.engine.domain import TenantQueue


@dataclass(frozen=True)
class MemoryReading:
    """The device's memory, read when the report was made."""

    used_bytes: int  # held by this process: torch's reserved CUDA memory, or the resident set
    free_bytes: int  # what the device can still hand out (CUDA free, or MemAvailable)
    total_bytes: int  # the device's (or host's) memory; 0: unknown


@dataclass(frozen=True)
class EngineReport:
    device: str  # ``cuda:0``, ``cpu``
    memory: MemoryReading
    models: int  # training models held
    adapters: int  # of them, LoRA adapters (the rest are full fine-tunes)
    #: models trained elsewhere whose shipped versions this engine samples (the pool)
    served: int
    queue: tuple[TenantQueue, ...]  # the scheduler's, as of the engine's latest round


def to_json(report: EngineReport) -> dict[str, Any]:
    """The plain form a heartbeat stores (``workers.report``)."""
    m = report.memory
    return {
        "device": report.device,
        "memory": [m.used_bytes, m.free_bytes, m.total_bytes],
        "models": report.models,
        "adapters": report.adapters,
        "served": report.served,
        "queue": [[q.tenant_id, q.waiting, q.running, q.deficit] for q in report.queue],
    }


def from_json(data: Mapping[str, Any]) -> EngineReport:
    used, free, total = (int(x) for x in data["memory"])
    return EngineReport(
        device=str(data["device"]),
        memory=MemoryReading(used, free, total),
        models=int(data["models"]),
        adapters=int(data["adapters"]),
        served=int(data.get("served", 0)),
        queue=tuple(
            TenantQueue(str(t), int(w), int(r), int(d)) for t, w, r, d in data.get("queue", ())
        ),
    )
