"""The shared service, distributed, for real: one server, two ``treadle worker``
processes (Celery over Redis, then over RabbitMQ), PostgreSQL (a fresh database,
dropped afterwards) and an S3 server (moto on loopback).

- Three tenants run the RL loop (sample -> forward_backward -> optim_step -> sync)
  at the same time; each sees only its own models, weights and checkpoints.
- A checkpoint saved through one worker loads through the other with identical
  weights and optimizer state (and then trains identically).
- A worker killed (SIGKILL) in the middle of a ``forward_backward``: the call fails
  UNAVAILABLE, the model is lost at its last applied step, other tenants' models
  carry on, and its next call brings it back at that step on the surviving worker
  (its checkpoint, then the calls applied since, replayed from the server's log):
  the weights hash equals the one taken before the kill.
- A worker stopped with SIGTERM drains: its models move to the other workers
  through checkpoints, at their next calls, with nothing lost and no call failed.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from sqlalchemy import create_engine, text

import treadle
from tests.helpers import next_token_datum
from treadle import rl
from treadle.errors import NotFoundError, UnavailableError
from treadle.server.config import ServerConfig
from treadle.server.embedded import EmbeddedServer

from .services import (
    AMQP_URL,
    REDIS_URL,
    S3_ENV,
    fresh_postgres,
    moto_s3,
    port_open,
    wait_for_workers,
)

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

BASE = "tiny"
BUCKET = "treadle-dist"
BROKERS = {"redis": (REDIS_URL, 6379), "rabbitmq": (AMQP_URL, 5672)}
TENANTS = ("alice", "bob", "carol")
WORKER_TIMEOUT_S = 5.0


@dataclass
class Cluster:
    name: str
    server: EmbeddedServer
    database_url: str
    s3_endpoint: str
    store: str
    workers: dict[str, subprocess.Popen[bytes]]
    logs: dict[str, Path]
    model_dir: Path
    broker: str
    keys: dict[str, str] = field(default_factory=dict)
    clients: list[treadle.ServiceClient] = field(default_factory=list)

    def client(self, tenant: str, **kwargs: object) -> treadle.ServiceClient:
        client = treadle.ServiceClient(self.server.address, api_key=self.keys[tenant], **kwargs)  # type: ignore[arg-type]
        self.clients.append(client)
        return client

    def sql(self, query: str, **params: object) -> list[tuple[object, ...]]:
        engine = create_engine(self.database_url)
        try:
            with engine.connect() as conn:
                return [tuple(r) for r in conn.execute(text(query), params)]
        finally:
            engine.dispose()

    def worker_of(self, model_id: str) -> str:
        ((worker_id,),) = self.sql("SELECT worker_id FROM models WHERE id = :m", m=model_id)
        return str(worker_id)

    def log_tail(self) -> str:
        return "\n".join(
            f"--- {w} ---\n" + "\n".join(p.read_text(errors="replace").splitlines()[-15:])
            for w, p in self.logs.items()
        )


def _create_tenant(database_url: str, name: str) -> str:
    """A tenant and its key, made by the admin CLI as an operator would."""
    from treadle.server.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        assert main(["admin", "--database-url", database_url, "create-tenant", name]) == 0
    return out.getvalue().strip().splitlines()[-1]


def _start_worker(
    worker_id: str,
    model: Path,
    broker: str,
    database_url: str,
    store: str,
    s3: str,
    tmp: Path,
    *,
    drain_timeout_s: float = 0.0,  # the fixture's workers stop at once at teardown
) -> tuple[subprocess.Popen[bytes], Path]:
    log = tmp / f"{worker_id}.log"
    cmd = [
        *(sys.executable, "-m", "treadle.server.cli", "worker"),
        *("--model", f"{BASE}={model}", "--broker", broker, "--database-url", database_url),
        *("--store", store, "--s3-endpoint-url", s3, "--data-dir", str(tmp / worker_id)),
        *("--worker-id", worker_id, "--heartbeat", "0.5", "--threads", "1"),
        *("--drain-timeout", str(drain_timeout_s)),
    ]
    env = dict(os.environ, **S3_ENV, OMP_NUM_THREADS="1")
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    return proc, log


@pytest.fixture(scope="module")
def s3_endpoint() -> Iterator[str]:
    with moto_s3(BUCKET) as url:
        yield url


@pytest.fixture(scope="module", params=list(BROKERS))
def cluster(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    tiny_model_dir: Path,
    s3_endpoint: str,
) -> Iterator[Cluster]:
    name = request.param
    broker, port = BROKERS[name]
    if not port_open("127.0.0.1", port):
        pytest.skip(f"{name} is not running on 127.0.0.1:{port}")
    tmp = tmp_path_factory.mktemp(f"dist-{name}")
    store = f"s3://{BUCKET}/{name}"
    with fresh_postgres() as database_url:
        config = ServerConfig(
            data_dir=tmp / "server",
            models={BASE: tiny_model_dir},
            port=0,
            threads=1,
            database_url=database_url,
            broker=broker,
            store=store,
            s3_endpoint_url=s3_endpoint,
            worker_timeout_s=WORKER_TIMEOUT_S,
        )
        workers: dict[str, subprocess.Popen[bytes]] = {}
        logs: dict[str, Path] = {}
        c = Cluster(
            name,
            EmbeddedServer(config).start(),
            database_url,
            s3_endpoint,
            store,
            workers,
            logs,
            tiny_model_dir,
            broker,
        )
        try:
            for i in (1, 2):
                worker_id = f"{name}-w{i}-{os.getpid()}"
                workers[worker_id], logs[worker_id] = _start_worker(
                    worker_id, tiny_model_dir, broker, database_url, store, s3_endpoint, tmp
                )
            try:
                wait_for_workers(database_url, list(workers), timeout_s=120)
            except TimeoutError as err:
                raise AssertionError(f"{err}\n{c.log_tail()}") from None
            c.keys = {t: _create_tenant(database_url, t) for t in TENANTS}
            yield c
            for client in c.clients:
                client.close()
        finally:
            for proc in workers.values():
                if proc.poll() is None:
                    proc.terminate()
            for proc in workers.values():
                try:
                    proc.wait(20)
                except subprocess.TimeoutExpired:
                    proc.kill()
            c.server.stop()  # the current one: a test may have restarted it


def _datum(tokens: list[int]) -> treadle.Datum:
    return next_token_datum(tokens)


def _rl_loop(c: Cluster, tenant: str, seed: int, steps: int, out: dict[str, object]) -> None:
    """The SDK loop of one tenant: sample -> reward -> forward_backward -> optim_step -> sync."""
    service = c.client(tenant)
    tok = service.get_tokenizer(BASE)
    trainer = service.create_lora_training_client(BASE, rank=4, seed=seed)
    prompts, group = ["12+3=", "7+8="], 4
    adam = treadle.AdamParams(learning_rate=1e-2)
    versions = []
    for step in range(steps):
        sampler = trainer.sync_weights()
        futures = [
            sampler.sample(
                tok.encode(p), group, treadle.SamplingParams(max_tokens=4, seed=seed * 100 + step)
            )
            for p in prompts
        ]
        rollouts, rewards = [], []
        for p, fut in zip(prompts, futures, strict=True):
            for seq in fut.result().sequences:
                rewards.append(float(sum(ch.isdigit() for ch in tok.decode(seq.tokens))))
                rollouts.append(rl.Rollout.from_sequence(tok.encode(p), seq))
                versions.extend(span.version for span in seq.versions)
        adv = rl.group_advantages(np.array(rewards), group)
        data = rl.build_datums(rollouts, adv, aggregation="token_mean")
        fb = trainer.forward_backward(
            data, "ppo", {"clip_low_threshold": 0.8, "clip_high_threshold": 1.28}
        )
        result = trainer.optim_step(adam)
        assert np.isfinite(fb.result().metrics["loss:sum"])
        assert result.result().step == step + 1
    trainer.sync_weights()
    out.update(model_id=trainer.model_id, versions=versions, info=trainer.get_info())


def _state(c: Cluster, model_id: str, name: str) -> dict[str, torch.Tensor]:
    from treadle.common.s3_store import S3Store

    store = S3Store(c.store, endpoint_url=c.s3_endpoint)
    ((tenant_id,),) = c.sql("SELECT tenant_id FROM models WHERE id = :m", m=model_id)
    local = store.fetch(store.state_path(str(tenant_id), model_id, name))
    try:
        weights = load_file(str(local / "weights.safetensors"))
        optim = load_file(str(local / "optimizer.safetensors"))
        return {
            **{f"w.{k}": v for k, v in weights.items()},
            **{f"o.{k}": v for k, v in optim.items()},
        }
    finally:
        store.release(local, "")


def test_three_tenants_two_workers(cluster: Cluster, tmp_path: Path) -> None:
    c = cluster
    t0 = time.monotonic()
    results: dict[str, dict[str, object]] = {t: {} for t in TENANTS}
    errors: list[BaseException] = []

    def run(tenant: str, seed: int) -> None:
        try:
            _rl_loop(c, tenant, seed, 2, results[tenant])
        except BaseException as err:  # surfaced below, with the workers' logs
            errors.append(err)

    threads = [threading.Thread(target=run, args=(t, i)) for i, t in enumerate(TENANTS)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(240)
    if errors:
        raise AssertionError(f"{errors[0]!r}\n{c.log_tail()}") from errors[0]
    loop_s = time.monotonic() - t0

    models = {t: str(results[t]["model_id"]) for t in TENANTS}
    for t in TENANTS:
        info = results[t]["info"]
        assert info.status == "active" and info.version == 2  # type: ignore[attr-defined]
        assert set(results[t]["versions"]) == {0, 1}  # type: ignore[arg-type]
    # placed least loaded first: both workers host models
    placed = {m: c.worker_of(m) for m in models.values()}
    assert set(placed.values()) == set(c.workers), placed

    # tenants are walls, across workers too
    for t in TENANTS:
        service = c.client(t)
        assert [m.model_id for m in service.list_models()] == [models[t]]
        for other in TENANTS:
            if other == t:
                continue
            with pytest.raises(NotFoundError):
                service.get_model_info(models[other])
            with pytest.raises(NotFoundError):
                service.create_sampling_client(weights=f"treadle://{models[other]}/v/1")

    # a checkpoint saved through one worker loads through the other, identically
    loads: dict[str, int] = {}
    for w in placed.values():
        loads[w] = loads.get(w, 0) + 1
    busy = max(loads, key=lambda w: loads[w])
    tenant = next(t for t in TENANTS if placed[models[t]] == busy)
    service = c.client(tenant)
    original = service.get_training_client(models[tenant])
    saved = original.save_state("portable").result()
    copy = service.create_training_client_from_state(saved.path)
    assert c.worker_of(copy.model_id) != busy  # the other worker, the least loaded one
    assert copy.get_info().version == 2
    copy.save_state("portable").result()
    a, b = _state(c, original.model_id, "portable"), _state(c, copy.model_id, "portable")
    assert a.keys() == b.keys() and any(k.startswith("o.") for k in a)
    for key in a:
        assert torch.equal(a[key], b[key]), key
    # and they train on identically: same step, same optimizer moments
    tok = service.get_tokenizer(BASE)
    data = [_datum(tok.encode("12+3=15")), _datum(tok.encode("7+8=15"))]
    for tc in (original, copy):
        tc.forward_backward(data, "cross_entropy").result()
        assert tc.optim_step(treadle.AdamParams(learning_rate=1e-2)).result().step == 3
    out = [tc.forward_logprobs(data).result().loss_fn_outputs for tc in (original, copy)]
    for x, y in zip(out[0], out[1], strict=True):
        np.testing.assert_array_equal(x.logprobs, y.logprobs)
    # an export comes down from the worker through the store
    exported = copy.export_weights(tmp_path / "peft")
    assert (exported / "adapter_model.safetensors").is_file()
    assert (exported / "adapter_config.json").is_file()
    # streamed rollouts through a worker: each sample once, as sampled without a stream
    sampler = copy.sync_weights()
    params = treadle.SamplingParams(max_tokens=6, seed=11)
    prompt = tok.encode("4+4=")
    with sampler.sample_stream_sync(prompt, 3, params) as stream:
        streamed = {s.index: s.sequence for s in stream}
    whole = sampler.sample(prompt, 3, params).result().sequences
    assert sorted(streamed) == [0, 1, 2]
    for i, seq in enumerate(whole):
        np.testing.assert_array_equal(streamed[i].tokens, seq.tokens)
        np.testing.assert_allclose(streamed[i].logprobs, seq.logprobs, atol=1e-6)
    print(f"\n{c.name}: 3 tenants x 2 RL steps on 2 workers in {loop_s:.1f} s")


def test_worker_killed_mid_forward_backward(cluster: Cluster) -> None:
    c = cluster
    alice = c.client("alice", max_retries=0)
    tok = alice.get_tokenizer(BASE)
    small = [_datum(tok.encode("12+3=15"))]
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

    big = [_datum(list(np.random.default_rng(0).integers(3, 60, 121)))] * 1024
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


def test_server_restart_adopts_models(cluster: Cluster) -> None:
    """The server restarts; the models stay on their live workers and carry on
    where they were (same worker, same step, same seq_id), not from a checkpoint."""
    c = cluster
    alice = c.client("alice")
    tok = alice.get_tokenizer(BASE)
    data = [_datum(tok.encode("12+3=15"))]
    tc = alice.create_lora_training_client(BASE, rank=4, seed=21)
    tc.forward_backward(data, "cross_entropy").result()
    tc.optim_step(treadle.AdamParams(learning_rate=1e-2)).result()
    before = tc.forward_logprobs(data).result().loss_fn_outputs[0].logprobs
    worker = c.worker_of(tc.model_id)
    config = c.server.config
    c.server.stop()
    c.server = EmbeddedServer(config).start()
    again = c.client("alice").get_training_client(tc.model_id)
    info = again.get_info()
    assert info.status == "active" and info.version == 1
    assert c.worker_of(tc.model_id) == worker
    after = again.forward_logprobs(data).result().loss_fn_outputs[0].logprobs
    np.testing.assert_array_equal(before, after)
    again.forward_backward(data, "cross_entropy").result()
    assert again.optim_step(treadle.AdamParams(learning_rate=1e-2)).result().step == 2


def _weights_hash(tc: treadle.TrainingClient, directory: Path) -> str:
    """sha256 of the model's adapter tensors (exported through the store), by name."""
    exported = tc.export_weights(directory)
    tensors = load_file(str(exported / "adapter_model.safetensors"))
    digest = hashlib.sha256()
    for name in sorted(tensors):
        digest.update(name.encode())
        digest.update(tensors[name].contiguous().numpy().tobytes())
    return digest.hexdigest()


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
    data = [_datum(tok.encode("12+3=15")), _datum(tok.encode("7+8=15"))]
    probe = [_datum(tok.encode("4+4=8"))]
    adam = treadle.AdamParams(learning_rate=1e-2)
    twin = alice.create_lora_training_client(BASE, rank=4, seed=51)  # on a worker that stays
    doomed = _one_more_worker(c, "w5", tmp_path, drain_timeout_s=0.0)
    tc = _placed_on(c, alice, doomed, 51)
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
    before = _weights_hash(tc, tmp_path / "before")
    assert before == _weights_hash(twin, tmp_path / "twin")  # deterministic across workers
    logprobs = tc.forward_logprobs(probe).result().loss_fn_outputs[0].logprobs

    c.workers[doomed].send_signal(signal.SIGKILL)
    c.workers[doomed].wait(10)
    deadline = time.monotonic() + 30
    while alice.get_model_info(tc.model_id).status != "lost":
        assert time.monotonic() < deadline, c.log_tail()
        time.sleep(0.2)
    assert alice.get_model_info(tc.model_id).version == 1 + k  # its last applied step

    # its next call brings it back there, on a live worker
    again = tc.forward_logprobs(probe).result().loss_fn_outputs[0].logprobs
    np.testing.assert_array_equal(again, logprobs)
    info = tc.get_info()
    assert info.status == "active" and info.version == 1 + k, info
    assert c.worker_of(tc.model_id) not in ("", doomed)
    assert _weights_hash(tc, tmp_path / "after") == before
    # and it trains on as if nothing happened: the optimizer state came back too
    for model in (tc, twin):
        model.forward_backward(data, "cross_entropy").result()
        assert model.optim_step(adam).result().step == 2 + k
    assert _weights_hash(tc, tmp_path / "next") == _weights_hash(twin, tmp_path / "twin-next")
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
    doomed = _one_more_worker(c, "w6", tmp_path, drain_timeout_s=0.0)
    alice = c.client("alice", max_retries=0)
    tok = alice.get_tokenizer(BASE)
    tc = _placed_on(c, alice, doomed, 61)
    data = [_datum(tok.encode("12+3=15"))]
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


def _one_more_worker(c: Cluster, name: str, tmp: Path, *, drain_timeout_s: float) -> str:
    """Start another worker in the cluster, live when this returns; its id."""
    worker_id = f"{c.name}-{name}-{os.getpid()}"
    c.workers[worker_id], c.logs[worker_id] = _start_worker(
        worker_id, c.model_dir, c.broker, c.database_url, c.store, c.s3_endpoint, tmp,
        drain_timeout_s=drain_timeout_s,
    )  # fmt: skip
    wait_for_workers(c.database_url, [worker_id], timeout_s=120)
    return worker_id


def _placed_on(
    c: Cluster, service: treadle.ServiceClient, worker_id: str, seed: int
) -> treadle.TrainingClient:
    """A new model on ``worker_id`` (a worker just started is the least loaded)."""
    for _ in range(10):
        tc = service.create_lora_training_client(BASE, rank=4, seed=seed)
        if c.worker_of(tc.model_id) == worker_id:
            return tc
    raise AssertionError(f"no model was placed on {worker_id}")


def _wait_status(c: Cluster, worker_id: str, status: str, timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while c.sql("SELECT status FROM workers WHERE id = :w", w=worker_id) != [(status,)]:
        assert time.monotonic() < deadline, f"{worker_id} never {status}\n{c.log_tail()}"
        time.sleep(0.1)


def test_sigterm_drains_the_worker_onto_the_others(cluster: Cluster, tmp_path: Path) -> None:
    """SIGTERM: the worker turns draining and keeps serving while the server
    moves its models off. An idle model is checkpointed at once and comes back
    on another worker at its next call, at the same step and seq_id with the
    same weights; a model holding gradients finishes its step on the draining
    worker first, then moves. Nothing is lost and no call fails."""
    c = cluster
    leaving = _one_more_worker(c, "w3", tmp_path, drain_timeout_s=60.0)
    alice = c.client("alice", max_retries=0)  # a failed call would show, not be retried
    tok = alice.get_tokenizer(BASE)
    data = [_datum(tok.encode("12+3=15")), _datum(tok.encode("7+8=15"))]
    adam = treadle.AdamParams(learning_rate=1e-2)

    idle, busy = _placed_on(c, alice, leaving, 31), _placed_on(c, alice, leaving, 32)
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
    _wait_status(c, leaving, "draining")
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
    leaving = _one_more_worker(c, "w4", tmp_path, drain_timeout_s=2.0)
    alice = c.client("alice", max_retries=0)
    tok = alice.get_tokenizer(BASE)
    data = [_datum(tok.encode("12+3=15"))]
    tc = _placed_on(c, alice, leaving, 41)
    tc.forward_backward(data, "cross_entropy").result()  # gradients held for good
    t0 = time.monotonic()
    c.workers[leaving].send_signal(signal.SIGTERM)
    _wait_status(c, leaving, "draining")
    assert c.workers[leaving].wait(30) == 0, c.log_tail()
    assert time.monotonic() - t0 >= 2.0  # it waited out its drain
    _wait_status(c, leaving, "stopped")
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
