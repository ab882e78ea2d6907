"""A worker stopped with SIGTERM drains: its models move to the other workers
through checkpoints, at their next calls, with nothing lost and no call failed;
a model that never reaches an idle moment is lost at its last applied step when
the drain times out, and replayed elsewhere."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import numpy as np
import pytest

import treadle
from treadle.errors import NotFoundError

from .cluster import BASE, Cluster, datum, one_more_worker, placed_on, wait_status

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]


def test_sigterm_drains_the_worker_onto_the_others(cluster: Cluster, tmp_path: Path) -> None:
    """SIGTERM: the worker turns draining and keeps serving while the server
    moves its models off. An idle model is checkpointed at once and comes back
    on another worker at its next call, at the same step and seq_id with the
    same weights; a model holding gradients finishes its step on the draining
    worker first, then moves. Nothing is lost and no call fails."""
    c = cluster
    leaving = one_more_worker(c, "w3", tmp_path, drain_timeout_s=60.0)
    alice = c.client("alice", max_retries=0)  # a failed call would show, not be retried
    tok = alice.get_tokenizer(BASE)
    data = [datum(tok.encode("12+3=15")), datum(tok.encode("7+8=15"))]
    adam = treadle.AdamParams(learning_rate=1e-2)

    idle, busy = placed_on(c, alice, leaving, 31), placed_on(c, alice, leaving, 32)
    samplers = []
    for step in (1, 2):
        idle.forward_backward(data, "cross_entropy").result()
        assert idle.optim_step(adam).result().step == step
        samplers.append(idle.sync_weights())  # pinned to version `step`
    old, sampler = samplers
    before = idle.forward_logprobs(data).result().loss_fn_outputs
    prompt, params = tok.encode("4+4="), treadle.SamplingParams(max_tokens=6, seed=5)
    sampled = sampler.sample(prompt, 2, params).result().sequences
    busy.forward_backward(data, "cross_entropy").result()  # gradients held: not idle

    c.workers[leaving].send_signal(signal.SIGTERM)
    wait_status(c, leaving, "draining")
    # the draining worker still serves: the held step is taken there, then it moves
    assert busy.optim_step(adam).result().step == 1
    assert c.workers[leaving].wait(60) == 0, c.log_tail()
    assert c.sql("SELECT status FROM workers WHERE id = :w", w=leaving) == [("stopped",)]
    for tc in (idle, busy):
        ((status,),) = c.sql("SELECT status FROM models WHERE id = :m", m=tc.model_id)
        assert status == "unloaded", (tc.model_id, status, c.log_tail())

    # the next call brings each back on another worker, where it was
    after = idle.forward_logprobs(data).result().loss_fn_outputs
    for x, y in zip(before, after, strict=True):
        np.testing.assert_array_equal(x.logprobs, y.logprobs)
    # a sampler of the current version follows it; an older version stayed behind
    for x, y in zip(sampled, sampler.sample(prompt, 2, params).result().sequences, strict=True):
        np.testing.assert_array_equal(x.tokens, y.tokens)
    with pytest.raises(NotFoundError, match="/v/1"):
        old.sample(prompt, 1, params).result()
    assert idle.get_info().status == "active"
    assert busy.get_info().status == "unloaded"  # info does not load a model; a call does
    for tc, step in ((idle, 3), (busy, 2)):
        tc.forward_backward(data, "cross_entropy").result()
        assert tc.optim_step(adam).result().step == step
        info = tc.get_info()
        assert info.status == "active" and info.version == step
        assert c.worker_of(tc.model_id) not in ("", leaving)
    failed = c.sql(
        "SELECT model_id, kind, error_code FROM ops WHERE model_id IN (:a, :b) "
        "AND status = 'failed'",
        a=idle.model_id,
        b=busy.model_id,
    )
    assert failed == [], failed


def test_a_drain_that_times_out_loses_what_it_still_holds(cluster: Cluster, tmp_path: Path) -> None:
    """A model that never reaches an idle moment (gradients held, its step never
    sent) stays on the draining worker until ``--drain-timeout``; then it is lost
    at its last applied step, said so, never moved with its gradients dropped."""
    c = cluster
    leaving = one_more_worker(c, "w4", tmp_path, drain_timeout_s=2.0)
    alice = c.client("alice", max_retries=0)
    tok = alice.get_tokenizer(BASE)
    data = [datum(tok.encode("12+3=15"))]
    tc = placed_on(c, alice, leaving, 41)
    tc.forward_backward(data, "cross_entropy").result()  # gradients held for good
    t0 = time.monotonic()
    c.workers[leaving].send_signal(signal.SIGTERM)
    wait_status(c, leaving, "draining")
    assert c.workers[leaving].wait(30) == 0, c.log_tail()
    assert time.monotonic() - t0 >= 2.0  # it waited out its drain
    wait_status(c, leaving, "stopped")
    deadline = time.monotonic() + 10
    while alice.get_model_info(tc.model_id).status != "lost":  # the server's next pass
        assert time.monotonic() < deadline, c.log_tail()
        time.sleep(0.2)
    assert alice.get_model_info(tc.model_id).version == 0
    assert "drain timed out" in c.logs[leaving].read_text(errors="replace")
    # its next call replays it elsewhere, gradients included: the step lands whole
    tc.forward_logprobs(data).result()
    assert c.worker_of(tc.model_id) not in ("", leaving)
    assert tc.optim_step(treadle.AdamParams(learning_rate=1e-2)).result().step == 1
