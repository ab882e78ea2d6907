"""The engine's scheduler: pure bookkeeping of ordered calls, no I/O, no torch.

It keeps, per training model, the next expected ``seq_id``, the calls waiting for
their turn, and the recorded outcome of applied calls (so a retry returns the
same result and applies nothing). ``schedule()`` hands the engine work units:
each unit is a contiguous run of one model's calls, ending at the model's next
barrier (SkyRL's "batch forward passes up to the next barrier"), so everything
in a unit may be executed together and nothing overtakes a barrier. Models are
served in turn, tenant by tenant, never first-come-first-served across tenants.

Engine step, as in vLLM: ``schedule()`` -> execute -> ``complete()``.
"""

from __future__ import annotations

import enum
from collections import OrderedDict, deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from treadle.workers.domain import BARRIER_KINDS


@dataclass
class OrderedCall:
    model_id: str
    seq_id: int
    kind: str
    digest: str
    arrived_at: float
    handle: Any = None  # opaque to the scheduler (the engine's future)
    payload: Any = None  # opaque (the op)
    followers: list[Any] = field(default_factory=list)  # handles of in-flight repeats

    @property
    def is_barrier(self) -> bool:
        return self.kind in BARRIER_KINDS


class Admission(enum.Enum):
    QUEUED = "queued"
    DUPLICATE_DONE = "duplicate_done"  # already applied: answer with the recorded outcome
    DUPLICATE_PENDING = "duplicate_pending"  # same call still waiting: share its outcome
    CONFLICT = "conflict"  # seq_id reused with another payload
    EXPIRED = "expired"  # seq_id applied too long ago to still hold its outcome
    UNKNOWN_MODEL = "unknown_model"


@dataclass(frozen=True)
class SubmitOutcome:
    admission: Admission
    recorded: Any = None
    message: str = ""


@dataclass(frozen=True)
class WorkUnit:
    model_id: str
    calls: tuple[OrderedCall, ...]


@dataclass(frozen=True)
class SchedulerOutput:
    units: tuple[WorkUnit, ...]
    timed_out: tuple[OrderedCall, ...]


@dataclass
class _ModelQueue:
    tenant_id: str
    next_seq_id: int
    waiting: dict[int, OrderedCall] = field(default_factory=dict)
    running: dict[int, OrderedCall] = field(default_factory=dict)
    recorded: OrderedDict[int, tuple[str, Any]] = field(default_factory=OrderedDict)


class Scheduler:
    def __init__(self, *, gap_timeout_s: float = 60.0, results_kept: int = 4096) -> None:
        self.gap_timeout_s = gap_timeout_s
        self.results_kept = results_kept
        self._models: dict[str, _ModelQueue] = {}
        self._tenant_order: deque[str] = deque()

    # ---- models ---------------------------------------------------------------

    def add_model(self, model_id: str, tenant_id: str, next_seq_id: int = 1) -> None:
        self._models[model_id] = _ModelQueue(tenant_id=tenant_id, next_seq_id=next_seq_id)
        if tenant_id not in self._tenant_order:
            self._tenant_order.append(tenant_id)

    def remove_model(self, model_id: str) -> list[OrderedCall]:
        """Forget a model; returns its waiting calls so the engine can fail them."""
        queue = self._models.pop(model_id, None)
        if queue is None:
            return []
        if not any(q.tenant_id == queue.tenant_id for q in self._models.values()):
            self._tenant_order.remove(queue.tenant_id)
        return [*queue.running.values(), *queue.waiting.values()]

    def has_model(self, model_id: str) -> bool:
        return model_id in self._models

    def next_seq_id(self, model_id: str) -> int:
        return self._models[model_id].next_seq_id

    # ---- calls ----------------------------------------------------------------

    def submit(self, call: OrderedCall) -> SubmitOutcome:
        queue = self._models.get(call.model_id)
        if queue is None:
            return SubmitOutcome(
                Admission.UNKNOWN_MODEL, message=f"model {call.model_id} not found"
            )
        if call.seq_id < queue.next_seq_id:
            recorded = queue.recorded.get(call.seq_id)
            if recorded is None:
                return SubmitOutcome(
                    Admission.EXPIRED,
                    message=f"seq_id {call.seq_id} was applied long ago; its result is no longer kept",
                )
            digest, outcome = recorded
            if digest != call.digest:
                return SubmitOutcome(Admission.CONFLICT, message=_conflict(call.seq_id))
            return SubmitOutcome(Admission.DUPLICATE_DONE, recorded=outcome)
        waiting = queue.waiting.get(call.seq_id) or queue.running.get(call.seq_id)
        if waiting is not None:
            if waiting.digest != call.digest:
                return SubmitOutcome(Admission.CONFLICT, message=_conflict(call.seq_id))
            waiting.followers.append(call.handle)
            return SubmitOutcome(Admission.DUPLICATE_PENDING)
        queue.waiting[call.seq_id] = call
        return SubmitOutcome(Admission.QUEUED)

    def schedule(self, now: float) -> SchedulerOutput:
        """One unit per model with ready work, tenants taken in turn."""
        timed_out = self._expire(now)
        units: list[WorkUnit] = []
        for tenant in list(self._tenant_order):
            for model_id, queue in self._models.items():
                if queue.tenant_id != tenant:
                    continue
                unit = self._ready_run(model_id, queue)
                if unit is not None:
                    units.append(unit)
        if units:
            self._tenant_order.rotate(-1)
        return SchedulerOutput(units=tuple(units), timed_out=tuple(timed_out))

    def complete(self, call: OrderedCall, outcome: Any) -> None:
        """Record the outcome of an applied call (a result or an error) and advance."""
        queue = self._models.get(call.model_id)
        if queue is None:
            return
        queue.running.pop(call.seq_id, None)
        queue.recorded[call.seq_id] = (call.digest, outcome)
        while len(queue.recorded) > self.results_kept:
            queue.recorded.popitem(last=False)
        queue.next_seq_id = max(queue.next_seq_id, call.seq_id + 1)

    def reset(self, model_id: str, next_seq_id: int) -> None:
        """Restart a model's sequence (after a restore from a checkpoint)."""
        queue = self._models[model_id]
        queue.next_seq_id = next_seq_id
        queue.recorded = OrderedDict((k, v) for k, v in queue.recorded.items() if k < next_seq_id)

    def has_ready_work(self) -> bool:
        return any(q.next_seq_id in q.waiting for q in self._models.values())

    def next_deadline(self) -> float | None:
        """When the oldest call waiting on a gap times out (for the engine's wait)."""
        arrivals = [c.arrived_at for q in self._models.values() for c in q.waiting.values()]
        return min(arrivals) + self.gap_timeout_s if arrivals else None

    def waiting_calls(self) -> Iterable[OrderedCall]:
        for queue in self._models.values():
            yield from queue.waiting.values()

    # ---- internals ------------------------------------------------------------

    def _ready_run(self, model_id: str, queue: _ModelQueue) -> WorkUnit | None:
        if queue.running:
            return None  # the previous unit has not completed yet
        calls: list[OrderedCall] = []
        seq = queue.next_seq_id
        while seq in queue.waiting:
            call = queue.waiting.pop(seq)
            queue.running[seq] = call
            calls.append(call)
            seq += 1
            if call.is_barrier:
                break
        return WorkUnit(model_id, tuple(calls)) if calls else None

    def _expire(self, now: float) -> list[OrderedCall]:
        expired: list[OrderedCall] = []
        for queue in self._models.values():
            if queue.next_seq_id in queue.waiting:
                continue  # runnable now; the gap is closed
            for seq, call in list(queue.waiting.items()):
                if now - call.arrived_at >= self.gap_timeout_s:
                    expired.append(queue.waiting.pop(seq))
        return expired


def _conflict(seq_id: int) -> str:
    return f"seq_id {seq_id} was already used with a different payload"
