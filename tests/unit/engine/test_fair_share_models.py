"""Fair share when a tenant owns many models (a sweep): its ready models share
one round and one pass, it borrows and repays turns, and the scheduler waits a
moment for a light tenant's next call (anticipation)."""

from __future__ import annotations

from collections import Counter

import pytest

from tests.unit.fair_share_sim import Sim, jain, tenant_of
from treadle.workers.engine.scheduler import QueuedCall, Scheduler, WorkUnit


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
    sim.sweep(20)
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
    sim.sweep(40)
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
    sim.sweep(20)
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
        sim.sweep(3)
        assert len(sim.round()) == per_round, cap
        assert len(sim.round()) == per_round, cap


def test_a_light_tenant_still_jumps_a_sweeps_backlog() -> None:
    sim = Sim()
    sim.sweep(10)
    sim.model("light/m", "light")
    sim.round()
    sim.round()
    sim.send("light/m")
    assert [u.model_id for u in sim.round()] == ["light/m"]  # a round of its own


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
            s.submit(QueuedCall(f"sweep/m{i}", seq, "forward_backward", f"d{seq}", 0.0, cost=100))
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
        s.submit(QueuedCall("light/m", seq, "forward_backward", f"l{seq}", clock, cost=100))
        units = s.schedule(clock).units
        assert "light/m" in [u.model_id for u in units]
        run(units, 1.0)
        assert s.schedule(clock).units == ()  # held: the light's next call is on its way
        assert s.held_until() == pytest.approx(clock + 0.25)
        clock += 0.1  # it comes within the hold
    s.submit(QueuedCall("light/m", 4, "forward_backward", "l4", clock, cost=100))
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
        s.submit(QueuedCall("heavy/m", seq, "forward_backward", f"d{seq}", 0.0, cost=100))
    s.add_model("light/m", "light")
    clock = 0.0
    s.submit(QueuedCall("light/m", 1, "forward_backward", "l1", clock, cost=100))
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
        s.submit(QueuedCall("heavy/m", seq, "forward_backward", f"d{seq}", 0.0, cost=100))
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
        s.submit(QueuedCall("light/m", seq, "forward_backward", f"l{seq}", clock, cost=100))
        assert "light/m" in run(s.schedule(clock).units)
        assert s.schedule(clock).units == ()  # held: the light's next call is on its way
        assert s.held_until() == pytest.approx(clock + 0.25)
        clock += 0.1  # it comes within the hold, and shares the heavy tenant's round
    s.submit(QueuedCall("light/m", 4, "forward_backward", "l4", clock, cost=100))
    assert run(s.schedule(clock).units) == ["heavy/m", "light/m"]
    assert s.schedule(clock).units == ()  # nothing comes this time
    clock += 0.3
    assert run(s.schedule(clock).units) == ["heavy/m"]  # the wait is over


def test_the_operators_queue_shows_a_borrowers_debt_while_its_calls_wait() -> None:
    """A tenant that borrowed (two models' calls in one round on one call's quantum)
    owes the second call; its debt stays when its queue empties, and the operator's
    view reports it beside the calls it has waiting on a gap, not a 0."""
    sim = Sim()
    for m in ("d/m1", "d/m2", "d/m3"):
        sim.model(m, "d")
    sim.send("d/m1", cost=100)
    sim.send("d/m2", cost=100)
    assert sorted(u.model_id for u in sim.round()) == ["d/m1", "d/m2"]  # one borrowed
    sim.next_seq["d/m3"] = 2  # seq 1 of m3 never came: seq 2 waits on the gap
    sim.send("d/m3", cost=100)
    assert sim.round() == []  # nothing runnable: the tenant leaves the backlog
    [queue] = sim.s.queue_by_tenant()
    assert (queue.tenant_id, queue.waiting, queue.running, queue.deficit) == ("d", 1, 0, -100)
