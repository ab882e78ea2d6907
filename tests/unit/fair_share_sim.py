"""A scheduler driven the way the engine drives it, for the fair-share tests."""

from __future__ import annotations

from treadle.workers.engine.scheduler import QueuedCall, Scheduler, WorkUnit


def jain(values: list[float]) -> float:
    return sum(values) ** 2 / (len(values) * sum(v * v for v in values))


class Sim:
    """Drives a scheduler the way the engine does: schedule, run every unit, complete."""

    def __init__(self, **kwargs: object) -> None:
        self.s = Scheduler(**kwargs)  # type: ignore[arg-type]
        self.next_seq: dict[str, int] = {}
        self.clock = 0.0
        self.served: list[QueuedCall] = []

    def model(self, model_id: str, tenant: str) -> None:
        self.s.add_model(model_id, tenant)
        self.next_seq[model_id] = 1

    def send(self, model_id: str, cost: int = 100, kind: str = "forward_backward") -> None:
        seq = self.next_seq[model_id]
        self.next_seq[model_id] = seq + 1
        self.clock += 1e-6
        call = QueuedCall(model_id, seq, kind, f"d{seq}", self.clock, cost=cost)
        assert self.s.submit(call).admission.value == "queued"

    def sweep(self, calls_each: int, models: int = 8) -> None:
        """Tenant ``sweep``'s models ``sweep/m0`` .. each with ``calls_each`` calls queued."""
        for i in range(models):
            self.model(f"sweep/m{i}", "sweep")
            for _ in range(calls_each):
                self.send(f"sweep/m{i}")

    def round(self) -> list[WorkUnit]:
        out = self.s.schedule(self.clock)
        while not out.units and (held := self.s.held_until()) is not None:
            self.clock = max(self.clock, held)  # the engine waits out the hold: nothing came
            out = self.s.schedule(self.clock)
        units = list(out.units)
        for unit in units:
            for call in unit.calls:
                self.served.append(call)
                self.s.complete(call, None)
        return units


def tenant_of(call: QueuedCall) -> str:
    return call.model_id.split("/")[0]
