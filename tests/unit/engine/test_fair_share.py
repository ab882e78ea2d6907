"""Fair share in the pure scheduler: deficit round robin across tenants by tokens."""

from __future__ import annotations

import random
from collections import Counter
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest

from tests.unit.fair_share_sim import Sim, jain, tenant_of
from treadle.workers.engine.scheduler import Scheduler


def _heavy_and_light() -> Sim:
    """A heavy tenant with 100 calls queued and a light one with none yet."""
    sim = Sim()
    sim.model("heavy/m", "heavy")
    sim.model("light/m", "light")
    for _ in range(100):
        sim.send("heavy/m")
    return sim


def test_light_tenant_is_served_within_one_round() -> None:
    sim = _heavy_and_light()
    sim.send("light/m")
    units = sim.round()
    served = Counter(tenant_of(c) for u in units for c in u.calls)
    assert served == {"heavy": 1, "light": 1}  # one quantum (one call's tokens) each


def test_newly_backlogged_tenant_goes_first() -> None:
    sim = _heavy_and_light()
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

    from treadle.common.engine.domain import SampleOp, SamplerTarget, SamplingConfig
    from treadle.workers.engine.base_models import BaseModelRegistry
    from treadle.workers.engine.versions import WeightSnapshot
    from treadle.workers.sampler.backend import SampleJob
    from treadle.workers.sampler.torch_sampler import TorchSampler

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
        sampler.submit(
            SampleJob(sampler.base, op, snap, SamplerTarget("tiny", tenant_id=tenant)), fut
        )

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
