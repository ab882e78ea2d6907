"""Tenants are walls inside a batched pass too: a tenant whose adapter diverged (every
weight NaN) or whose loss overflows (an infinite gradient on its rows) shares a pass
with other tenants' calls, and each of those gets exactly what it gets alone: its
logprobs, its loss and metrics, its adapter's gradient and, after the optimizer step,
its adapter (within 1e-6; float64 on two ranks: 1e-10). The poisoned tenant's own call
gets what it gets alone (a NaN or infinite loss).

Calls of one shape split into equal row segments (``LoraRows.segments``); calls of
different shapes, and a sampler's decode batch (rows of any adapter in any order, and
rows of the base model), took a dense form that multiplied every row by every adapter
and masked with zeros, and NaN × 0 is NaN: one tenant's NaN reached the others'
outputs and gradients. Checked here for ``LoraRows`` itself, a one-rank batched pass
(``batching.run_batch``), a batch on two gloo ranks (``sharded_batching.run_shares``)
and the torch sampler.
"""

from __future__ import annotations

import math
from concurrent.futures import Future
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

from tests.unit.engine_ops import random_datum
from tests.unit.trainer.two_ranks import on_two_ranks
from treadle.common.engine.domain import (
    AdamConfig,
    DatumData,
    ForwardBackwardOp,
    ForwardLogprobsOp,
    ForwardResult,
    ModelSpec,
    SampleOp,
    SampleResult,
    SamplerTarget,
    SamplingConfig,
)
from treadle.workers.engine.base_models import BaseModel, BaseModelRegistry
from treadle.workers.engine.versions import WeightSnapshot
from treadle.workers.group import collectives
from treadle.workers.model.lora import LoraAdapter, LoraRows
from treadle.workers.model.tiny import build_tiny_model
from treadle.workers.sampler.backend import SampleJob
from treadle.workers.sampler.torch_sampler import TorchSampler
from treadle.workers.trainer import sharded_batching, trainer
from treadle.workers.trainer.batching import BatchCall, run_batch
from treadle.workers.trainer.sharded_base import ShardedBases
from treadle.workers.trainer.trainer import TrainingModel

torch.set_num_threads(1)
TOL = 1e-6
ADAM = AdamConfig(learning_rate=1e-2, weight_decay=0.1, grad_clip_norm=1.0)
POISONED = 1  # the index of the tenant whose adapter or loss goes non-finite


def _model(
    base: BaseModel, i: int, rank: int = 4, *, nan: bool = False, **kw: Any
) -> TrainingModel:
    """Tenant i's LoRA model, B non-zero (seeded: twins are equal); ``nan``: diverged,
    every weight of its adapter NaN."""
    spec = ModelSpec(f"m{i}", f"t{i}", "tiny", rank, 8.0, i, str(base.dtype).split(".")[1])
    model = TrainingModel(spec, base, **kw)
    g = torch.Generator().manual_seed(100 + i)
    with torch.no_grad():
        for t in model.adapter.parameters():  # type: ignore[union-attr]
            t.add_(0.05 * torch.randn(t.shape, generator=g, dtype=t.dtype))
            if nan:
                t.fill_(float("nan"))
    return model


def _overflowing(rng: np.random.Generator, n: int) -> DatumData:
    """Finite inputs whose product overflows float32: an infinite loss and gradient."""
    d = random_datum(rng, n)
    inputs = dict(d.inputs, weights=np.full(n, 1e30, np.float32))
    inputs["advantages"] = np.full(n, 1e30, np.float32)
    return DatumData(d.tokens, inputs)


def _same_number(got: float, want: float, what: str, tol: float) -> None:
    if math.isnan(want) or math.isinf(want):
        assert got == want or (math.isnan(got) and math.isnan(want)), (what, got, want)
    else:
        assert math.isclose(got, want, rel_tol=tol, abs_tol=tol), (what, got, want)


def _same_outcome(got: object, want: object, what: str, tol: float = TOL) -> None:
    if isinstance(want, Exception):
        assert type(got) is type(want) and str(got) == str(want), what
        return
    assert isinstance(got, ForwardResult) and isinstance(want, ForwardResult), (what, got)
    assert got.metrics.keys() == want.metrics.keys(), what
    for key, value in want.metrics.items():
        _same_number(got.metrics[key], value, f"{what} {key}", tol)
    assert len(got.logprobs) == len(want.logprobs), what
    for x, y in zip(got.logprobs, want.logprobs, strict=True):
        np.testing.assert_allclose(x, y, atol=tol, rtol=0, err_msg=what)  # NaN == NaN here


def _grads(model: TrainingModel) -> dict[str, torch.Tensor]:
    return {k: v.grad.clone() for k, v in model.trainable.items() if v.grad is not None}


def _same_tensors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], tol: float) -> None:
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], atol=tol, rtol=tol, equal_nan=True)


def _alone(model: TrainingModel, op: Any) -> ForwardResult | Exception:
    try:
        if isinstance(op, ForwardBackwardOp):
            return trainer.forward_backward(model, op)
        return trainer.forward_logprobs(model, op)
    except Exception as err:
        return err


# ---- LoraRows ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def base64(tiny_model_dir: Path) -> BaseModel:
    """The tiny base in float64: each adapter's own rows alone agree to rounding."""
    return BaseModelRegistry({"tiny": tiny_model_dir}).get("tiny", torch.float64)


def _adapter(base: BaseModel, i: int, rank: int, nan: bool) -> LoraAdapter:
    adapter = _model(base, i, rank, nan=nan).adapter
    assert adapter is not None
    return adapter


@pytest.mark.parametrize(
    "ids",
    [[0, 0, 1, 1, 2, 2], [0, 0, 0, 1, 1, 2], [1, -1, 0, 2, 1, 0, -1]],
    ids=["equal-segments", "unequal-runs", "interleaved-and-base"],
)
@pytest.mark.parametrize("poison", ["nan-adapter", "inf-rows"])
def test_lora_rows_keep_each_adapter_to_its_rows(
    base64: BaseModel, ids: list[int], poison: str
) -> None:
    """Adapter 1 is NaN, or its rows' inputs are infinite: every other row's output,
    every other row's input gradient and every other adapter's gradient are those of
    that adapter on its own rows (float64). Ranks 4, 4 and (unequal runs,
    interleaved) 8."""
    base, tol = base64, 1e-12
    rank_1 = 4 if ids[0] == ids[1] == 0 and ids.count(1) == 2 else 8
    adapters = [
        _adapter(base, 0, 4, False),
        _adapter(base, 1, rank_1, poison == "nan-adapter"),
        _adapter(base, 2, 4, False),
    ]
    adapters[2].scale *= 3.0
    layer, target = 0, "up_proj"
    g = torch.Generator().manual_seed(0)
    x = torch.randn(len(ids), 5, base.cfg.hidden_size, generator=g, dtype=torch.float64)
    if poison == "inf-rows":
        x[[b for b, i in enumerate(ids) if i == POISONED]] = float("inf")
    y = torch.randn(len(ids), 5, base.cfg.intermediate_size, generator=g, dtype=torch.float64)
    go = torch.randn(y.shape, generator=g, dtype=torch.float64)
    others = [b for b, i in enumerate(ids) if i != POISONED]

    x_in = x.clone().requires_grad_()
    got = LoraRows(adapters, torch.tensor(ids)).apply(layer, target, x_in, y.clone())
    got.backward(go)
    got_grads = [(a.a[layer][target].grad, a.b[layer][target].grad) for a in adapters]
    for a in adapters:
        a.a[layer][target].grad = a.b[layer][target].grad = None

    want_x_grad = torch.zeros_like(x)
    for b in others:
        xb = x[b : b + 1].clone().requires_grad_()
        k = ids[b]
        want = (
            y[b : b + 1].clone()
            if k < 0
            else adapters[k].apply(layer, target, xb, y[b : b + 1].clone())
        )
        torch.testing.assert_close(got[b : b + 1].detach(), want.detach(), atol=tol, rtol=tol)
        if k >= 0:
            want.backward(go[b : b + 1])
            assert xb.grad is not None
            want_x_grad[b] = xb.grad[0]
    assert x_in.grad is not None
    torch.testing.assert_close(x_in.grad[others], want_x_grad[others], atol=tol, rtol=tol)
    for k in (0, 2):
        ga, gb = got_grads[k]
        assert ga is not None and gb is not None
        torch.testing.assert_close(ga, adapters[k].a[layer][target].grad, atol=tol, rtol=tol)
        torch.testing.assert_close(gb, adapters[k].b[layer][target].grad, atol=tol, rtol=tol)


# ---- one rank: batching.run_batch -------------------------------------------------------


def _work(shapes: str, poison: str) -> list[tuple[int, Any]]:
    """(tenant, call): tenant 1 poisoned; ``shapes``: calls of one shape (segments) or
    of different shapes, with ``forward_logprobs`` and KL reference rows in the pass
    without gradients."""
    rng = np.random.default_rng(0)
    kl = {"kl_beta": 0.1}

    def bad(n: int) -> DatumData:  # tenant 1's ForwardBackward datum
        return _overflowing(rng, n) if poison == "overflow" else random_datum(rng, n)

    if shapes == "equal":
        return [
            (0, ForwardBackwardOp((random_datum(rng, 12),), "importance_sampling", {})),
            (1, ForwardBackwardOp((bad(12),), "importance_sampling", {})),
            (2, ForwardBackwardOp((random_datum(rng, 12),), "importance_sampling", {})),
            (0, ForwardLogprobsOp((random_datum(rng, 9),))),
            (1, ForwardLogprobsOp((random_datum(rng, 9),))),
            (2, ForwardLogprobsOp((random_datum(rng, 9),))),
        ]
    return [
        (0, ForwardBackwardOp((random_datum(rng, 7), random_datum(rng, 13)), "cross_entropy", {})),
        (1, ForwardBackwardOp((bad(20),), "importance_sampling", kl)),
        (1, ForwardLogprobsOp((random_datum(rng, 6),))),
        (2, ForwardLogprobsOp((random_datum(rng, 5), random_datum(rng, 9)))),
        (0, ForwardLogprobsOp((random_datum(rng, 11),), reference=True, temperature=1.3)),
        (2, ForwardBackwardOp((random_datum(rng, 16),), "ppo", kl, temperature=0.7)),
    ]


@pytest.mark.parametrize("shapes", ["equal", "different"])
@pytest.mark.parametrize("poison", ["nan-adapter", "overflow"])
def test_a_poisoned_tenant_leaves_the_others_as_alone(
    base: BaseModel, shapes: str, poison: str
) -> None:
    def models() -> list[TrainingModel]:
        nan = poison == "nan-adapter"
        return [_model(base, 0), _model(base, 1, rank=8, nan=nan), _model(base, 2)]

    work = _work(shapes, poison)
    alone_models, batched_models = models(), models()
    alone = [_alone(alone_models[i], op) for i, op in work]
    calls = [BatchCall(batched_models[i], op) for i, op in work]
    run_batch(calls, lambda op: None)

    poisoned_fb = alone[[i for i, _ in work].index(POISONED)]
    assert isinstance(poisoned_fb, ForwardResult)
    assert not math.isfinite(poisoned_fb.metrics["loss:sum"])  # the poison took, alone
    for (i, op), want, call in zip(work, alone, calls, strict=True):
        _same_outcome(call.outcome, want, f"tenant {i} {op.kind}")
    for i, (got_m, want_m) in enumerate(zip(batched_models, alone_models, strict=True)):
        if i != POISONED:
            assert all(bool(g.isfinite().all()) for g in _grads(got_m).values())
        _same_tensors(_grads(got_m), _grads(want_m), TOL)
        got_m.optim_step(ADAM)
        want_m.optim_step(ADAM)
        _same_tensors(
            {k: p.detach() for k, p in got_m.trainable.items()},
            {k: p.detach() for k, p in want_m.trainable.items()},
            TOL,
        )


# ---- two ranks: sharded_batching.run_shares ---------------------------------------------


def _share(op: Any, rank: int) -> Any:
    first = -(-len(op.data) // 2)  # rank 0 takes the larger share
    return replace(op, data=op.data[:first] if rank == 0 else op.data[first:])


def _merged(calls: list[BatchCall]) -> list[Any]:
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, [call.outcome for call in calls])
    out = []
    for i in range(len(calls)):
        outcomes = [per_rank[i] for per_rank in gathered]
        errors = [o for o in outcomes if isinstance(o, Exception)]
        out.append(errors[0] if errors else collectives.merge_results(outcomes))
    return out


def _two_rank_work() -> list[tuple[int, Any]]:
    """Calls of different shapes; two of one datum, for which rank 1 runs a token of
    the call's adapter with a zero loss (the NaN tenant's, and a clean one's)."""
    rng = np.random.default_rng(5)

    def data(*lengths: int) -> tuple[DatumData, ...]:
        return tuple(random_datum(rng, n) for n in lengths)

    return [
        (0, ForwardBackwardOp(data(7, 12, 5), "importance_sampling", {"kl_beta": 0.1})),
        (1, ForwardBackwardOp(data(9, 4), "cross_entropy", {})),
        (1, ForwardLogprobsOp(data(8, 3))),
        (2, ForwardLogprobsOp(data(6, 11), temperature=0.8)),
        (2, ForwardBackwardOp(data(10, 4, 6), "ppo", {})),
        (1, ForwardBackwardOp(data(9), "importance_sampling", {})),
        (0, ForwardBackwardOp(data(6), "cross_entropy", {})),
    ]


def _rank(rank: int, model_dir: Path) -> None:
    tol = 1e-10  # float64
    base = BaseModelRegistry({"tiny": model_dir}).get("tiny", torch.float64)
    bases = ShardedBases()
    mine: list[TrainingModel] = []
    for i, rank_i in enumerate((4, 8, 4)):
        spec = ModelSpec(f"m{i}", f"t{i}", "tiny", rank_i, 8.0, i, "float64")
        model = TrainingModel(spec, base, base_params=bases.params_of(base))
        collectives.made(model, bases)
        g = torch.Generator().manual_seed(100 + i)
        with torch.no_grad():
            for t in model.adapter.parameters():  # type: ignore[union-attr]
                t.add_(0.05 * torch.randn(t.shape, generator=g, dtype=t.dtype))
                if i == POISONED:
                    t.fill_(float("nan"))
        mine.append(model)
    twins = [_model(base, 0), _model(base, 1, rank=8, nan=True), _model(base, 2)]

    work = _two_rank_work()
    calls = [BatchCall(mine[i], _share(op, rank)) for i, op in work]
    sharded_batching.run_shares(calls, no_grad_pass=True)
    got = _merged(calls)
    alone = [_alone(twins[i], op) for i, op in work]
    for (i, op), outcome, want in zip(work, got, alone, strict=True):
        _same_outcome(outcome, want, f"rank {rank}: tenant {i} {op.kind}", tol)
    for i, (model, twin) in enumerate(zip(mine, twins, strict=True)):
        collectives.sum_gradients(model)
        if i != POISONED:
            assert all(bool(g.isfinite().all()) for g in _grads(model).values()), i
        _same_tensors(_grads(model), _grads(twin), tol)
        model.optim_step(ADAM)
        twin.optim_step(ADAM)
        _same_tensors(
            {k: p.detach() for k, p in model.trainable.items()},
            {k: p.detach() for k, p in twin.trainable.items()},
            tol,
        )


@pytest.mark.slow
def test_a_nan_tenant_on_two_ranks_leaves_the_others_as_alone(tmp_path: Path) -> None:
    model_dir = build_tiny_model(tmp_path / "tiny", "tiny", 0)
    on_two_ranks(_rank, model_dir)


# ---- the sampler -------------------------------------------------------------------------


def test_a_nan_adapter_in_a_decode_batch_leaves_the_other_rows_as_alone(
    base: BaseModel,
) -> None:
    """A diverged model's published version decodes beside other tenants' versions and
    the base model: every other request samples what it samples alone."""
    snaps: list[Any] = [
        _model(base, 0).snapshot(),
        _model(base, 1, rank=8, nan=True).snapshot(),
        _model(base, 2).snapshot(),
        WeightSnapshot(None, 0, base.params, None),  # the base model
    ]
    op = SampleOp(
        prompt=np.array([5, 6, 7, 8], dtype=np.int64),
        num_samples=2,
        params=SamplingConfig(max_tokens=5, seed=7, ignore_eos=True),
    )

    def run(which: list[int]) -> list[SampleResult | BaseException]:
        sampler = TorchSampler(base, num_slots=16, max_len=32)
        futures: list[Future[SampleResult]] = []
        for k in which:
            fut: Future[SampleResult] = Future()
            snap = snaps[k]
            pinned = SamplerTarget(base.name, snap.model_id, snap.version, f"t{k}")
            sampler.submit(SampleJob(sampler.base, op, snap, pinned), fut)
            futures.append(fut)
        while sampler.has_work():
            sampler.step()
        return [f.exception(0) or f.result(0) for f in futures]

    together = run([0, 1, 2, 3])
    for k, got in enumerate(together):
        (want,) = run([k])
        if isinstance(want, BaseException):
            assert type(got) is type(want), k
            continue
        assert isinstance(got, SampleResult), (k, got)
        for x, y in zip(got.sequences, want.sequences, strict=True):
            assert list(x.tokens) == list(y.tokens), k
            np.testing.assert_allclose(x.logprobs, y.logprobs, atol=1e-5, rtol=0)
