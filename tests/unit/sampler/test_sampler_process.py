"""The engine with its samplers in a process of their own (``--sampler torch-process``):
weights in shared memory, cancellation, shutdown, and a child that dies. Driven through the
engine's thread-safe API, against a real spawned child (nothing mocked). What
every backend does (in-flight updates, streams, partial rollouts, bad input) is
checked for this one too by ``tests/integration/sampling/test_sampler_conformance.py``, and
that it samples what the engine thread samples by ``test_sampler_hosts.py``."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.unit.engine_ops import create_lora, tiny_engine, train_step
from treadle.common.engine.domain import (
    SampleOp,
    SampleResult,
    SamplerTarget,
    SamplingConfig,
    SyncWeightsOp,
)
from treadle.errors import InvalidArgumentError, NotFoundError, UnavailableError
from treadle.workers.engine.loop import Engine
from treadle.workers.sampler.process import proxy as sampler_process
from treadle.workers.sampler.process.proxy import ProcessTorchBackend
from treadle.workers.sampler.process.shm import flatten

torch.set_num_threads(1)
pytestmark = pytest.mark.timeout(120)

#: the tiny model's context as the samplers see it: min(sampler_max_len 1024,
#: max_position_embeddings 2048); checked in ``test_the_long_requests_fit``
CONTEXT = 1024
PROMPT = np.arange(5, 17)  # 12 tokens
#: a long request: ~1 ms a decode step here, so about a second of decoding
LONG = CONTEXT - PROMPT.size


def _start(model_dir: Path, **overrides: Any) -> Engine:
    return tiny_engine(model_dir, "torch-process", **overrides)


def _child(engine: Engine) -> ProcessTorchBackend:
    assert isinstance(engine.sampler, ProcessTorchBackend)
    return engine.sampler


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> Iterator[Engine]:
    """One engine with a sampler process, shared by the tests that leave it serving.
    Each test that trains creates a model of its own on it."""
    eng = _start(tiny_model_dir)
    yield eng
    eng.stop()


def _running_rows(engine: Engine) -> int:
    return sum(s.running_rows for s in engine.sampler_metrics())


def _tokens_generated(engine: Engine) -> int:
    return sum(s.tokens_generated for s in engine.sampler_metrics())


def _wait_for(cond: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.002)


def _wait_running(engine: Engine, futures: list[Future[SampleResult]]) -> None:
    """Until the child reports rows decoding (each has sampled its first token)."""

    def running() -> bool:
        for f in futures:  # finished already: the test's request was too short
            assert not f.done(), f.exception() if f.exception() else "finished too soon"
        return _running_rows(engine) > 0

    _wait_for(running, 30, "rows decoding in the sampler process")


def _long_op(num_samples: int = 2, seed: int = 7) -> SampleOp:
    return SampleOp(
        PROMPT, num_samples, SamplingConfig(max_tokens=LONG, seed=seed, ignore_eos=True)
    )


def test_the_long_requests_fit(engine: Engine) -> None:
    """The long requests below use the whole context: it is what they assume."""
    base = engine.bases.get("tiny", torch.float32)
    assert min(engine.config.sampler_max_len, base.cfg.max_position_embeddings) == CONTEXT
    seqs = engine.sample(SamplerTarget("tiny"), _long_op(1)).result(60).sequences
    assert len(seqs[0].tokens) == LONG and seqs[0].stop_reason == "length"
    too_long = SampleOp(PROMPT, 1, SamplingConfig(max_tokens=LONG + 1))
    with pytest.raises(InvalidArgumentError, match="max_tokens"):
        engine.sample(SamplerTarget("tiny"), too_long).result(30)


def test_a_full_fine_tunes_versions_live_in_shared_memory(engine: Engine) -> None:
    """With a sampler process, a full fine-tune's published version is made once,
    in shared memory, and shipped to the child from there."""
    create_lora(engine, "shm-full", rank=0)
    seq = train_step(engine, "shm-full", 1)
    engine.submit("shm-full", seq, SyncWeightsOp(), "sync").result(30)
    snap = engine.versions.get("shm-full", 1)
    named = snap.params.state_dict()
    live = engine.models["shm-full"].params.state_dict()
    for k, t in named.items():
        assert torch.equal(t, live[k]) and t.data_ptr() != live[k].data_ptr()
    buf, _ = flatten(named)  # type: ignore[misc]
    assert buf.untyped_storage().is_shared()
    assert (
        buf.untyped_storage().data_ptr() == next(iter(named.values())).untyped_storage().data_ptr()
    )
    seqs = engine.sample(
        SamplerTarget("tiny", "shm-full", version=1),
        SampleOp(PROMPT, 2, SamplingConfig(max_tokens=8, seed=0)),
    ).result(60)
    assert {s.versions[0][2] for s in seqs.sequences} == {1}


def test_version_buffers_are_reused_and_samples_stay_right(
    engine: Engine, tiny_model_dir: Path
) -> None:
    """A full fine-tune publishing more versions than the parent and the child keep:
    once both let a version go, its shared buffer takes a later version. Each
    version is sampled pinned right after its sync and again three versions
    later, while a latest request takes the new weights in flight and a long
    request decodes version 2 after the parent has let it go; every pinned
    sample equals a one-thread engine's, so no buffer was written while
    something could still read it."""
    op = SampleOp(PROMPT, 2, SamplingConfig(max_tokens=32, seed=3, temperature=0.9))

    def run(eng: Engine, mid: str) -> list[SampleResult]:
        create_lora(eng, mid, rank=0)
        seq, pinned, latest = 1, [], []
        for v in range(1, 31):  # well past KEEP_SNAPSHOTS (16) and keep_versions (4)
            seq = train_step(eng, mid, seq)
            eng.submit(mid, seq, SyncWeightsOp(inflight=v > 1), f"s{v}").result(30)
            seq += 1
            if v == 2:  # still decoding version 2 long after the parent let it go
                old = eng.sample(SamplerTarget("tiny", mid, version=2), _long_op(1, seed=11))
            for pin in (v, max(1, v - 3)):
                pinned.append(eng.sample(SamplerTarget("tiny", mid, version=pin), op))
                pinned[-1].result(60)  # done before the next version is written
            if v % 10 == 1:  # running on the latest weights: the syncs swap them in
                latest.append(eng.sample(SamplerTarget("tiny", mid), _long_op(1, seed=v)))
        for f in latest:
            f.result(60)
        return [f.result(60) for f in [*pinned, old]]

    one_thread = tiny_engine(tiny_model_dir)
    try:
        want = run(one_thread, "reuse")
    finally:
        one_thread.stop()
    reused_before = _child(engine).pool.reused
    got = run(engine, "reuse")
    for a, b in zip(want, got, strict=True):
        for x, y in zip(a.sequences, b.sequences, strict=True):
            np.testing.assert_array_equal(x.tokens, y.tokens)
            # batches of other widths than the one thread's: float rounding, <= 1e-4
            np.testing.assert_allclose(x.logprobs, y.logprobs, atol=1e-4)
            assert x.versions == y.versions
    assert _child(engine).pool.reused > reused_before


# ---- cancellation --------------------------------------------------------------------------


def test_cancelling_frees_the_rows_in_the_child(engine: Engine) -> None:
    _wait_for(lambda: _running_rows(engine) == 0, 30, "an idle sampler")
    futures = [engine.sample(SamplerTarget("tiny"), _long_op(2, seed=s)) for s in (1, 2, 3)]
    _wait_running(engine, futures)
    before = _tokens_generated(engine)
    assert all(f.cancel() for f in futures)
    t0 = time.monotonic()
    _wait_for(lambda: _running_rows(engine) == 0, 5, "the cancelled rows to be freed")
    assert time.monotonic() - t0 < 5
    # Freed long before they would have finished on their own (6 rows x ~1000 tokens).
    assert _tokens_generated(engine) - before < 6 * LONG // 4
    stats = engine.sampler_metrics()
    assert sum(s.queued_requests + s.prefilling_requests for s in stats) == 0
    assert all(s.free_slots == s.num_slots for s in stats)
    # the engine keeps serving
    op = SampleOp(PROMPT, 2, SamplingConfig(max_tokens=10, seed=4, ignore_eos=True))
    seqs = engine.sample(SamplerTarget("tiny"), op).result(60).sequences
    assert [len(s.tokens) for s in seqs] == [10, 10]
    # The parent forgets the cancelled requests too: no entry kept per cancel (a
    # server whose clients cancel would otherwise grow without bound).
    kept = [rid for rid, p in _child(engine)._pending.items() if p.future in futures]
    assert kept == [], f"cancelled requests {kept} still pending in the parent"


# ---- shutdown and a dead child -----------------------------------------------------------------


def test_stopping_fails_what_is_still_sampling(tiny_model_dir: Path) -> None:
    engine = _start(tiny_model_dir)
    child = _child(engine)
    pid = child.pid
    assert pid is not None and child._proc.is_alive()
    try:
        fut = engine.sample(SamplerTarget("tiny"), _long_op(2))
        _wait_running(engine, [fut])
    finally:
        t0 = time.monotonic()
        engine.stop()
        stopped_in = time.monotonic() - t0
    with pytest.raises(UnavailableError, match="shutting down"):
        fut.result(10)
    assert stopped_in < 5  # the child stopped when told, not killed after a timeout
    assert not child._proc.is_alive() and child._proc.exitcode == 0
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_a_dead_child_is_restarted_for_the_next_request(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past ``RESTART_EVERY_S`` the next request starts a new child: it samples
    (weights shipped again, a LoRA model's latest included) and the dead child's
    partial rollouts are NOT_FOUND."""

    monkeypatch.setattr(sampler_process, "RESTART_EVERY_S", 0.0)
    engine = _start(tiny_model_dir)
    try:
        create_lora(engine, "r")
        seq = train_step(engine, "r", 1)
        engine.submit("r", seq, SyncWeightsOp(), "sync").result(30)  # version 1
        # ignore_eos: cut by the budget whatever the seed draws
        cut = SampleOp(
            PROMPT, 1, SamplingConfig(max_tokens=20, token_budget=5, seed=3, ignore_eos=True)
        )
        (part,) = engine.sample(SamplerTarget("tiny", "r", tenant_id="t"), cut).result(30).sequences
        assert part.stop_reason == "partial" and part.resume_handle
        child = _child(engine)
        old_pid = child.pid
        assert old_pid is not None
        fut = engine.sample(SamplerTarget("tiny"), _long_op(2))
        _wait_running(engine, [fut])
        os.kill(old_pid, signal.SIGKILL)
        with pytest.raises(UnavailableError):
            fut.result(10)
        op = SampleOp(PROMPT, 2, SamplingConfig(max_tokens=6, seed=5))
        want = engine.sample(SamplerTarget("tiny", "r", version=1), op)
        got = want.result(60)
        assert child.pid not in (None, old_pid) and child.restarts == 1
        assert [s.versions for s in got.sequences] == [((0, 6, 1),)] * 2
        latest = engine.sample(SamplerTarget("tiny", "r"), op).result(30)
        assert [s.tokens.tolist() for s in latest.sequences] == [
            s.tokens.tolist() for s in got.sequences
        ]
        with pytest.raises(NotFoundError):
            target = SamplerTarget("tiny", "r", tenant_id="t")
            engine.resume(target, [part.resume_handle], SamplingConfig(max_tokens=20)).result(30)
    finally:
        engine.stop()


def test_a_dead_child_fails_pending_and_later_samples(tiny_model_dir: Path) -> None:
    """Within ``RESTART_EVERY_S`` of its start, a dead child is not replaced."""
    engine = _start(tiny_model_dir)
    try:
        child = _child(engine)
        assert child.pid is not None
        fut = engine.sample(SamplerTarget("tiny"), _long_op(2))
        _wait_running(engine, [fut])
        os.kill(child.pid, signal.SIGKILL)
        with pytest.raises(UnavailableError):
            fut.result(10)
        op = SampleOp(PROMPT, 1, SamplingConfig(max_tokens=4))
        with pytest.raises(UnavailableError):
            engine.sample(SamplerTarget("tiny"), op).result(10)
        with pytest.raises(UnavailableError):
            engine.resume(SamplerTarget("tiny"), ["rh-x"], SamplingConfig()).result(10)
        t0 = time.monotonic()
        engine.sampler_metrics()  # answers, without waiting on the dead child
        assert time.monotonic() - t0 < 2
        # the engine itself still answers
        assert engine.check_sampler_target(SamplerTarget("tiny")).result(10) == 0
    finally:
        t0 = time.monotonic()
        engine.stop()
    assert time.monotonic() - t0 < 15
