"""A worker killed (SIGKILL) in the middle of a call: the call fails
UNAVAILABLE, the model is lost at its last applied step, other tenants' models
carry on, and its next call brings it back at that step on a live worker (its
checkpoint, then the calls applied since, replayed from the server's log): the
weights hash equals the one taken before the kill."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import numpy as np
import pytest

import treadle
from treadle.errors import UnavailableError

from .cluster import (
    BASE,
    WORKER_TIMEOUT_S,
    Cluster,
    datum,
    one_more_worker,
    placed_on,
    weights_hash,
)

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]


def _kill_until_lost(
    c: Cluster, service: treadle.ServiceClient, worker_id: str, model_id: str
) -> None:
    """SIGKILL ``worker_id``, then wait until the server counts ``model_id`` lost."""
    c.workers[worker_id].send_signal(signal.SIGKILL)
    c.workers[worker_id].wait(10)
    deadline = time.monotonic() + 30
    while service.get_model_info(model_id).status != "lost":
        assert time.monotonic() < deadline, c.log_tail()
        time.sleep(0.2)


def test_worker_killed_mid_forward_backward(cluster: Cluster) -> None:
    c = cluster
    alice = c.client("alice", max_retries=0)
    tok = alice.get_tokenizer(BASE)
    small = [datum(tok.encode("12+3=15"))]
    victim_tc = alice.create_lora_training_client(BASE, rank=4, seed=11)
    victim = c.worker_of(victim_tc.model_id)
    bob = c.client("bob")
    bystander = bob.create_lora_training_client(BASE, rank=4, seed=12)
    for _ in range(3):  # a model of another tenant on the other worker
        if c.worker_of(bystander.model_id) != victim:
            break
        bystander = bob.create_lora_training_client(BASE, rank=4, seed=12)
    assert c.worker_of(bystander.model_id) != victim
    adam = treadle.AdamParams(learning_rate=1e-2)
    victim_tc.forward_backward(small, "cross_entropy").result()
    victim_tc.optim_step(adam).result()
    before = victim_tc.save_state("before").result()  # step 1
    victim_tc.forward_backward(small, "cross_entropy").result()
    assert victim_tc.optim_step(adam).result().step == 2

    rng = np.random.default_rng(0)  # rows of their own: a prefix they shared would be computed once
    big = [datum(list(rng.integers(3, 60, 121))) for _ in range(1024)]
    fut = victim_tc.forward_backward(big, "cross_entropy")
    time.sleep(1.0)  # the worker has it, and is computing
    c.workers[victim].send_signal(signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(UnavailableError, match="stopped answering"):
        fut.result(timeout=60)
    detected_s = time.monotonic() - t0
    assert detected_s < WORKER_TIMEOUT_S + 5

    info = alice.get_model_info(victim_tc.model_id)
    assert info.status == "lost" and info.version == 2  # its last applied step
    # another tenant's model, on the other worker, carries on
    bystander.forward_backward(small, "cross_entropy").result()
    assert bystander.optim_step(adam).result().step == 1
    # Drop the killed call (the SDK would send it again) and go on: the next call
    # brings the model back at its last applied step on the surviving worker
    # (its checkpoint, then the calls since, replayed).
    victim_tc.resync()
    victim_tc.forward_logprobs(small).result()
    survivor = c.worker_of(victim_tc.model_id)
    assert survivor != victim and survivor in c.workers
    info = alice.get_model_info(victim_tc.model_id)
    assert info.status == "active" and info.version == 2
    # and a checkpoint loads as ever
    assert victim_tc.load_state(before.path).result() == 1
    info = alice.get_model_info(victim_tc.model_id)
    assert info.status == "active" and info.version == 1
    victim_tc.forward_backward(small, "cross_entropy").result()
    assert victim_tc.optim_step(adam).result().step == 2
    # the database knows: the worker is dead, the killed call failed UNAVAILABLE
    assert c.sql("SELECT status FROM workers WHERE id = :w", w=victim) == [("dead",)]
    failed = c.sql(
        "SELECT error_code FROM ops WHERE model_id = :m AND kind = 'forward_backward' "
        "AND status = 'failed'",
        m=victim_tc.model_id,
    )
    assert failed == [("UNAVAILABLE",)], failed
    print(f"\n{c.name}: worker death detected in {detected_s:.1f} s")


def test_a_lost_model_is_replayed_to_its_last_applied_step(
    cluster: Cluster, tmp_path: Path
) -> None:
    """kill -9 of a worker k steps after a model's last checkpoint: the model's next
    call restores that checkpoint on a live worker and replays the calls applied
    since (the server's replay log), so it continues at its last applied step with
    the same weights (hash) and optimizer state (a twin that was never lost takes
    the next step identically)."""
    c = cluster
    alice = c.client("alice")
    tok = alice.get_tokenizer(BASE)
    data = [datum(tok.encode("12+3=15")), datum(tok.encode("7+8=15"))]
    probe = [datum(tok.encode("4+4=8"))]
    adam = treadle.AdamParams(learning_rate=1e-2)
    twin = alice.create_lora_training_client(BASE, rank=4, seed=51)  # on a worker that stays
    doomed = one_more_worker(c, "w5", tmp_path, drain_timeout_s=0.0)
    tc = placed_on(c, alice, doomed, 51)
    for model in (tc, twin):
        model.forward_backward(data, "cross_entropy").result()
        model.optim_step(adam).result()
    tc.save_state("s1").result()  # the last checkpoint: step 1
    k = 3
    for step in range(2, 2 + k):  # k steps past it, with the calls an RL loop makes
        for model in (tc, twin):
            model.forward_logprobs(probe).result()
            model.forward_backward(data, "cross_entropy").result()
            assert model.optim_step(adam).result().step == step
            model.sync_weights()
    before = weights_hash(tc, tmp_path / "before")
    assert before == weights_hash(twin, tmp_path / "twin")  # deterministic across workers
    logprobs = tc.forward_logprobs(probe).result().loss_fn_outputs[0].logprobs

    _kill_until_lost(c, alice, doomed, tc.model_id)
    assert alice.get_model_info(tc.model_id).version == 1 + k  # its last applied step

    # its next call brings it back there, on a live worker
    again = tc.forward_logprobs(probe).result().loss_fn_outputs[0].logprobs
    np.testing.assert_array_equal(again, logprobs)
    info = tc.get_info()
    assert info.status == "active" and info.version == 1 + k, info
    assert c.worker_of(tc.model_id) not in ("", doomed)
    assert weights_hash(tc, tmp_path / "after") == before
    # and it trains on as if nothing happened: the optimizer state came back too
    for model in (tc, twin):
        model.forward_backward(data, "cross_entropy").result()
        assert model.optim_step(adam).result().step == 2 + k
    assert weights_hash(tc, tmp_path / "next") == weights_hash(twin, tmp_path / "twin-next")
    failed = c.sql(
        "SELECT seq_id, kind, error_code FROM ops WHERE model_id = :m AND status = 'failed'",
        m=tc.model_id,
    )
    assert failed == [], failed


def test_a_worker_killed_mid_sample(cluster: Cluster, tmp_path: Path) -> None:
    """SIGKILL while a worker samples for a model's ``latest`` sampler: the samples
    fail UNAVAILABLE (nothing else is lost: sampling changes no model); the
    sampler's next sample brings the model back (from its creation state, its one
    step replayed) on a live worker and samples what it sampled before the kill."""
    c = cluster
    doomed = one_more_worker(c, "w6", tmp_path, drain_timeout_s=0.0)
    alice = c.client("alice", max_retries=0)
    tok = alice.get_tokenizer(BASE)
    tc = placed_on(c, alice, doomed, 61)
    data = [datum(tok.encode("12+3=15"))]
    tc.forward_backward(data, "cross_entropy").result()
    assert tc.optim_step(treadle.AdamParams(learning_rate=1e-2)).result().step == 1
    sampler = tc.sync_weights()
    prompt, params = tok.encode("4+4="), treadle.SamplingParams(max_tokens=6, seed=5)
    reference = sampler.sample(prompt, 2, params).result().sequences

    long = [
        sampler.sample(prompt, 64, treadle.SamplingParams(max_tokens=256, seed=i)) for i in range(4)
    ]
    time.sleep(0.3)
    cut = [f for f in long if not f.done()]
    assert cut, "the samples ended before the kill: make them longer"
    c.workers[doomed].send_signal(signal.SIGKILL)
    for fut in cut:
        with pytest.raises(UnavailableError, match="stopped answering"):
            fut.result(timeout=60)
    assert alice.get_model_info(tc.model_id).status == "lost"

    again = sampler.sample(prompt, 2, params).result().sequences
    for x, y in zip(reference, again, strict=True):
        np.testing.assert_array_equal(x.tokens, y.tokens)
    assert c.worker_of(tc.model_id) not in ("", doomed)
    tc.forward_backward(data, "cross_entropy").result()
    assert tc.optim_step(treadle.AdamParams(learning_rate=1e-2)).result().step == 2


def test_a_lost_model_loads_a_checkpoint_weights_only(cluster: Cluster, tmp_path: Path) -> None:
    """``load_state(weights_only=True)`` as a lost model's next call: the model comes
    back on a live worker with the checkpoint's weights and fresh Adam moments, and
    trains on exactly as a twin that was never lost and loaded the same way."""
    c = cluster
    alice = c.client("alice")
    tok = alice.get_tokenizer(BASE)
    data = [datum(tok.encode("12+3=15")), datum(tok.encode("7+8=15"))]
    adam = treadle.AdamParams(learning_rate=1e-2)
    twin = alice.create_lora_training_client(BASE, rank=4, seed=71)  # on a worker that stays
    doomed = one_more_worker(c, "w8", tmp_path, drain_timeout_s=0.0)
    tc = placed_on(c, alice, doomed, 71)
    saved = []
    for model in (tc, twin):
        model.forward_backward(data, "cross_entropy").result()
        model.optim_step(adam).result()
        saved.append(model.save_state("s1").result().path)  # weights and moments of step 1
        model.forward_backward(data, "cross_entropy").result()
        assert model.optim_step(adam).result().step == 2

    _kill_until_lost(c, alice, doomed, tc.model_id)

    for model, path in zip((tc, twin), saved, strict=True):
        assert model.load_state(path, weights_only=True).result() == 1
    assert c.worker_of(tc.model_id) not in ("", doomed)
    assert weights_hash(tc, tmp_path / "loaded") == weights_hash(twin, tmp_path / "twin")
    for model in (tc, twin):  # fresh moments on both: the same next step
        model.forward_backward(data, "cross_entropy").result()
        assert model.optim_step(adam).result().step == 2
    assert weights_hash(tc, tmp_path / "next") == weights_hash(twin, tmp_path / "twin-next")
