"""The engine's scheduler: pure bookkeeping of ordered calls, no I/O, no torch.

It keeps, per training model, the next expected ``seq_id``, the calls waiting for
their turn, and the recorded outcome of applied calls (so a retry returns the
same result and applies nothing). ``schedule()`` hands the engine work units:
each unit is a contiguous run of one model's calls, ending at the model's next
barrier (SkyRL's "batch forward passes up to the next barrier"), so everything
in a unit may be executed together and nothing overtakes a barrier.

Fair share across tenants is deficit round robin (Shreedhar & Varghese) by
tokens: a call costs the tokens in its batch (barriers cost nothing), each
backlogged tenant earns a quantum per round and spends it on its calls; a
tenant whose queue empties loses what it had saved. The quantum is by default
the largest sum, over one tenant, of its models' head-call costs: the tenant
with the most ready work affords one call of each of its models a round, and
every other tenant earns the same tokens (so a tenant with 8 runs gets one
tenant's share, not 8), spent in the same round. A tenant's share is thus
spent in as few rounds, hence batched passes, as possible: a researcher's
sweep of 8 models runs one call of each in one pass, not one call a pass. A tenant that just became backlogged is served first, in a round of its
own (FQ-CoDel's "new flows" list; never two such rounds in a row, so sparse
tenants cannot starve the rest), so a light tenant waits behind at most the
round already executing, not behind a heavy tenant's backlog, and its calls are
not batched with that backlog. Within a tenant its models take turns, one call
each at a time, so its quantum covers as many of its models as it can pay for.
``policy="fcfs"`` is the first-come-first-served baseline the fairness benchmark
measures against; nothing serves it.

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
    cost: int = 0  # fair-share cost: tokens in the call's batch (barriers ~0)

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

    def head(self) -> OrderedCall | None:
        """The call that may run next, if it has arrived and nothing of the model runs."""
        return None if self.running else self.waiting.get(self.next_seq_id)


@dataclass
class _Tenant:
    models: deque[str] = field(default_factory=deque)  # served in turn
    deficit: int = 0  # tokens earned and not yet spent (DRR)


POLICIES = ("drr", "fcfs")


class Scheduler:
    def __init__(
        self,
        *,
        gap_timeout_s: float = 60.0,
        results_kept: int = 4096,
        quantum_tokens: int = 0,
        max_quantum_tokens: int = 0,
        policy: str = "drr",
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy: {policy!r}; choose from {POLICIES}")
        self.gap_timeout_s = gap_timeout_s
        self.results_kept = results_kept
        #: tokens a backlogged tenant earns per round; 0 = the largest head-call cost
        self.quantum_tokens = quantum_tokens
        #: a cap on the default quantum (0 = none): the most a tenant spends a round,
        #: hence how long a light tenant may wait behind the round running; never
        #: below one head call (1 = one call a round, as before sweeps batched)
        self.max_quantum_tokens = max_quantum_tokens
        self.policy = policy
        self._models: dict[str, _ModelQueue] = {}
        self._tenants: dict[str, _Tenant] = {}
        self._new: deque[str] = deque()  # just became backlogged: served first
        self._old: deque[str] = deque()  # backlogged, already had a turn
        self._new_only_last = False  # the last round served only new tenants

    # ---- models ---------------------------------------------------------------

    def add_model(self, model_id: str, tenant_id: str, next_seq_id: int = 1) -> None:
        self._models[model_id] = _ModelQueue(tenant_id=tenant_id, next_seq_id=next_seq_id)
        tenant = self._tenants.setdefault(tenant_id, _Tenant())
        if model_id not in tenant.models:
            tenant.models.append(model_id)

    def remove_model(self, model_id: str) -> list[OrderedCall]:
        """Forget a model; returns its waiting calls so the engine can fail them."""
        queue = self._models.pop(model_id, None)
        if queue is None:
            return []
        tenant = self._tenants.get(queue.tenant_id)
        if tenant is not None and model_id in tenant.models:
            tenant.models.remove(model_id)
            if not tenant.models:
                del self._tenants[queue.tenant_id]
                for active in (self._new, self._old):
                    if queue.tenant_id in active:
                        active.remove(queue.tenant_id)
        return [*queue.running.values(), *queue.waiting.values()]

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
        """One round: each backlogged tenant's units for the tokens it may spend,
        in the order they should run (tenants new to the backlog first)."""
        timed_out = self._expire(now)
        units = self._fcfs() if self.policy == "fcfs" else self._drr_round()
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

    def has_ready_work(self) -> bool:
        return any(q.next_seq_id in q.waiting for q in self._models.values())

    def next_deadline(self) -> float | None:
        """When the oldest call waiting on a gap times out (for the engine's wait)."""
        arrivals = [c.arrived_at for q in self._models.values() for c in q.waiting.values()]
        return min(arrivals) + self.gap_timeout_s if arrivals else None

    def waiting_calls(self) -> Iterable[OrderedCall]:
        for queue in self._models.values():
            yield from queue.waiting.values()

    def deficits(self) -> dict[str, int]:
        """Tokens each backlogged tenant has earned and not spent (for tests and stats)."""
        return {t: self._tenants[t].deficit for t in (*self._new, *self._old)}

    # ---- internals ------------------------------------------------------------

    def _heads(self) -> tuple[dict[str, int], dict[str, int]]:
        """Backlogged tenants: tenant -> cost of its cheapest runnable head call,
        and tenant -> the summed cost of its models' runnable head calls (what
        it could run in one round with one call per model)."""
        cheapest: dict[str, int] = {}
        ready: dict[str, int] = {}
        for queue in self._models.values():
            call = queue.head()
            if call is not None:
                cost = max(call.cost, 0)
                cheapest[queue.tenant_id] = min(cost, cheapest.get(queue.tenant_id, cost))
                ready[queue.tenant_id] = ready.get(queue.tenant_id, 0) + cost
        return cheapest, ready

    def _drr_round(self) -> list[WorkUnit]:
        heads, ready = self._heads()
        for active in (self._new, self._old):
            for tenant_id in [t for t in active if t not in heads]:
                active.remove(tenant_id)  # its queue emptied: it keeps no savings
                self._tenants[tenant_id].deficit = 0
        for tenant_id in heads:
            if tenant_id not in self._new and tenant_id not in self._old:
                self._new.append(tenant_id)
        if not heads:
            return []
        # Tenants new to the backlog get a round of their own, so the engine runs
        # their calls without waiting for (or batching with) anyone's backlog; but
        # never twice in a row, so a stream of sparse tenants cannot starve the rest.
        new_only = bool(self._new) and bool(self._old) and not self._new_only_last
        self._new_only_last = new_only
        serving = list(self._new) if new_only else [*self._new, *self._old]
        # One quantum for everyone (fairness), large enough for the readiest
        # tenant's models to run one call each in this round (few passes).
        quantum = self.quantum_tokens or max(ready.values())
        if not self.quantum_tokens and self.max_quantum_tokens:
            quantum = max(max(heads.values()), min(quantum, self.max_quantum_tokens))
        if quantum > 0:
            # Skip the rounds in which nobody could afford a call (a fixed quantum
            # smaller than the calls): as if they had run, in O(1).
            rounds = min(
                max(1, -(-(heads[t] - self._tenants[t].deficit) // quantum)) for t in serving
            )
            for tenant_id in serving:
                self._tenants[tenant_id].deficit += (rounds - 1) * quantum
        units: list[WorkUnit] = []
        for tenant_id in serving:
            tenant = self._tenants[tenant_id]
            tenant.deficit += quantum
            units += self._take_runs(tenant)
            tenant.models.rotate(-1)  # the next round starts at its next model
            # It had its turn: to the back of the old tenants (it leaves the
            # backlog, and its savings, at the next round if it has nothing left).
            if tenant_id in self._new:
                self._new.remove(tenant_id)
            else:
                self._old.remove(tenant_id)
            self._old.append(tenant_id)
        return units

    def _take_runs(self, tenant: _Tenant) -> list[WorkUnit]:
        """The tenant's models' next calls, up to each one's next barrier, that its
        deficit pays for: one call of each model in turn, then a second of each,
        and so on, so the quantum reaches as many models as it can (they run in
        one batched pass) and none of them takes it all."""
        runs: dict[str, list[OrderedCall]] = {}
        open_ = [m for m in tenant.models if not self._models[m].running]
        while open_:
            still: list[str] = []
            for model_id in open_:
                queue = self._models[model_id]
                taken = runs.setdefault(model_id, [])
                call = queue.waiting.get(queue.next_seq_id + len(taken))
                if call is None or max(call.cost, 0) > tenant.deficit:
                    continue
                tenant.deficit -= max(call.cost, 0)
                taken.append(call)
                if not call.is_barrier:
                    still.append(model_id)
            open_ = still
        units: list[WorkUnit] = []
        for model_id in tenant.models:
            calls = runs.get(model_id)
            if not calls:
                continue
            queue = self._models[model_id]
            for call in calls:
                queue.running[queue.waiting.pop(call.seq_id).seq_id] = call
            units.append(WorkUnit(model_id, tuple(calls)))
        return units

    def _fcfs(self) -> list[WorkUnit]:
        """The baseline: the single oldest runnable call, whoever sent it."""
        ready = [(c.arrived_at, q) for q in self._models.values() if (c := q.head()) is not None]
        if not ready:
            return []
        _, queue = min(ready, key=lambda item: item[0])
        call = queue.waiting.pop(queue.next_seq_id)
        queue.running[call.seq_id] = call
        return [WorkUnit(call.model_id, (call,))]

    def _expire(self, now: float) -> list[OrderedCall]:
        expired: list[OrderedCall] = []
        for queue in self._models.values():
            if queue.running or queue.next_seq_id in queue.waiting:
                continue  # runnable now or behind a running unit: not waiting on a gap
            for seq, call in list(queue.waiting.items()):
                if now - call.arrived_at >= self.gap_timeout_s:
                    expired.append(queue.waiting.pop(seq))
        return expired


def _conflict(seq_id: int) -> str:
    return f"seq_id {seq_id} was already used with a different payload"
