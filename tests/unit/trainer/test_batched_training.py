"""Cross-model training batches: several LoRA models' ForwardBackward and
ForwardLogprobs calls in one pass give each call the result and each adapter the
gradient of running it alone (<= 1e-5); an invalid call fails alone; the engine
batches the calls of one scheduling round and keeps barriers."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.unit.engine_ops import random_datum
from treadle.common.engine.domain import (
    AdamConfig,
    DatumData,
    ForwardBackwardOp,
    ForwardLogprobsOp,
    ForwardResult,
    ModelSpec,
    OptimStepOp,
    OrderedOp,
)
from treadle.errors import InternalError, InvalidArgumentError
from treadle.workers.engine.base_models import BaseModel
from treadle.workers.engine.loop import Engine, EngineConfig
from treadle.workers.model.lora import LoraRows
from treadle.workers.trainer import batching, trainer
from treadle.workers.trainer.batching import BatchCall, run_batch
from treadle.workers.trainer.trainer import TrainingModel

torch.set_num_threads(1)
TOL = 1e-5


def _model(base: BaseModel, i: int, rank: int = 4) -> TrainingModel:
    """A LoRA model with non-zero B (so every adapter changes the forward)."""
    model = TrainingModel(ModelSpec(f"m{i}", f"t{i}", "tiny", rank, 8.0, i, "float32"), base)
    g = torch.Generator().manual_seed(100 + i)
    with torch.no_grad():
        for t in model.adapter.parameters():  # type: ignore[union-attr]
            t.add_(0.05 * torch.randn(t.shape, generator=g))
    return model


def _calls(base: BaseModel) -> list[tuple[TrainingModel, Any]]:
    rng = np.random.default_rng(0)
    m0, m1, m2 = _model(base, 0), _model(base, 1, rank=8), _model(base, 2)
    return [
        (m0, ForwardBackwardOp((random_datum(rng, 7), random_datum(rng, 13)), "cross_entropy", {})),
        (m1, ForwardBackwardOp((random_datum(rng, 20),), "ppo", {"kl_beta": 0.1}, temperature=0.7)),
        (m2, ForwardLogprobsOp((random_datum(rng, 5), random_datum(rng, 9)))),
        (m2, ForwardLogprobsOp((random_datum(rng, 11),), reference=True, temperature=1.3)),
        (m0, ForwardBackwardOp((random_datum(rng, 4),), "importance_sampling", {})),
        (m2, ForwardBackwardOp((random_datum(rng, 16),), "cispo", {})),
    ]


def _alone(model: TrainingModel, op: Any) -> ForwardResult:
    if isinstance(op, ForwardBackwardOp):
        return trainer.forward_backward(model, op)
    return trainer.forward_logprobs(model, op)


def _grads(models: list[TrainingModel]) -> list[dict[str, torch.Tensor]]:
    out = []
    for m in models:
        out.append({k: v.grad.clone() for k, v in m.trainable.items() if v.grad is not None})
        m.optimizer.zero_grad()
    return out


def _assert_result(a: ForwardResult, b: ForwardResult) -> None:
    assert len(a.logprobs) == len(b.logprobs)
    for x, y in zip(a.logprobs, b.logprobs, strict=True):
        np.testing.assert_allclose(x, y, atol=TOL, rtol=0)
    assert a.metrics.keys() == b.metrics.keys()
    for k in a.metrics:
        assert a.metrics[k] == pytest.approx(b.metrics[k], abs=TOL, rel=TOL), k


def _assert_grads(a: list[dict[str, torch.Tensor]], b: list[dict[str, torch.Tensor]]) -> None:
    for ga, gb in zip(a, b, strict=True):
        assert ga.keys() == gb.keys()
        for k in ga:
            torch.testing.assert_close(ga[k], gb[k], atol=TOL, rtol=0)


def test_a_batch_equals_each_call_alone(base: BaseModel) -> None:
    work = _calls(base)
    models = list({id(m): m for m, _ in work}.values())
    alone = [_alone(m, op) for m, op in work]
    grads_alone = _grads(models)
    assert all(grads_alone[i] for i in (0, 1, 2))

    batch = [BatchCall(m, op) for m, op in work]
    run_batch(batch, lambda op: None)
    for a, call in zip(alone, batch, strict=True):
        assert isinstance(call.outcome, ForwardResult)
        _assert_result(a, call.outcome)
    _assert_grads(grads_alone, _grads(models))


def test_an_invalid_call_fails_alone(base: BaseModel) -> None:
    rng = np.random.default_rng(1)
    m0, m1, m2 = _model(base, 0), _model(base, 1), _model(base, 2)
    bad_token = random_datum(rng, 6)
    bad_token.tokens[2] = 10_000
    good_fb = ForwardBackwardOp((random_datum(rng, 9),), "cross_entropy", {})
    good_fl = ForwardLogprobsOp((random_datum(rng, 9),))
    too_long = ForwardBackwardOp((random_datum(rng, 30),), "cross_entropy", {})
    work: list[tuple[TrainingModel, Any]] = [
        (m0, good_fb),
        (m1, ForwardBackwardOp((bad_token,), "cross_entropy", {})),
        (m1, ForwardBackwardOp((random_datum(rng, 5),), "no_such_loss", {})),
        (m2, too_long),
        (m2, good_fl),
    ]
    alone_fb, alone_fl = _alone(m0, good_fb), _alone(m2, good_fl)
    grads_alone = _grads([m0])

    def check(op: Any) -> None:
        if sum(d.tokens.size for d in op.data) > 20:
            raise InvalidArgumentError("data: too many tokens")

    batch = [BatchCall(m, op) for m, op in work]
    run_batch(batch, check)
    _assert_result(alone_fb, batch[0].outcome)  # type: ignore[arg-type]
    _assert_result(alone_fl, batch[4].outcome)  # type: ignore[arg-type]
    for call, field in zip(batch[1:4], ("model_input", "no_such_loss", "too many"), strict=True):
        assert isinstance(call.outcome, InvalidArgumentError)
        assert field in str(call.outcome)
    _assert_grads(grads_alone, _grads([m0]))
    assert all(p.grad is None for p in m1.trainable.values())
    assert all(p.grad is None for p in m2.trainable.values())


@pytest.mark.parametrize("path", ["rows", "segments"])
def test_lora_rows_equal_each_adapter_on_its_rows(base: BaseModel, path: str) -> None:
    """Every path of ``LoraRows`` equals each adapter applied to its own rows,
    and gradients reach each adapter. Rows: mixed ranks and scales, a base-only
    row, rows of one adapter apart (an index) and together (a range). Segments
    (equal contiguous runs, one rank): different scales."""
    a, b, c = _model(base, 7).adapter, _model(base, 8, rank=8).adapter, _model(base, 9).adapter
    assert a is not None and b is not None and c is not None
    b.scale *= 3.0
    ids = [0, 0, -1, 1, 1, 1, 2, 0]
    if path == "segments":
        b = _model(base, 8).adapter
        assert b is not None
        b.scale *= 3.0
        ids = [2, 2, 0, 0, 1, 1]
    rows = LoraRows([a, b, c], torch.tensor(ids))
    assert (rows.segments is not None) == (path == "segments")
    x = torch.randn(len(ids), 4, base.cfg.hidden_size)
    y = torch.randn(len(ids), 4, base.cfg.intermediate_size)
    got = rows.apply(0, "up_proj", x, y.clone())
    want = torch.cat(
        [
            y[i : i + 1].clone()
            if k < 0
            else [a, b, c][k].apply(0, "up_proj", x[i : i + 1], y[i : i + 1].clone())
            for i, k in enumerate(ids)
        ]
    )
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    got.sum().backward()
    assert all(ad.a[0]["up_proj"].grad is not None for ad in (a, b, c))


@pytest.mark.parametrize(
    "ids",
    [[0, 0, 1], [0, 1, 0, 1], [0, 0, -1, -1], [0, 0, 0, 0]],
    ids=["unequal", "interleaved", "base-only", "one-adapter"],
)
def test_lora_rows_take_segments_only_for_equal_runs(base: BaseModel, ids: list[int]) -> None:
    adapters = [_model(base, 7).adapter, _model(base, 8).adapter]
    assert LoraRows(adapters, torch.tensor(ids)).segments is None  # type: ignore[arg-type]


def test_calls_of_one_shape_batch_like_alone(base: BaseModel) -> None:
    rng = np.random.default_rng(3)
    models = [_model(base, 10 + i) for i in range(4)]
    work = [(m, ForwardBackwardOp((random_datum(rng, 12),), "ppo", {})) for m in models]
    alone = [_alone(m, op) for m, op in work]
    grads_alone = _grads(models)
    batch = [BatchCall(m, op) for m, op in work]
    run_batch(batch, lambda op: None)
    for a, call in zip(alone, batch, strict=True):
        _assert_result(a, call.outcome)  # type: ignore[arg-type]
    _assert_grads(grads_alone, _grads(models))


def test_the_step_after_a_batch_equals_it_after_each_call_alone(base: BaseModel) -> None:
    """Adapters of other ranks and calls of other shapes took ``LoraRows``' dense form
    (since removed), whose B gradients came out of one stacked product as strided
    views; the fused AdamW read those as dense (wrong elements: steps of the wrong
    sign), so every gradient is kept as a tensor of its own. Such calls now take each
    adapter on its own rows (``low_rank.low_rank_add_rows``)."""
    rng = np.random.default_rng(4)
    work = [
        (0, ForwardBackwardOp((random_datum(rng, 7), random_datum(rng, 13)), "cross_entropy", {})),
        (1, ForwardBackwardOp((random_datum(rng, 20),), "importance_sampling", {})),
    ]
    batched = [_model(base, 0), _model(base, 1, rank=8)]
    alone = [_model(base, 0), _model(base, 1, rank=8)]
    calls = [BatchCall(batched[i], op) for i, op in work]
    run_batch(calls, lambda op: None)
    assert all(isinstance(c.outcome, ForwardResult) for c in calls)
    for i, op in work:
        trainer.forward_backward(alone[i], op)
    adam = AdamConfig(learning_rate=1e-2, weight_decay=0.1)
    for m, twin in zip(batched, alone, strict=True):
        assert all(p.grad is not None and p.grad.is_contiguous() for p in m.trainable.values())
        m.optim_step(adam)
        twin.optim_step(adam)
        for name, p in twin.trainable.items():
            torch.testing.assert_close(m.trainable[name], p, atol=TOL, rtol=0)


def test_full_finetunes_are_not_batched(base: BaseModel) -> None:
    full = TrainingModel(ModelSpec("f", "t", "tiny", 0, 0.0, 0, "float32"), base)
    lora = _model(base, 5)
    op = ForwardLogprobsOp((DatumData(np.arange(3, 9)),))
    assert batching.batchable(lora, op) and not batching.batchable(full, op)
    assert not batching.batchable(lora, OptimStepOp(AdamConfig()))
    assert batching.batch_key(lora) == batching.batch_key(_model(base, 6))


# ---- through the engine ---------------------------------------------------------------


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    sizes: list[int] = []
    real = batching.run_batch  # what a one-rank engine's batched pass runs

    def spy(calls: Any, check: Any) -> None:
        sizes.append(len(calls))
        real(calls, check)

    monkeypatch.setattr(batching, "run_batch", spy)
    yield sizes


def _engine_run(model_dir: Path, batched: bool) -> tuple[list[Any], list[dict[str, torch.Tensor]]]:
    """Three tenants' calls submitted before the engine starts, so one round holds them."""
    engine = Engine(EngineConfig({"tiny": model_dir}, batch_across_models=batched))
    ids = ["a", "b", "c"]
    for i, mid in enumerate(ids):
        engine.create_model(ModelSpec(mid, f"t{i}", "tiny", 4, 8.0, i, "float32"))
    rng = np.random.default_rng(2)
    plan: list[tuple[str, OrderedOp]] = [
        ("a", ForwardBackwardOp((random_datum(rng, 8),), "cross_entropy", {})),
        ("a", ForwardBackwardOp((random_datum(rng, 12),), "cross_entropy", {})),
        ("a", OptimStepOp(AdamConfig(learning_rate=0.05))),
        ("a", ForwardLogprobsOp((random_datum(rng, 8),))),  # after the barrier: the new weights
        ("b", ForwardBackwardOp((random_datum(rng, 10),), "ppo", {"kl_beta": 0.05})),
        ("b", ForwardLogprobsOp((random_datum(rng, 6),), reference=True)),
        ("c", ForwardLogprobsOp((random_datum(rng, 14),))),
        ("c", ForwardBackwardOp((random_datum(rng, 3),), "cross_entropy", {"nonsense": 1.0})),
    ]
    seq = dict.fromkeys(ids, 0)
    futures = []
    for mid, op in plan:
        seq[mid] += 1
        futures.append(engine.submit(mid, seq[mid], op, f"{mid}{seq[mid]}"))
    engine.start()
    try:
        outcomes = []
        for fut in futures:
            err = fut.exception(timeout=60)
            outcomes.append(err if err is not None else fut.result())
        grads = [
            {k: v.grad.clone() for k, v in engine.models[m].trainable.items() if v.grad is not None}
            for m in ids
        ]
    finally:
        engine.stop()
    return outcomes, grads


def test_the_engine_batches_a_round_and_keeps_barriers(
    tiny_model_dir: Path, counted: list[int]
) -> None:
    batched, grads_batched = _engine_run(tiny_model_dir, batched=True)
    # a's 2 calls before its barrier, b's 2, c's 2; fair share may split them in rounds
    assert sum(counted) == 6 and max(counted) >= 3
    counted.clear()
    alone, grads_alone = _engine_run(tiny_model_dir, batched=False)
    assert not counted
    for x, y in zip(batched, alone, strict=True):
        if isinstance(y, Exception):
            assert type(x) is type(y) and str(x) == str(y)
        elif isinstance(y, ForwardResult):
            _assert_result(x, y)
        else:  # the optimizer step (its compute time differs)
            assert x.step == y.step
            assert x.metrics == pytest.approx(y.metrics, abs=TOL, rel=TOL)
    assert isinstance(batched[-1], InvalidArgumentError)
    _assert_grads(grads_batched, grads_alone)
    assert not grads_batched[0] and grads_batched[1] and not grads_batched[2]


def _snapshot_grads(models: list[TrainingModel]) -> list[dict[str, torch.Tensor]]:
    return [
        {k: v.grad.clone() for k, v in m.trainable.items() if v.grad is not None} for m in models
    ]


def test_a_call_that_fails_in_its_backward_keeps_the_earlier_gradients(
    base: BaseModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Gradients are added all at once, after the backward: a failure on the way
    (here: the backward itself) leaves what earlier calls accumulated untouched,
    on the one-call path (the engine) and on the batched one."""
    rng = np.random.default_rng(1)
    m0, m1 = _model(base, 0), _model(base, 1)
    op = ForwardBackwardOp((random_datum(rng, 9),), "cross_entropy", {})
    trainer.forward_backward(m0, op)
    trainer.forward_backward(m1, op)
    before = _snapshot_grads([m0, m1])
    assert all(before)

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("out of memory (injected)")

    monkeypatch.setattr(torch.autograd, "grad", broken)
    engine = Engine(EngineConfig(base_models={"tiny": base.path}))
    engine.models["m0"] = m0
    engine.scheduler.add_model("m0", "t0", 1)
    fut: Any = engine.submit("m0", 1, op, "d")
    report = engine.step(0.0)
    assert [(c.model_id, c.seq_id, c.ran) for c in report.calls] == [("m0", 1, True)]
    with pytest.raises(InternalError):
        fut.result(0)
    batch = [BatchCall(m0, op), BatchCall(m1, op)]
    run_batch(batch, lambda _: None)
    assert all(isinstance(c.outcome, InternalError) for c in batch)
    monkeypatch.undo()
    _assert_grads(_snapshot_grads([m0, m1]), before)
    trainer.forward_backward(m0, op)  # and accumulation goes on from there
    assert all(torch.allclose(v.grad, 2 * before[0][k]) for k, v in m0.trainable.items())


def test_training_threads_are_chosen_per_call_and_restored(
    base: BaseModel, monkeypatch: pytest.MonkeyPatch, idle_host: object
) -> None:
    """With ``training_threads="measure"`` the engine tries a call size on all
    threads, then on one (and then on whichever the timings pick) (``workers.device.thread_choice``); ``"one"`` always
    takes one. The engine's thread count is restored after each call, and only
    calls that succeeded are timed."""
    seen: list[int] = []
    real = trainer.forward_logprobs

    def spy(model: TrainingModel, op: Any, weights: Any = None) -> ForwardResult:
        seen.append(torch.get_num_threads())
        return real(model, op, weights)

    monkeypatch.setattr(trainer, "forward_logprobs", spy)
    rng = np.random.default_rng(2)
    op = ForwardLogprobsOp((random_datum(rng, 8),))
    bad = ForwardLogprobsOp((random_datum(rng, 8),), temperature=-1.0)  # fails validation
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for policy, expected in [("measure", [2, 1]), ("one", [1, 1, 1, 1])]:
            seen.clear()
            engine = Engine(
                EngineConfig(base_models={"tiny": base.path}, threads=2, training_threads=policy)
            )
            engine.models["m0"] = _model(base, 0)
            engine.scheduler.add_model("m0", "t0", 1)
            futures = [engine.submit("m0", 1, bad, "bad")]
            futures += [engine.submit("m0", i, op, str(i)) for i in range(2, 6)]
            ran = [c.seq_id for c in engine.step(0.0).calls]
            while engine.scheduler.has_ready_work():
                ran += [c.seq_id for c in engine.step(0.0).calls]
            assert ran == [1, 2, 3, 4, 5]
            with pytest.raises(InvalidArgumentError):
                futures[0].result(0)
            for fut in futures[1:]:
                fut.result(0)
            # the bad call fails its checks before any pass (and is not timed)
            assert seen[: len(expected)] == expected
            assert len(seen) == 4 and set(seen) <= {1, 2}
            assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
