"""In-flight weight updates (PipelineRL) and per-sequence completion callbacks,
driven step by step on an engine whose loop thread is not started (so every
step, sync and swap happens exactly where the test puts it)."""

from __future__ import annotations

from concurrent.futures import Future
from pathlib import Path

import numpy as np
import pytest
import torch

from treadle.common.engine.domain import (
    AdamConfig,
    DatumData,
    ForwardBackwardOp,
    ForwardLogprobsOp,
    ForwardResult,
    ModelSpec,
    OpResult,
    OptimStepOp,
    OrderedOp,
    SampleOp,
    SampleResult,
    SamplerTarget,
    SamplingConfig,
    SequenceResult,
    SyncWeightsOp,
)
from treadle.errors import NotFoundError
from treadle.workers.engine.loop import Engine, EngineConfig
from treadle.workers.sampler.torch_sampler import TorchSampler

torch.set_num_threads(1)


@pytest.fixture()
def engine(tiny_model_dir: Path) -> Engine:
    eng = Engine(EngineConfig(base_models={"tiny": tiny_model_dir}, sampler_slots=8))
    fut = eng.create_model(ModelSpec("m", "t", "tiny", 4, 8.0, 3, "float32"))
    eng.step(between_calls=False)
    fut.result(timeout=0)
    return eng


def _apply(engine: Engine, op: OrderedOp) -> OpResult:
    """Run one ordered call on model m now, at its next seq_id, without a sampler step."""
    seq_id = engine.model_status("m").next_seq_id
    fut = engine.submit("m", seq_id, op, f"d{seq_id}")
    report = engine.step(between_calls=False)
    assert [(c.seq_id, c.ran) for c in report.calls] == [(seq_id, True)]
    return fut.result(timeout=0)


def _train_step(engine: Engine) -> None:
    """One forward_backward + optim_step on model m (large lr: the weights move)."""
    toks = np.arange(3, 27)
    datum = DatumData(toks[:-1], {"target_tokens": toks[1:], "weights": np.ones(23, np.float32)})
    _apply(engine, ForwardBackwardOp((datum,), "cross_entropy", {}))
    _apply(engine, OptimStepOp(AdamConfig(learning_rate=5e-2)))


def _sampler(engine: Engine) -> TorchSampler:
    (sampler,) = engine.sampler.core.samplers.values()
    return sampler


def _submit(
    engine: Engine, target: SamplerTarget, op: SampleOp, seen: list | None = None
) -> Future[SampleResult]:
    cb = None if seen is None else (lambda i, s, _t: seen.append((i, s)))
    fut = engine.sample(target, op, on_sequence=cb)
    engine.step(between_calls=False)  # admitted, not stepped
    return fut


def _logprobs(engine: Engine, prompt: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """The trainer's logprobs of ``tokens`` after ``prompt`` under model m's current weights."""
    full = np.concatenate([prompt, tokens])
    datum = DatumData(full[:-1], {"target_tokens": full[1:]})
    res = _apply(engine, ForwardLogprobsOp((datum,)))
    assert isinstance(res, ForwardResult)
    return np.asarray(res.logprobs[0])[prompt.size - 1 :]


def test_inflight_update_switches_running_latest_rows(engine: Engine) -> None:
    prompt = np.arange(5, 17)
    op = SampleOp(prompt, 2, SamplingConfig(max_tokens=12, seed=7, ignore_eos=True))
    latest = SamplerTarget("tiny", "m")
    pinned = SamplerTarget("tiny", "m", version=0)
    f_latest = _submit(engine, latest, op)
    f_pinned = _submit(engine, pinned, op)
    sampler = _sampler(engine)

    def latest_rows() -> list:
        return [r for r in sampler.running if r.request.latest_of == "m"]

    while not latest_rows() or len(latest_rows()[0].tokens) < 4:
        sampler.step()  # one decode step: one token per running row
    assert [len(r.tokens) for r in latest_rows()] == [4, 4]
    lp_v0 = [_logprobs(engine, prompt, np.asarray(r.tokens)) for r in latest_rows()]
    _train_step(engine)
    _apply(engine, SyncWeightsOp(inflight=True))
    while sampler.has_work():
        sampler.step()
    for s in f_latest.result().sequences:
        assert s.versions == ((0, 4, 0), (4, 8, 1))
    for s in f_pinned.result().sequences:
        assert s.versions == ((0, 12, 0),)
    # The tokens before the swap were sampled under v0: their logprobs are v0's.
    for s, ref in zip(f_latest.result().sequences, lp_v0, strict=True):
        np.testing.assert_allclose(s.logprobs[:4], ref, atol=2e-4)
    # The same seed on the pinned sampler drew the same first 4 tokens, then diverged
    # in weights: after the swap the latest rows' logprobs are no longer v0's.
    a, b = f_latest.result().sequences[0], f_pinned.result().sequences[0]
    np.testing.assert_array_equal(a.tokens[:4], b.tokens[:4])
    # The token right after the swap was chosen from v1's logits over the kept KV:
    # when it equals the pinned row's token, its logprob differs (v1 vs v0).
    if a.tokens[4] == b.tokens[4]:
        assert abs(float(a.logprobs[4]) - float(b.logprobs[4])) > 1e-5


def test_plain_sync_leaves_running_rows_on_their_version(engine: Engine) -> None:
    op = SampleOp(np.arange(5, 12), 1, SamplingConfig(max_tokens=8, seed=1, ignore_eos=True))
    fut = _submit(engine, SamplerTarget("tiny", "m"), op)
    sampler = _sampler(engine)
    sampler.step()
    _train_step(engine)
    _apply(engine, SyncWeightsOp())
    later = _submit(engine, SamplerTarget("tiny", "m"), op)
    while sampler.has_work():
        sampler.step()
    assert fut.result().sequences[0].versions == ((0, 8, 0),)
    assert later.result().sequences[0].versions == ((0, 8, 1),)


def test_inflight_update_reaches_queued_and_prefilling_requests(engine: Engine) -> None:
    op = SampleOp(np.arange(5, 12), 1, SamplingConfig(max_tokens=3, seed=1, ignore_eos=True))
    fut = _submit(engine, SamplerTarget("tiny", "m"), op)  # queued, not stepped yet
    _train_step(engine)
    _apply(engine, SyncWeightsOp(inflight=True))
    sampler = _sampler(engine)
    while sampler.has_work():
        sampler.step()
    assert fut.result().sequences[0].versions == ((0, 3, 1),)


def test_sequences_are_reported_as_they_finish(engine: Engine) -> None:
    """One request of G rows with different lengths (stop token ids chosen so the
    rows stop at different steps): the callback sees short rows first, every
    index exactly once, and the same sequences the future resolves with."""
    seen: list[tuple[int, SequenceResult]] = []
    stops = tuple(range(3, 40))  # about a third of the tiny vocabulary: rows stop early, at random
    params = SamplingConfig(max_tokens=20, seed=5, stop_token_ids=stops)
    op = SampleOp(np.arange(5, 12), 6, params)
    fut = _submit(engine, SamplerTarget("tiny"), op, seen)
    sampler = _sampler(engine)
    while sampler.has_work():
        sampler.step()
    result = fut.result()
    assert sorted(i for i, _ in seen) == list(range(6))
    lengths = [s.tokens.size for _, s in seen]
    assert lengths == sorted(lengths)
    assert lengths[0] < lengths[-1], lengths  # the rows did stop at different steps
    for i, s in seen:
        np.testing.assert_array_equal(s.tokens, result.sequences[i].tokens)
        assert s.versions == result.sequences[i].versions


# ---- partial rollouts ---------------------------------------------------------------------


def _drive(engine: Engine, fut: Future[SampleResult]) -> SampleResult:
    sampler = _sampler(engine)
    while sampler.has_work():
        sampler.step()
    return fut.result(timeout=0)


def _resume(engine: Engine, target: SamplerTarget, handles: list[str], params: SamplingConfig):
    fut = engine.resume(target, handles, params)
    engine.step(between_calls=False)  # admitted, not stepped
    return fut


def test_a_resumed_partial_rollout_continues_the_same_sequence(engine: Engine) -> None:
    prompt = np.arange(5, 14)
    latest = SamplerTarget("tiny", "m", tenant_id="t")
    first_params = SamplingConfig(max_tokens=12, seed=3, ignore_eos=True, token_budget=5)
    first = _drive(engine, _submit(engine, latest, SampleOp(prompt, 2, first_params)))
    for s in first.sequences:
        assert s.stop_reason == "partial" and s.resume_handle
        assert s.tokens.size == 5 and s.versions == ((0, 5, 0),)
    # the trainer moves on and publishes v1; the resumed rows continue under it
    _train_step(engine)
    _apply(engine, SyncWeightsOp())
    handles = [s.resume_handle for s in first.sequences]
    params = SamplingConfig(max_tokens=12, seed=4, ignore_eos=True)
    done = _drive(engine, _resume(engine, latest, handles, params))
    assert len(done.sequences) == 2 and done.resumed_tokens == 10
    for part, whole in zip(first.sequences, done.sequences, strict=True):
        assert whole.stop_reason == "length" and whole.resume_handle == ""
        np.testing.assert_array_equal(whole.tokens[:5], part.tokens)
        np.testing.assert_array_equal(whole.logprobs[:5], part.logprobs)
        assert whole.tokens.size == 12
        assert whole.versions == ((0, 5, 0), (5, 7, 1))
        # the continuation was prefilled and sampled under v1: the trainer's v1
        # logprobs of the whole sequence agree on its tokens
        ref = _logprobs(engine, prompt, whole.tokens)
        np.testing.assert_allclose(whole.logprobs[5:], ref[5:], atol=2e-4)


def test_a_budget_hit_again_gives_a_new_handle(engine: Engine) -> None:
    target = SamplerTarget("tiny", tenant_id="t")
    params = SamplingConfig(max_tokens=9, seed=3, ignore_eos=True, token_budget=4)
    first = _drive(engine, _submit(engine, target, SampleOp(np.arange(5, 9), 1, params)))
    (s1,) = first.sequences
    second = _drive(engine, _resume(engine, target, [s1.resume_handle], params))
    (s2,) = second.sequences
    assert s2.stop_reason == "partial" and s2.tokens.size == 8
    assert s2.resume_handle and s2.resume_handle != s1.resume_handle
    third = _drive(engine, _resume(engine, target, [s2.resume_handle], params))
    (s3,) = third.sequences
    assert s3.stop_reason == "length" and s3.tokens.size == 9
    np.testing.assert_array_equal(s3.tokens[:8], s2.tokens)


def test_foreign_and_consumed_handles_are_not_found_alike(engine: Engine) -> None:
    mine = SamplerTarget("tiny", "m", tenant_id="t")
    params = SamplingConfig(max_tokens=8, seed=3, ignore_eos=True, token_budget=2)
    (s,) = _drive(engine, _submit(engine, mine, SampleOp(np.arange(5, 9), 1, params))).sequences
    handle = s.resume_handle
    messages = []
    for target, h in [
        (SamplerTarget("tiny", "m", tenant_id="other"), handle),  # another tenant
        (SamplerTarget("tiny", tenant_id="t"), handle),  # the base, not model m
        (mine, "rh-never-existed"),
    ]:
        with pytest.raises(NotFoundError) as err:
            _resume(engine, target, [h], params).result(timeout=0)
        messages.append(str(err.value).replace(h[:48], "H"))
    _drive(engine, _resume(engine, mine, [handle], params))  # still there: consumed now
    with pytest.raises(NotFoundError) as err:
        _resume(engine, mine, [handle], params).result(timeout=0)
    messages.append(str(err.value).replace(handle[:48], "H"))
    assert len(set(messages)) == 1, messages
