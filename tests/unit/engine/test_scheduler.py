"""The engine's scheduler on its own: pure bookkeeping, no engine, no torch."""

from __future__ import annotations

from pathlib import Path

import pytest

from treadle.workers.engine.scheduler import Admission, QueuedCall, Scheduler, WorkUnit

GAP = 10.0


def call(
    model: str, seq: int, kind: str = "forward_backward", *, at: float = 0.0, digest: str = ""
) -> QueuedCall:
    return QueuedCall(model, seq, kind, digest or f"{kind}-{seq}", at, handle=f"h{model}{seq}")


def seqs(unit: WorkUnit) -> list[int]:
    return [c.seq_id for c in unit.calls]


def run(s: Scheduler, now: float = 0.0) -> list[tuple[str, list[int]]]:
    """One schedule() whose units all complete (as the engine does)."""
    out = s.schedule(now)
    for unit in out.units:
        for c in unit.calls:
            s.complete(c, f"result-{c.model_id}-{c.seq_id}")
    return [(u.model_id, seqs(u)) for u in out.units]


@pytest.fixture
def s() -> Scheduler:
    sched = Scheduler(gap_timeout_s=GAP)
    sched.add_model("a", "tenant-1")
    return sched


def test_calls_run_in_seq_order_whatever_the_arrival(s: Scheduler) -> None:
    for seq in (3, 1, 4, 2):
        assert s.submit(call("a", seq)).admission is Admission.QUEUED
    out = s.schedule(0.0)
    assert [seqs(u) for u in out.units] == [[1, 2, 3, 4]]
    assert out.timed_out == ()
    assert s.next_seq_id("a") == 1  # nothing completed yet
    for c in out.units[0].calls:
        s.complete(c, "ok")
    assert s.next_seq_id("a") == 5


def test_nothing_runs_before_its_predecessor(s: Scheduler) -> None:
    s.submit(call("a", 2))
    assert not s.has_ready_work()
    assert s.schedule(0.0).units == ()
    s.submit(call("a", 1))
    assert s.has_ready_work()
    assert run(s) == [("a", [1, 2])]


def test_a_unit_runs_only_after_the_previous_completed(s: Scheduler) -> None:
    s.submit(call("a", 1, "optim_step"))
    first = s.schedule(0.0)
    assert [seqs(u) for u in first.units] == [[1]]
    s.submit(call("a", 2))
    assert s.schedule(0.0).units == ()  # seq 1 still running
    s.complete(first.units[0].calls[0], "ok")
    assert run(s) == [("a", [2])]


def test_barriers_end_a_unit(s: Scheduler) -> None:
    kinds = [
        "forward_backward",
        "forward_backward",
        "optim_step",
        "forward_logprobs",
        "sync_weights",
        "save_state",
        "forward_logprobs",
        "load_state",
        "forward_backward",
    ]
    for seq, kind in enumerate(kinds, start=1):
        s.submit(call("a", seq, kind))
    units = []
    while s.has_ready_work():
        units.extend(seqs for _, seqs in run(s))
    assert units == [[1, 2, 3], [4, 5], [6], [7, 8], [9]]


def test_repeat_of_an_applied_call_returns_the_recorded_outcome(s: Scheduler) -> None:
    s.submit(call("a", 1))
    run(s)
    again = s.submit(call("a", 1))
    assert again.admission is Admission.DUPLICATE_DONE
    assert again.recorded == "result-a-1"
    conflict = s.submit(call("a", 1, digest="other"))
    assert conflict.admission is Admission.CONFLICT
    assert "seq_id 1" in conflict.message
    assert s.schedule(0.0).units == ()  # nothing re-runs
    err = ValueError("recorded errors are answered too")
    s.submit(call("a", 2))
    (unit,) = s.schedule(0.0).units
    s.complete(unit.calls[0], err)
    assert s.submit(call("a", 2)).recorded is err


def test_repeat_of_a_waiting_or_running_call_follows_it(s: Scheduler) -> None:
    s.submit(call("a", 2))
    repeat = QueuedCall("a", 2, "forward_backward", "forward_backward-2", 0.0, handle="again")
    assert s.submit(repeat).admission is Admission.DUPLICATE_PENDING
    assert s.submit(call("a", 2, digest="other")).admission is Admission.CONFLICT
    s.submit(call("a", 1))
    (unit,) = s.schedule(0.0).units
    assert seqs(unit) == [1, 2]
    assert unit.calls[1].followers == ["again"]
    # a repeat while it runs joins it too
    running_repeat = QueuedCall("a", 1, "forward_backward", "forward_backward-1", 0.0, handle="r")
    assert s.submit(running_repeat).admission is Admission.DUPLICATE_PENDING
    assert unit.calls[0].followers == ["r"]
    assert s.submit(call("a", 1, digest="other")).admission is Admission.CONFLICT


def test_outcomes_beyond_the_kept_window_expire() -> None:
    s = Scheduler(gap_timeout_s=GAP, results_kept=2)
    s.add_model("a", "t")
    for seq in (1, 2, 3):
        s.submit(call("a", seq))
    run(s)
    assert s.submit(call("a", 1)).admission is Admission.EXPIRED
    assert s.submit(call("a", 2)).admission is Admission.DUPLICATE_DONE
    assert s.submit(call("a", 3)).admission is Admission.DUPLICATE_DONE


def test_unknown_model() -> None:
    s = Scheduler()
    outcome = s.submit(call("ghost", 1))
    assert outcome.admission is Admission.UNKNOWN_MODEL
    assert "ghost" in outcome.message


def test_a_gap_expires_after_the_timeout(s: Scheduler) -> None:
    s.submit(call("a", 3, at=1.0))
    s.submit(call("a", 2, at=4.0))
    assert s.next_deadline() == 1.0 + GAP
    assert s.schedule(1.0 + GAP - 0.01).timed_out == ()
    out = s.schedule(1.0 + GAP)
    assert [c.seq_id for c in out.timed_out] == [3]
    assert out.units == ()
    assert s.next_deadline() == 4.0 + GAP
    assert [c.seq_id for c in s.schedule(4.0 + GAP).timed_out] == [2]
    assert list(s.waiting_calls()) == [] and s.next_deadline() is None
    # never applied, so never recorded: the seq_ids are free again
    assert s.next_seq_id("a") == 1
    for seq in (1, 2, 3):
        assert s.submit(call("a", seq, at=100.0)).admission is Admission.QUEUED
    assert run(s, 100.0) == [("a", [1, 2, 3])]


def test_runnable_calls_never_expire(s: Scheduler) -> None:
    s.submit(call("a", 2, at=0.0))
    s.submit(call("a", 1, at=0.0))  # the gap closed, but only seen late
    out = s.schedule(10 * GAP)
    assert out.timed_out == ()
    assert [seqs(u) for u in out.units] == [[1, 2]]


def test_calls_behind_a_running_unit_are_not_waiting_on_a_gap(s: Scheduler) -> None:
    s.submit(call("a", 1, "optim_step", at=0.0))
    s.submit(call("a", 2, at=0.0))
    first = s.schedule(0.0)
    assert [seqs(u) for u in first.units] == [[1]]
    # seq 1 runs for longer than the gap timeout; seq 2 is not missing a predecessor
    out = s.schedule(2 * GAP)
    assert out.timed_out == ()
    s.complete(first.units[0].calls[0], "ok")
    assert run(s, 2 * GAP) == [("a", [2])]


def test_tenants_are_served_in_turn() -> None:
    """Every backlogged tenant gets its turn each round (fair share by tokens is
    tests/unit/engine/test_fair_share.py); a tenant's models alternate; a tenant coming
    back to the backlog goes before those that never left it, in a round of its own."""
    s = Scheduler()
    for model, tenant in (("a1", "A"), ("a2", "A"), ("b1", "B"), ("c1", "C")):
        s.add_model(model, tenant)

    def round_(*models: str) -> list[str]:
        for model in reversed(models):  # arrival order must not matter
            s.submit(call(model, s.next_seq_id(model)))
        return [m for m, _ in run(s)]

    assert round_("a1", "a2", "b1", "c1") == ["a1", "a2", "b1", "c1"]
    assert round_("a1", "a2", "b1", "c1") == ["a2", "a1", "b1", "c1"]
    assert round_("b1", "c1") == ["b1", "c1"]  # A idle: it leaves the backlog
    # and goes first on return, in a round of its own (not batched with the backlog)
    assert round_("a1", "b1", "c1") == ["a1"]
    assert [m for m, _ in run(s)] == ["b1", "c1"]
    assert round_("c1") == ["c1"]
    assert round_("b1", "c1") == ["b1"]  # B is back (C never left)
    assert [m for m, _ in run(s)] == ["c1"]


def test_a_tenant_without_models_leaves_the_rotation() -> None:
    s = Scheduler()
    s.add_model("a1", "A")
    s.add_model("b1", "B")
    s.add_model("b2", "B")
    s.remove_model("b1")
    s.submit(call("b2", 1))
    assert run(s) == [("b2", [1])]  # B keeps its turn while it has a model
    s.remove_model("b2")
    s.remove_model("a1")
    s.add_model("a3", "A")
    s.submit(call("a3", 1))
    assert run(s) == [("a3", [1])]


def test_remove_model_returns_its_calls(s: Scheduler) -> None:
    s.add_model("b", "tenant-2")
    s.submit(call("a", 1, "optim_step"))
    s.submit(call("a", 2))
    s.submit(call("a", 4))
    s.submit(call("b", 1))
    running = s.schedule(0.0)
    assert sorted(u.model_id for u in running.units) == ["a", "b"]
    returned = s.remove_model("a")
    assert sorted(c.seq_id for c in returned) == [1, 2, 4]  # running and waiting
    assert s.submit(call("a", 5)).admission is Admission.UNKNOWN_MODEL
    assert s.remove_model("a") == []
    assert {c.model_id for c in s.waiting_calls()} == set()
    # completing a call of a removed model is harmless; the other tenant goes on
    s.complete(running.units[0].calls[0], "late")
    for unit in running.units:
        if unit.model_id == "b":
            s.complete(unit.calls[0], "ok")
    s.submit(call("b", 2))
    assert run(s) == [("b", [2])]


def test_the_scheduler_is_pure() -> None:
    import treadle.workers.engine.scheduler as mod

    imports = [
        line.split()[1]
        for line in Path(mod.__file__).read_text().splitlines()
        if line.startswith(("import ", "from "))
    ]
    for name in imports:
        assert name.split(".")[0] in (
            "__future__",
            "enum",
            "collections",
            "dataclasses",
            "typing",
            "treadle",
        ), name
        assert name in ("treadle.common.engine.domain",) or not name.startswith("treadle"), name


def test_queue_by_tenant_counts_waiting_and_running_calls(s: Scheduler) -> None:
    """The operator's view: calls waiting on a gap are waiting; handed out are running."""
    s.add_model("b", "tenant-2")
    for seq in (2, 3):  # seq 1 missing: both wait
        s.submit(call("a", seq, digest=f"d{seq}"))
    s.submit(call("b", 1))
    assert s.queue_by_tenant()[0].tenant_id == "tenant-1"
    assert [(q.tenant_id, q.waiting, q.running) for q in s.queue_by_tenant()] == [
        ("tenant-1", 2, 0),
        ("tenant-2", 1, 0),
    ]
    out = s.schedule(0.0)  # tenant-2's call is handed out; tenant-1 still waits
    assert [(q.tenant_id, q.waiting, q.running) for q in s.queue_by_tenant()] == [
        ("tenant-1", 2, 0),
        ("tenant-2", 0, 1),
    ]
    for unit in out.units:
        for c in unit.calls:
            s.complete(c, "ok")
    assert [q.tenant_id for q in s.queue_by_tenant()] == ["tenant-1"]
