"""A Celery worker as a group of ranks (``treadle worker --ranks 2``; issue 36):
the distributed server places a model on it like on any worker, its steps equal
those of a twin on a one-rank worker, and when one of its ranks is SIGKILLed in
the middle of ``forward_backward`` the call fails UNAVAILABLE, the worker exits
(no rank left running), and the model's next call brings it back at its last
applied step on a live worker (checkpoint, then the calls since, replayed)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest

import treadle
from tests.integration.faults.test_group_rank_killed import (
    _alive,
    _cpu_s,
    _ranks_of,
    wait_computing,
)

from ..services import wait_for_workers
from .cluster import BASE, Cluster, datum, placed_on, start_worker

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.timeout(400)]


def _logprobs(tc: treadle.TrainingClient, probe: list[treadle.Datum]) -> np.ndarray:
    out = tc.forward_logprobs(probe).result(timeout=60)
    return np.concatenate([np.asarray(o.logprobs) for o in out.loss_fn_outputs])


def test_a_worker_of_two_ranks(cluster: Cluster, tmp_path: Path) -> None:
    c = cluster
    worker_id = f"{c.name}-group-{os.getpid()}"
    c.workers[worker_id], c.logs[worker_id] = start_worker(
        worker_id, c.model_dir, c.broker, c.database_url, c.store, c.s3_endpoint, tmp_path,
        flags=("--ranks", "2", "--collective-timeout", "30", "--group-restarts", "0"),
    )  # fmt: skip
    wait_for_workers(c.database_url, [worker_id], timeout_s=120)
    proc = c.workers[worker_id]
    ranks = _ranks_of(proc.pid)
    assert len(ranks) == 1, ranks

    alice = c.client("alice", max_retries=0)
    tok = alice.get_tokenizer(BASE)
    data = [datum(tok.encode("12+3=15")), datum(tok.encode("7+8=15"))]  # a datum a rank
    probe = [datum(tok.encode("4+4=8"))]
    adam = treadle.AdamParams(learning_rate=1e-2)
    tc = placed_on(c, alice, worker_id, 61)
    for _ in range(10):  # the twin on a one-rank worker (placement goes by load)
        twin = alice.create_lora_training_client(BASE, rank=4, seed=61)
        if c.worker_of(twin.model_id) != worker_id:
            break
    assert c.worker_of(twin.model_id) != worker_id
    tc.save_state("s0").result()
    for step in (1, 2, 3):
        losses = []
        for model in (tc, twin):
            losses.append(model.forward_backward(data, "cross_entropy").result().metrics)
            assert model.optim_step(adam).result().step == step
        np.testing.assert_allclose(losses[0]["loss:sum"], losses[1]["loss:sum"], rtol=1e-5)
    applied = _logprobs(tc, probe)
    np.testing.assert_allclose(applied, _logprobs(twin, probe), rtol=0, atol=1e-5)

    rng = np.random.default_rng(0)  # rows of their own: a prefix they shared would be computed once
    big = [datum(list(rng.integers(3, 60, 121))) for _ in range(1024)]
    before = _cpu_s(ranks[0])
    fut = tc.forward_backward(big, "cross_entropy")
    wait_computing(ranks[0], since=before)  # the rank has it, and is computing
    os.kill(ranks[0], signal.SIGKILL)
    with pytest.raises(treadle.UnavailableError):
        fut.result(timeout=60)
    assert proc.wait(60) == 1  # no restart allowed: it exits for its supervisor
    assert not any(_alive(pid) for pid in ranks)
    deadline = time.monotonic() + 30
    while alice.get_model_info(tc.model_id).status != "lost":
        assert time.monotonic() < deadline, c.log_tail()
        time.sleep(0.2)
    assert alice.get_model_info(tc.model_id).version == 3  # its last applied step

    tc.resync()
    np.testing.assert_allclose(_logprobs(tc, probe), applied, rtol=0, atol=1e-5)
    assert c.worker_of(tc.model_id) != worker_id
    del c.workers[worker_id]
