"""The engine's scheduler: pure bookkeeping of ordered calls, no I/O, no torch.

It keeps, per training model, the next expected ``seq_id``, the calls waiting for
their turn, and the recorded outcome of applied calls (so a retry returns the
same result and applies nothing). ``schedule()`` hands the engine work units:
each unit is a contiguous run of one model's calls, ending at the model's next
barrier (SkyRL's "batch forward passes up to the next barrier"), so everything
in a unit may be executed together and nothing overtakes a barrier.

Fair share across tenants is deficit round robin (Shreedhar & Varghese) by
tokens: a call costs the tokens in its batch (barriers cost nothing), each
backlogged tenant earns a quantum per round (by default the largest head-call
cost among backlogged tenants: one call's worth, so everyone affords a call a
round) and spends it on its calls; a tenant whose queue empties loses what it
had saved (but not what it owes, below). A tenant that just became backlogged
is served first, in a round of its own (FQ-CoDel's "new flows" list; never two
such rounds in a row, so sparse tenants cannot starve the rest), so a light
tenant waits behind at most the round already executing, not behind a heavy
tenant's backlog.

Borrowing, so a tenant's many models (a sweep) share passes: a tenant that
pays for a call of one model may spend ahead, one call of each of its other
ready models, in the same round (one batched pass), and repays by sitting out
rounds until its deficit covers a call again. Over a long window it gets one
tenant's share, not one per model; the share is spent in as few passes as
possible. It borrows only while no other tenant is new to the backlog or is
quiet: served in one of the last ``anticipate_rounds`` rounds that ran, with
nothing queued since (a tenant sending one call at a time, its next call on
its way). Such a tenant's next call would wait behind the borrowed pass, so
the borrower runs one call a round and the other's call goes in the round
after it arrives, behind one call at most. The rounds, not one: a client's
next call can take longer to arrive than one call takes to run (a busy
machine, the network), and it waits behind whatever pass started meanwhile. Anticipation (the deceptive idleness of a client that sends one call at a
time, as in the anticipatory disk scheduler of Iyer & Druschel): when a round
served a tenant that has nothing queued now, the next round waits a little
for that tenant's next call (``anticipate_fraction`` of the round's time,
measured between ``schedule`` calls) instead of starting the other tenants'
work at once, which the returning call would have to wait out. It comes
back: it runs in the very next round; it does not: the others lost a fraction
of one round. ``held_until()`` tells the engine how long to wait.
``max_quantum_tokens`` caps what a tenant spends in a round, borrowing
included (never below one call). Alone, a borrower's debt is skipped through
at once (the rounds nobody else wanted); a debt it still owes when its queue
empties is kept for its return.
``policy="fcfs"`` is the first-come-first-served baseline the fairness benchmark
measures against; nothing serves it.

Engine step, as in vLLM: ``schedule()`` -> execute -> ``complete()``.
"""

from __future__ import annotations

import enum
from collections import Counter, OrderedDict, deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from treadle.common.engine.domain import BARRIER_KINDS, TenantQueue


@dataclass
class QueuedCall:
    """An ordered call as the scheduler holds it: waiting for its predecessors,
    running, or a repeat following one (the service's ``OrderedCall`` is the
    call's identity as the server checks it; this is its place in the queue)."""

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
    calls: tuple[QueuedCall, ...]


@dataclass(frozen=True)
class SchedulerOutput:
    units: tuple[WorkUnit, ...]
    timed_out: tuple[QueuedCall, ...]


@dataclass
class _ModelQueue:
    tenant_id: str
    next_seq_id: int
    waiting: dict[int, QueuedCall] = field(default_factory=dict)
    running: dict[int, QueuedCall] = field(default_factory=dict)
    recorded: OrderedDict[int, tuple[str, Any]] = field(default_factory=OrderedDict)

    def head(self) -> QueuedCall | None:
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
        anticipate_rounds: int = 4,
        anticipate_fraction: float = 0.25,
        anticipate_batched: bool = False,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy: {policy!r}; choose from {POLICIES}")
        self.gap_timeout_s = gap_timeout_s
        self.results_kept = results_kept
        #: tokens a backlogged tenant earns per round; 0 = the largest head-call cost
        self.quantum_tokens = quantum_tokens
        #: the most a tenant spends in a round, borrowing included (0 = no cap:
        #: one call of each of its ready models); never below one call (1 = one
        #: call a round: no borrowing, so no batching of a sweep's own calls)
        self.max_quantum_tokens = max_quantum_tokens
        self.policy = policy
        #: rounds a tenant served with nothing queued since stays quiet (no one
        #: borrows ahead of its next call); 0: no borrowing is held back
        self.anticipate_rounds = anticipate_rounds
        #: how long a round waits for the next call of a tenant the last round
        #: served, as a share of the last round's time (0: never waits)
        self.anticipate_fraction = anticipate_fraction
        #: the engine runs a round's calls of one base in one pass: a returning
        #: call shares the others' pass, so the wait pays even when nobody borrows
        self.anticipate_batched = anticipate_batched
        self._models: dict[str, _ModelQueue] = {}
        self._tenants: dict[str, _Tenant] = {}
        self._new: deque[str] = deque()  # just became backlogged: served first
        self._old: deque[str] = deque()  # backlogged, already had a turn
        self._new_only_last = False  # the last round served only new tenants
        self._round_started: float | None = None  # when the last round's units went out
        self._held_until: float | None = None  # waiting for a quiet tenant's next call
        self._held_once = False  # the wait after the last round has been spent
        self._served_last: set[str] = set()  # tenants with units in the last round
        #: tenants served with nothing queued since -> rounds they stay quiet
        self._quiet: dict[str, int] = {}

    # ---- models ---------------------------------------------------------------

    def add_model(self, model_id: str, tenant_id: str, next_seq_id: int = 1) -> None:
        self._models[model_id] = _ModelQueue(tenant_id=tenant_id, next_seq_id=next_seq_id)
        tenant = self._tenants.setdefault(tenant_id, _Tenant())
        if model_id not in tenant.models:
            tenant.models.append(model_id)

    def remove_model(self, model_id: str) -> list[QueuedCall]:
        """Forget a model; returns its waiting calls so the engine can fail them."""
        queue = self._models.pop(model_id, None)
        if queue is None:
            return []
        tenant = self._tenants.get(queue.tenant_id)
        if tenant is not None and model_id in tenant.models:
            tenant.models.remove(model_id)
            if not tenant.models:
                del self._tenants[queue.tenant_id]
                self._served_last.discard(queue.tenant_id)
                self._quiet.pop(queue.tenant_id, None)
                for active in (self._new, self._old):
                    if queue.tenant_id in active:
                        active.remove(queue.tenant_id)
        return [*queue.running.values(), *queue.waiting.values()]

    def next_seq_id(self, model_id: str) -> int:
        return self._models[model_id].next_seq_id

    # ---- calls ----------------------------------------------------------------

    def submit(self, call: QueuedCall) -> SubmitOutcome:
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
        if self.policy == "fcfs":
            units = self._fcfs()
        elif self._anticipating(now):
            units = []
        else:
            units = self._drr_round()
            if units:
                self._round_started, self._held_once = now, False
        return SchedulerOutput(units=tuple(units), timed_out=tuple(timed_out))

    def held_until(self) -> float | None:
        """While the next round waits for a quiet tenant's next call: until when
        (the engine waits for new calls until then instead of running work)."""
        return self._held_until

    def _anticipating(self, now: float) -> bool:
        """Whether to hold the next round back for the next call of a tenant the
        last round served (nothing of it queued now), while others have work."""
        if self._held_until is not None:
            if now < self._held_until and not self._returned():
                return True
            self._held_until, self._held_once = None, True
            return False
        if self._held_once or self._round_started is None or not self.anticipate_fraction:
            return False
        heads = self._heads()
        if not heads or not (self._served_last - heads.keys()):
            return False  # nothing to hold back, or nobody to wait for
        if not (self.anticipate_batched or self._could_borrow()):
            return False  # no pass longer than one call to wait behind: no wait either
        self._held_until = now + self.anticipate_fraction * (now - self._round_started)
        return now < self._held_until

    def _could_borrow(self) -> bool:
        """A backlogged tenant has two or more models with a call ready (it may
        spend ahead in one pass, which a returning call would wait out)."""
        ready = Counter(q.tenant_id for q in self._models.values() if q.head() is not None)
        return any(n > 1 for n in ready.values())

    def _returned(self) -> bool:
        """A tenant the last round served has a call ready again."""
        heads = self._heads()
        return any(t in heads for t in self._served_last)

    def complete(self, call: QueuedCall, outcome: Any) -> None:
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

    def waiting_calls(self) -> Iterable[QueuedCall]:
        for queue in self._models.values():
            yield from queue.waiting.values()

    def deficits(self) -> dict[str, int]:
        """Tokens each backlogged tenant has earned and not spent (for tests and stats)."""
        return {t: self._tenants[t].deficit for t in (*self._new, *self._old)}

    def queue_by_tenant(self) -> list[TenantQueue]:
        """Each tenant with calls queued or running: how many, and its deficit (the
        tenant's own, backlogged or not: a debt it owes outside the backlog counts)."""
        counts: dict[str, list[int]] = {}
        for q in self._models.values():
            if q.waiting or q.running:
                row = counts.setdefault(q.tenant_id, [0, 0])
                row[0] += len(q.waiting)
                row[1] += len(q.running)
        return [
            TenantQueue(t, waiting, running, self._tenants[t].deficit)
            for t, (waiting, running) in sorted(counts.items())
        ]

    # ---- internals ------------------------------------------------------------

    def _heads(self) -> dict[str, int]:
        """Backlogged tenants: tenant -> cost of its cheapest runnable head call."""
        heads: dict[str, int] = {}
        for queue in self._models.values():
            call = queue.head()
            if call is not None:
                cost = max(call.cost, 0)
                heads[queue.tenant_id] = min(cost, heads.get(queue.tenant_id, cost))
        return heads

    def _drr_round(self) -> list[WorkUnit]:
        heads = self._heads()
        for active in (self._new, self._old):
            for tenant_id in [t for t in active if t not in heads]:
                active.remove(tenant_id)  # its queue emptied: its savings go, a debt stays
                tenant = self._tenants[tenant_id]
                tenant.deficit = min(tenant.deficit, 0)
        for tenant_id in heads:
            if tenant_id not in self._new and tenant_id not in self._old:
                # A borrower back with a debt is no sparse tenant: no round of its own.
                in_debt = self._tenants[tenant_id].deficit < 0
                (self._old if in_debt else self._new).append(tenant_id)
        if not heads:
            return []
        # Tenants new to the backlog get a round of their own, so the engine runs
        # their calls without waiting for (or batching with) anyone's backlog; but
        # never twice in a row, so a stream of sparse tenants cannot starve the rest.
        new_only = bool(self._new) and bool(self._old) and not self._new_only_last
        self._new_only_last = new_only
        serving = list(self._new) if new_only else [*self._new, *self._old]
        # Whose next call would wait behind a borrowed pass: the tenants new to
        # the backlog, and the quiet ones (one call at a time: the next is on
        # its way).
        self._update_quiet(heads.keys())
        waiting_on = set(self._new) | self._quiet.keys()
        quantum = self.quantum_tokens or max(heads.values())
        if quantum > 0:
            # Skip the rounds in which nobody could afford a call (a fixed quantum
            # smaller than the calls, a borrower repaying alone): as if they had
            # run, in O(1).
            rounds = min(self._rounds_to_afford(t, heads[t], quantum) for t in serving)
            for tenant_id in serving:
                self._tenants[tenant_id].deficit += (rounds - 1) * quantum
        units: list[WorkUnit] = []
        served: set[str] = set()
        for tenant_id in serving:
            tenant = self._tenants[tenant_id]
            tenant.deficit += quantum
            taken = self._take_runs(tenant, borrow=not (waiting_on - {tenant_id}))
            if taken:
                served.add(tenant_id)
            units += taken
            tenant.models.rotate(-1)  # the next round starts at its next model
            # It had its turn: to the back of the old tenants (it leaves the
            # backlog, and its savings, at the next round if it has nothing left).
            if tenant_id in self._new:
                self._new.remove(tenant_id)
            else:
                self._old.remove(tenant_id)
            self._old.append(tenant_id)
        self._served_last = served
        return units

    def _update_quiet(self, backlogged: Iterable[str]) -> None:
        """A round runs: the tenants served in the last one with nothing queued
        now turn quiet for ``anticipate_rounds`` rounds (this one included); a
        quiet tenant whose call arrived is backlogged, no longer quiet."""
        for tenant_id in list(self._quiet):
            self._quiet[tenant_id] -= 1
            if self._quiet[tenant_id] <= 0:
                del self._quiet[tenant_id]
        if self.anticipate_rounds > 0:
            for tenant_id in self._served_last:
                self._quiet[tenant_id] = self.anticipate_rounds
        for tenant_id in backlogged:
            self._quiet.pop(tenant_id, None)

    def _rounds_to_afford(self, tenant_id: str, cheapest: int, quantum: int) -> int:
        """Rounds of earning until the tenant can pay for its cheapest head call
        (a free call, a barrier, runs at once, even in debt)."""
        if cheapest == 0:
            return 1
        return max(1, -(-(cheapest - self._tenants[tenant_id].deficit) // quantum))

    def _take_runs(self, tenant: _Tenant, *, borrow: bool) -> list[WorkUnit]:
        """The tenant's models' next calls, up to each one's next barrier, that it
        pays for: one call of each model in turn, then a second of each, and so
        on, so its deficit reaches as many models as it can (they run in one
        batched pass) and none of them takes it all. Once it has paid for a call,
        ``borrow`` lets it also take the first call of each of its other ready
        models on credit (up to ``max_quantum_tokens`` spent in the round)."""
        runs: dict[str, list[QueuedCall]] = {}
        open_ = [m for m in tenant.models if not self._models[m].running]
        cap = self.max_quantum_tokens
        spent = 0
        paid = False  # it afforded a call from its deficit this round
        while open_:
            still: list[str] = []
            for model_id in open_:
                queue = self._models[model_id]
                taken = runs.setdefault(model_id, [])
                call = queue.waiting.get(queue.next_seq_id + len(taken))
                if call is None:
                    continue
                cost = max(call.cost, 0)
                if cost == 0 or cost <= tenant.deficit:
                    paid = paid or cost > 0
                elif not (borrow and paid and not taken and (not cap or spent + cost <= cap)):
                    continue
                tenant.deficit -= cost
                spent += cost
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

    def _expire(self, now: float) -> list[QueuedCall]:
        expired: list[QueuedCall] = []
        for queue in self._models.values():
            if queue.running or queue.next_seq_id in queue.waiting:
                continue  # runnable now or behind a running unit: not waiting on a gap
            for seq, call in list(queue.waiting.items()):
                if now - call.arrived_at >= self.gap_timeout_s:
                    expired.append(queue.waiting.pop(seq))
        return expired


def _conflict(seq_id: int) -> str:
    return f"seq_id {seq_id} was already used with a different payload"
