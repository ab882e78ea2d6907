"""Fair share in the pure scheduler: deficit round robin across tenants by tokens."""

from __future__ import annotations

import random
from collections import Counter
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest

from treadle.workers.scheduler import OrderedCall, Scheduler, WorkUnit


def jain(values: list[float]) -> float:
    return sum(values) ** 2 / (len(values) * sum(v * v for v in values))


class Sim:
    """Drives a scheduler the way the engine does: schedule, run every unit, complete."""

    def __init__(self, **kwargs: object) -> None:
        self.s = Scheduler(**kwargs)  # type: ignore[arg-type]
        self.next_seq: dict[str, int] = {}
        self.clock = 0.0
        self.served: list[OrderedCall] = []

    def model(self, model_id: str, tenant: str) -> None:
        self.s.add_model(model_id, tenant)
        self.next_seq[model_id] = 1

    def send(self, model_id: str, cost: int = 100, kind: str = "forward_backward") -> None:
        seq = self.next_seq[model_id]
        self.next_seq[model_id] = seq + 1
        self.clock += 1e-6
        call = OrderedCall(model_id, seq, kind, f"d{seq}", self.clock, cost=cost)
        assert self.s.submit(call).admission.value == "queued"

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


def tenant_of(call: OrderedCall) -> str:
    return call.model_id.split("/")[0]


def test_light_tenant_is_served_within_one_round() -> None:
    sim = Sim()
    sim.model("heavy/m", "heavy")
    sim.model("light/m", "light")
    for _ in range(100):
        sim.send("heavy/m")
    sim.send("light/m")
    units = sim.round()
    served = Counter(tenant_of(c) for u in units for c in u.calls)
    assert served == {"heavy": 1, "light": 1}  # one quantum (one call's tokens) each


def test_newly_backlogged_tenant_goes_first() -> None:
    sim = Sim()
    sim.model("heavy/m", "heavy")
    sim.model("light/m", "light")
    for _ in range(100):
        sim.send("heavy/m")
    for _ in range(5):
        sim.round()  # heavy alone: one call a round
    sim.send("light/m")
    units = sim.round()
    assert [u.model_id for u in units] == ["light/m"]  # a round of its own
    assert sim.s.deficits() == {"heavy": 0, "light": 0}
    assert [u.model_id for u in sim.round()] == ["heavy/m"]
    assert "light" not in sim.s.deficits()  # its queue emptied: it left the backlog


def test_sparse_tenants_cannot_starve_a_backlogged_one() -> None:
    """New tenants arriving before every round still leave the old ones every other round."""
    sim = Sim()
    sim.model("heavy/m", "heavy")
    for _ in range(50):
        sim.send("heavy/m")
    sim.round()  # heavy is old now
    served = []
    for i in range(20):
        sim.model(f"sparse{i}/m", f"sparse{i}")
        sim.send(f"sparse{i}/m")
        served.append([u.model_id for u in sim.round()])
    heavy_rounds = sum("heavy/m" in units for units in served)
    assert heavy_rounds >= 10


def test_equal_calls_share_tokens_fairly_while_all_are_backlogged() -> None:
    """The benchmark's shape: 4 tenants, one with a backlog 10x the others'."""
    for policy, arrival in (("drr", "heavy_first"), ("drr", "shuffled")):
        index = _jain_while_backlogged(policy, arrival)
        assert index >= 0.99, (policy, arrival, index)
    for arrival in ("heavy_first", "shuffled"):
        assert _jain_while_backlogged("fcfs", arrival) < 0.95, arrival


def _jain_while_backlogged(policy: str, arrival: str) -> float:
    sim = Sim(policy=policy)
    backlog = {"t0": 200, "t1": 20, "t2": 20, "t3": 20}
    for tenant in backlog:
        sim.model(f"{tenant}/m", tenant)
    order = [t for t, n in backlog.items() for _ in range(n)]
    if arrival == "shuffled":
        random.Random(0).shuffle(order)
    for tenant in order:
        sim.send(f"{tenant}/m")
    left = dict(backlog)
    tokens = Counter[str]()
    while all(left.values()):
        for unit in sim.round():
            for call in unit.calls:
                left[tenant_of(call)] -= 1
                tokens[tenant_of(call)] += call.cost
    return jain([float(tokens[t]) for t in backlog])


def test_tokens_not_calls_are_shared() -> None:
    """A tenant of small calls gets as many tokens as one of big calls, not as many calls."""
    sim = Sim()
    sim.model("big/m", "big")
    sim.model("small/m", "small")
    for _ in range(50):
        sim.send("big/m", cost=1000)
    for _ in range(600):
        sim.send("small/m", cost=10)
    tokens = Counter[str]()
    for _ in range(5):  # both stay backlogged throughout
        for unit in sim.round():
            for call in unit.calls:
                tokens[tenant_of(call)] += call.cost
    assert tokens["big"] == pytest.approx(tokens["small"], rel=0.05)


def test_fixed_quantum_smaller_than_a_call_still_progresses() -> None:
    sim = Sim(quantum_tokens=7)
    sim.model("a/m", "a")
    sim.model("b/m", "b")
    for _ in range(10):
        sim.send("a/m", cost=1000)
        sim.send("b/m", cost=300)
    tokens = Counter[str]()
    for _ in range(12):
        units = sim.round()
        assert units, "a round with backlogged tenants must run something"
        for unit in units:
            for call in unit.calls:
                tokens[tenant_of(call)] += call.cost
    assert abs(tokens["a"] - tokens["b"]) <= 1000  # within one call of each other


def test_barriers_cost_nothing_and_end_a_unit() -> None:
    sim = Sim()
    sim.model("a/m", "a")
    sim.model("b/m", "b")
    for _ in range(3):
        sim.send("a/m", cost=0)  # e.g. cheap forward passes
    sim.send("a/m", cost=0, kind="optim_step")
    sim.send("a/m", cost=0)
    sim.send("b/m", cost=100)
    units = sim.round()
    a_unit = next(u for u in units if u.model_id == "a/m")
    assert [c.seq_id for c in a_unit.calls] == [1, 2, 3, 4]  # up to and including the barrier
    assert [c.seq_id for c in sim.round()[0].calls] == [5]


def test_a_tenants_models_take_turns() -> None:
    sim = Sim()
    sim.model("a/m1", "a")
    sim.model("a/m2", "a")
    sim.model("b/m", "b")
    for _ in range(10):
        sim.send("a/m1")
        sim.send("a/m2")
        sim.send("b/m")
        sim.send("b/m")  # b stays backlogged throughout
    firsts = []
    tokens = Counter[str]()
    for _ in range(8):
        units = sim.round()
        firsts += [u.model_id for u in units if u.model_id.startswith("a/")][:1]
        for unit in units:
            for call in unit.calls:
                tokens[tenant_of(call)] += call.cost
    assert set(firsts) == {"a/m1", "a/m2"}  # neither of a's models starves the other
    assert abs(tokens["a"] - tokens["b"]) <= 100  # two models do not buy a bigger share


def test_a_tenants_ready_models_run_in_one_round() -> None:
    """A sweep: one tenant's 8 models each have a call ready; one round hands out
    all 8 (one batched pass), each unit up to its model's barrier."""
    sim = Sim()
    for i in range(8):
        sim.model(f"sweep/m{i}", "sweep")
        sim.send(f"sweep/m{i}", cost=100)
        sim.send(f"sweep/m{i}", cost=0, kind="optim_step")
        sim.send(f"sweep/m{i}", cost=100)  # after the barrier: the next round
    units = sim.round()
    assert sorted(u.model_id for u in units) == [f"sweep/m{i}" for i in range(8)]
    assert all([c.kind for c in u.calls] == ["forward_backward", "optim_step"] for u in units)
    assert len(sim.round()) == 8


def _sweep_and_lights(models: int = 8, calls: int = 200) -> Sim:
    """A sweep tenant with a backlog on each of its models, three light tenants
    with one model each and a backlog; the first round (everyone new) is run."""
    sim = Sim()
    for i in range(models):
        sim.model(f"sweep/m{i}", "sweep")
    for t in ("l1", "l2", "l3"):
        sim.model(f"{t}/m", t)
    for _ in range(calls):
        for i in range(models):
            sim.send(f"sweep/m{i}")
        for t in ("l1", "l2", "l3"):
            sim.send(f"{t}/m")
    sim.round()  # everyone is new: one call each, nobody borrows
    return sim


def test_a_tenant_with_many_models_gets_one_tenants_share() -> None:
    """Jain over a long window, 8 models against 1: the sweep gets one tenant's
    share, spent one call of each of its models in one round (one pass), then
    sits out while it repays."""
    sim = _sweep_and_lights()
    tokens = Counter[str]()
    sweep_rounds = []
    for _ in range(160):
        per_tenant = Counter(tenant_of(c) for u in sim.round() for c in u.calls)
        assert [per_tenant[t] for t in ("l1", "l2", "l3")] == [1, 1, 1]
        sweep_rounds.append(per_tenant["sweep"])
        tokens.update({t: n * 100 for t, n in per_tenant.items()})
    assert set(sweep_rounds) == {0, 8}  # all its models in a pass, or none
    assert jain([float(tokens[t]) for t in ("sweep", "l1", "l2", "l3")]) >= 0.99
    assert tokens["sweep"] == 160 * 100  # exactly one call's tokens a round, on average


def test_borrowing_and_repayment() -> None:
    """A tenant that pays for one call borrows one call of each other ready model
    (its deficit goes negative), sits out until it is in credit again, keeps its
    debt when its queue empties, and alone it does not wait."""

    def sweep_calls(units: list[WorkUnit]) -> int:
        return sum(len(u.calls) for u in units if u.model_id.startswith("sweep/"))

    sim = Sim()
    for i in range(4):
        sim.model(f"sweep/m{i}", "sweep")
        sim.send(f"sweep/m{i}")
    sim.model("light/m", "light")
    for _ in range(12):
        sim.send("light/m")
    assert sweep_calls(sim.round()) == 1  # both are new: nobody borrows
    assert sweep_calls(sim.round()) == 3  # paid for one, borrowed two: its queue is empty
    assert sim.s.deficits()["sweep"] == -200
    assert sweep_calls(sim.round()) == 0
    assert "sweep" not in sim.s.deficits()  # it left the backlog, owing 200
    for i in range(4):
        sim.send(f"sweep/m{i}")
    for owed in (-100, 0):  # back with a debt: no round of its own; it repays
        units = sim.round()
        assert [u.model_id for u in units] == ["light/m"]
        assert sim.s.deficits()["sweep"] == owed
    assert sweep_calls(sim.round()) == 4  # in credit again: one call of each model
    assert sim.s.deficits()["sweep"] == -300
    while any(u.model_id == "light/m" for u in sim.round()):
        pass  # the light tenant's backlog runs out
    for i in range(4):
        sim.send(f"sweep/m{i}")
    for _ in range(4):  # the light ran in the last round that ran: quiet for 4 rounds
        assert sweep_calls(sim.round()) == 1
    for _ in range(3):
        for i in range(4):
            sim.send(f"sweep/m{i}")
        assert sweep_calls(sim.round()) == 4  # alone: the rounds nobody wanted are skipped


def test_a_light_tenant_is_never_behind_more_than_one_pass() -> None:
    """A light tenant sending one call at a time: a call that arrives while the
    sweep's borrowed pass runs is in the very next round, alone; while the light
    tenant keeps coming back (served last round, its next call on its way) the
    sweep runs one call a round, so the light call never waits behind a
    borrowed pass; once it stops, the sweep borrows again."""
    sim = Sim()
    for i in range(8):
        sim.model(f"sweep/m{i}", "sweep")
        for _ in range(20):
            sim.send(f"sweep/m{i}")
    sim.model("light/m", "light")
    assert len(sim.round()) == 8  # alone: a pass of all its models
    for _ in range(10):
        sim.send("light/m")  # arrives while the sweep's round runs
        assert [u.model_id for u in sim.round()] == ["light/m"]  # the very next round
        assert len(sim.round()) == 1  # the light's next call is on its way: no borrowing
    for _ in range(3):  # quiet for anticipate_rounds (4) rounds after its last call
        assert len(sim.round()) == 1
    assert len(sim.round()) == 8  # the light was served five rounds ago: it has gone


def test_a_slow_light_client_is_not_behind_a_borrowed_pass() -> None:
    """A light tenant whose next call takes longer to arrive than one call takes
    to run (a busy machine, the network): it arrives a few rounds after its last
    call ended, and still finds the sweep running one call a round, so it waits
    behind one call, never behind a pass of the sweep's 8 (failed before: from
    the second round on the sweep borrowed)."""
    sim = Sim()
    for i in range(8):
        sim.model(f"sweep/m{i}", "sweep")
        for _ in range(40):
            sim.send(f"sweep/m{i}")
    sim.model("light/m", "light")
    assert len(sim.round()) == 8  # alone: a pass of all its models
    for delay in (1, 2, 3, 4, 2, 3):
        sim.send("light/m")
        assert [u.model_id for u in sim.round()] == ["light/m"]  # the very next round
        for _ in range(delay):  # its next call is on its way for `delay` rounds
            assert len(sim.round()) == 1  # the sweep runs one call: nothing to wait behind


def test_anticipation_rounds_are_a_setting() -> None:
    """``anticipate_rounds=1``: only the round right after a light tenant's call
    holds borrowing back."""
    sim = Sim(anticipate_rounds=1)
    for i in range(8):
        sim.model(f"sweep/m{i}", "sweep")
        for _ in range(20):
            sim.send(f"sweep/m{i}")
    sim.model("light/m", "light")
    sim.round()
    sim.send("light/m")
    assert [u.model_id for u in sim.round()] == ["light/m"]
    assert len(sim.round()) == 1
    assert len(sim.round()) == 8


def test_a_quantum_cap_bounds_a_sweeps_round() -> None:
    """``max_quantum_tokens`` trades batching for a light tenant's wait: a sweep's
    round holds as many calls as the cap pays for (never fewer than one)."""
    for cap, per_round in ((1, 1), (300, 3), (0, 8)):
        sim = Sim(max_quantum_tokens=cap)
        for i in range(8):
            sim.model(f"sweep/m{i}", "sweep")
            for _ in range(3):
                sim.send(f"sweep/m{i}", cost=100)
        assert len(sim.round()) == per_round, cap
        assert len(sim.round()) == per_round, cap


def test_a_light_tenant_still_jumps_a_sweeps_backlog() -> None:
    sim = Sim()
    for i in range(8):
        sim.model(f"sweep/m{i}", "sweep")
        for _ in range(10):
            sim.send(f"sweep/m{i}")
    sim.model("light/m", "light")
    sim.round()
    sim.round()
    sim.send("light/m")
    assert [u.model_id for u in sim.round()] == ["light/m"]  # a round of its own


def test_order_within_a_model_is_kept_and_each_call_runs_once() -> None:
    sim = Sim()
    for t in "abc":
        sim.model(f"{t}/m", t)
    rng = random.Random(1)
    for _ in range(60):
        sim.send(f"{rng.choice('abc')}/m", cost=rng.randint(0, 300))
    while sim.s.has_ready_work():
        sim.round()
    for t in "abc":
        seqs = [c.seq_id for c in sim.served if c.model_id == f"{t}/m"]
        assert seqs == list(range(1, len(seqs) + 1))
    assert len(sim.served) == 60


def test_removing_a_model_forgets_its_tenant() -> None:
    sim = Sim()
    sim.model("a/m", "a")
    sim.model("b/m", "b")
    sim.send("a/m")
    sim.send("a/m")
    sim.send("b/m")
    sim.round()
    left = sim.s.remove_model("a/m")
    assert [c.seq_id for c in left] == [2]
    assert sim.round() == []
    assert sim.s.deficits() == {}


def test_unknown_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="policy"):
        Scheduler(policy="lifo")


# ---- the sampler's queue ---------------------------------------------------------------


def test_sampler_queue_is_fair_across_tenants(tiny_model_dir: Path) -> None:
    """Requests wait for free slots in start-tag order: a tenant with many queued
    samples and one with a single sample take turns; each tenant keeps its order."""
    import numpy as np
    import torch

    from treadle.workers.base_models import BaseModelRegistry
    from treadle.workers.domain import SampleOp, SamplingConfig
    from treadle.workers.sampler import TorchSampler
    from treadle.workers.versions import WeightSnapshot

    base = BaseModelRegistry({"tiny": tiny_model_dir}).get("tiny", torch.float32)
    snap = WeightSnapshot(None, 0, base.params, None)
    sampler = TorchSampler(base, num_slots=2, max_len=64)  # one request's rows at a time
    finished: list[str] = []
    op = SampleOp(
        prompt=np.array([5, 6, 7], dtype=np.int64),
        num_samples=2,
        params=SamplingConfig(max_tokens=3, seed=1, ignore_eos=True),
    )

    def send(name: str, tenant: str) -> None:
        fut: Future[Any] = Future()
        fut.add_done_callback(lambda _: finished.append(name))
        sampler.submit(op, snap, fut, tenant=tenant)

    for i in range(6):
        send(f"heavy{i}", "heavy")
    send("light0", "light")
    sampler.step()  # heavy0 admitted (it came first)
    send("light1", "light")  # arrives while heavy's backlog waits
    while sampler.has_work():
        sampler.step()
    assert finished.index("light0") <= 2  # FCFS would make it 7th
    assert finished.index("light1") <= finished.index("heavy3")
    heavy = [n for n in finished if n.startswith("heavy")]
    assert heavy == sorted(heavy)
    assert len(finished) == 8


def test_a_round_waits_a_moment_for_a_light_tenants_next_call() -> None:
    """Anticipation: after a round that served a tenant sending one call at a time,
    the next round waits (a quarter of the last round's time) for its next call
    instead of starting the sweep's work, which that call would wait out; when
    the call comes in time it runs at once; when it does not, the wait ends and
    the sweep runs (failed before: the sweep's call started at once)."""
    s = Scheduler()
    for i in range(8):
        s.add_model(f"sweep/m{i}", "sweep")
        for seq in range(1, 21):
            s.submit(OrderedCall(f"sweep/m{i}", seq, "forward_backward", f"d{seq}", 0.0, cost=100))
    s.add_model("light/m", "light")
    clock = 0.0

    def run(units: tuple[WorkUnit, ...], seconds: float) -> None:
        nonlocal clock
        clock += seconds  # the round's pass takes this long
        for unit in units:
            for call in unit.calls:
                s.complete(call, None)

    run(s.schedule(clock).units, 1.0)  # the sweep alone: a pass of its 8 models
    for seq in range(1, 4):
        s.submit(OrderedCall("light/m", seq, "forward_backward", f"l{seq}", clock, cost=100))
        units = s.schedule(clock).units
        assert "light/m" in [u.model_id for u in units]
        run(units, 1.0)
        assert s.schedule(clock).units == ()  # held: the light's next call is on its way
        assert s.held_until() == pytest.approx(clock + 0.25)
        clock += 0.1  # it comes within the hold
    s.submit(OrderedCall("light/m", 4, "forward_backward", "l4", clock, cost=100))
    units = s.schedule(clock).units
    assert "light/m" in [u.model_id for u in units]
    run(units, 1.0)
    assert s.schedule(clock).units == ()  # held; nothing comes this time
    clock += 0.3
    units = s.schedule(clock).units
    assert [u.model_id.split("/")[0] for u in units] == ["sweep"]  # the wait is over
    assert s.held_until() is None


def test_no_wait_when_nobody_could_borrow() -> None:
    """One model per tenant: no pass is longer than one call, so a round never
    waits for a light tenant's next call (it would only add to everyone's wait;
    failed before: the round after the light call was held for a quarter round)."""
    s = Scheduler()
    s.add_model("heavy/m", "heavy")
    for seq in range(1, 21):
        s.submit(OrderedCall("heavy/m", seq, "forward_backward", f"d{seq}", 0.0, cost=100))
    s.add_model("light/m", "light")
    clock = 0.0
    s.submit(OrderedCall("light/m", 1, "forward_backward", "l1", clock, cost=100))
    for _ in range(3):
        units = s.schedule(clock).units
        assert units  # never held back
        clock += 1.0
        for unit in units:
            for call in unit.calls:
                s.complete(call, None)
        assert s.held_until() is None
    assert [u.model_id for u in s.schedule(clock).units] == ["heavy/m"]


def test_wait_for_a_call_that_shares_the_pass() -> None:
    """One model per tenant, but the engine runs a round's calls in one pass
    (``anticipate_batched``): the round after a light tenant's call waits for
    its next one, which then runs in the heavy tenant's pass (a pass of two
    calls costs less than two passes) instead of behind the whole next call
    (failed before: the heavy tenant's call started at once, alone)."""
    s = Scheduler(anticipate_batched=True)
    s.add_model("heavy/m", "heavy")
    for seq in range(1, 21):
        s.submit(OrderedCall("heavy/m", seq, "forward_backward", f"d{seq}", 0.0, cost=100))
    s.add_model("light/m", "light")
    clock = 0.0

    def run(units: tuple[WorkUnit, ...]) -> list[str]:
        nonlocal clock
        clock += 1.0
        for unit in units:
            for call in unit.calls:
                s.complete(call, None)
        return sorted(u.model_id for u in units)

    assert run(s.schedule(clock).units) == ["heavy/m"]
    for seq in range(1, 4):
        s.submit(OrderedCall("light/m", seq, "forward_backward", f"l{seq}", clock, cost=100))
        assert "light/m" in run(s.schedule(clock).units)
        assert s.schedule(clock).units == ()  # held: the light's next call is on its way
        assert s.held_until() == pytest.approx(clock + 0.25)
        clock += 0.1  # it comes within the hold, and shares the heavy tenant's round
    s.submit(OrderedCall("light/m", 4, "forward_backward", "l4", clock, cost=100))
    assert run(s.schedule(clock).units) == ["heavy/m", "light/m"]
    assert s.schedule(clock).units == ()  # nothing comes this time
    clock += 0.3
    assert run(s.schedule(clock).units) == ["heavy/m"]  # the wait is over
