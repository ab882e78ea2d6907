"""Sampler workers apart from the trainer (``--role sampler``, ``--sampler-placement pool``),
on PostgreSQL, Redis and the test S3 server: a server, one trainer worker and two
sampler workers.

A GRPO run through ``treadle.rl.sync_loop`` samples on the pool (never on the
trainer), its sampler and trainer logprobs agree within 1e-4, every token's
version is the trainer's, and the reward rises; an in-flight sync moves the
sequences still generating on a pool worker to the new version; one sampler worker SIGKILLed
mid-run and the run goes on, on the other. A version whose upload fails (the
trainer's store unreachable) fails ``sync_weights`` UNAVAILABLE and the pool
serves the version it had; once the store is back the next sync publishes the
trainer's version and the pool serves it. A model rewound by ``load_state`` has
its pool ``latest`` follow at the next sync, with the loaded weights (never the
files shipped earlier under the same version number). A sampler may choose its
placement at creation (``create_sampling_client`` or ``sync_weights``):
``colocated`` samples on the trainer beside the pool. A
sampler worker drained with SIGTERM answers the sample it is generating, then
exits. With no sampler worker left, a sample answers UNAVAILABLE naming the base model under
``pool`` (a sampler made earlier that chose ``pool`` too; a new one asking for ``pool``
is refused at creation, as is a sync making one, FAILED_PRECONDITION), and one that
chose ``auto`` falls back to the model's own worker.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import treadle
from tests.helpers import next_token_datum
from treadle.rl import Prompt, async_loop, grpo_train_step, sync_loop
from treadle.server.embedded import EmbeddedServer

from ..services import REDIS_URL, fresh_postgres, port_open, wait_for_workers
from .cluster import (
    BASE,
    BUCKET,
    calls_received,
    calls_served,
    create_tenant,
    server_config,
    start_worker,
)
from .freezing_proxy import FreezingProxy

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

PARAMS = treadle.SamplingParams(max_tokens=4, temperature=1.0)


class Pool:
    def __init__(self, server: EmbeddedServer, database_url: str, key: str) -> None:
        self.server, self.database_url, self.key = server, database_url, key
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.logs: dict[str, Path] = {}
        self.proxy: FreezingProxy | None = None
        #: what ``start_worker`` needs after the worker's id (another sampler worker)
        self.worker_args: tuple[Any, ...] = ()

    def tail(self) -> str:
        return "\n".join(
            f"--- {w} ---\n" + "\n".join(p.read_text(errors="replace").splitlines()[-20:])
            for w, p in self.logs.items()
        )

    def sql(self, query: str, **params: object) -> list[tuple[Any, ...]]:
        from sqlalchemy import create_engine, text

        engine = create_engine(self.database_url)
        try:
            with engine.connect() as conn:
                return [tuple(r) for r in conn.execute(text(query), params)]
        finally:
            engine.dispose()


@pytest.fixture(scope="module")
def pool(
    tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path, s3_endpoint: str
) -> Iterator[Pool]:
    if not port_open("127.0.0.1", 6379):
        pytest.skip("redis is not running on 127.0.0.1:6379")
    tmp = tmp_path_factory.mktemp("pool")
    store = f"s3://{BUCKET}/pool"
    with fresh_postgres() as database_url:
        config = server_config(
            tmp, tiny_model_dir, database_url, REDIS_URL, store,
            s3_endpoint_url=s3_endpoint, worker_timeout_s=5.0, sampler_placement="pool",
        )  # fmt: skip
        server = EmbeddedServer(config).start()
        p = Pool(server, database_url, "")
        p.worker_args = (tiny_model_dir, REDIS_URL, database_url, store, s3_endpoint, tmp)
        # the trainer reaches the store through a proxy the last test closes
        p.proxy = FreezingProxy(int(s3_endpoint.rsplit(":", 1)[1]))
        try:
            for name, role, s3 in (
                ("trainer", "trainer", p.proxy.url),
                ("sampler1", "sampler", s3_endpoint),
                ("sampler2", "sampler", s3_endpoint),
            ):
                worker_id = f"pool-{name}-{os.getpid()}"
                p.procs[worker_id], p.logs[worker_id] = start_worker(
                    worker_id, tiny_model_dir, REDIS_URL, database_url, store, s3, tmp,
                    flags=("--role", role), verbose=True,
                )  # fmt: skip
            try:
                wait_for_workers(database_url, list(p.procs), timeout_s=120)
            except TimeoutError as err:
                raise AssertionError(f"{err}\n{p.tail()}") from None
            p.key = create_tenant(database_url, "alice")
            yield p
        finally:
            for proc in p.procs.values():
                if proc.poll() is None:
                    proc.terminate()
            for proc in p.procs.values():
                try:
                    proc.wait(20)
                except subprocess.TimeoutExpired:
                    proc.kill()
            server.stop()
            p.proxy.close()


def _calls_served(p: Pool, worker_id: str, kind: str) -> int:
    return calls_served(p.logs[worker_id], kind)


def _calls_received(p: Pool, worker_id: str, kind: str) -> int:
    return calls_received(p.logs[worker_id], kind)


def prompts() -> Iterator[Prompt]:
    for i in itertools.count():
        yield Prompt(tokens=[1, 5 + i % 7, 9], task=None)


def reward(task: Any, seq: treadle.SampledSequence) -> float:
    """The share of even tokens: about half at first, so every group has a signal."""
    return float(np.mean([t % 2 == 0 for t in seq.tokens])) if seq.tokens else 0.0


def test_roles_are_recorded_and_shown(pool: Pool) -> None:
    from treadle.server.cli import main

    roles = dict(pool.sql("SELECT id, role FROM workers"))
    assert sorted(roles.values()) == ["sampler", "sampler", "trainer"], roles
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["admin", "--database-url", pool.database_url, "list-workers"]) == 0
    table = out.getvalue()
    assert "role" in table.splitlines()[0]
    for worker_id, role in roles.items():
        (line,) = [ln for ln in table.splitlines() if ln.startswith(worker_id)]
        assert role in line.split(), line
    service = treadle.ServiceClient(pool.server.address, api_key=pool.key)
    try:
        shown = {
            w.worker_id: (w.role, w.status, w.base_models)
            for w in service.get_server_info().workers
        }
    finally:
        service.close()
    assert shown == {w: (role, "live", [BASE]) for w, role in roles.items()}


def _wait_served(p: Pool, worker_id: str, kind: str, count: int) -> None:
    """Until the worker's log has ``count`` answers of ``kind`` (written as it answers)."""
    deadline = time.monotonic() + 30
    while _calls_served(p, worker_id, kind) < count:
        assert time.monotonic() < deadline, p.tail()
        time.sleep(0.05)


def test_a_sampler_chooses_its_placement(pool: Pool) -> None:
    """On a ``--sampler-placement pool`` server, a sampler made with
    ``placement="colocated"`` samples on its model's trainer, one made with
    ``placement="pool"`` on the pool; the choice is kept with the sampler."""
    service = treadle.ServiceClient(pool.server.address, api_key=pool.key)
    try:
        tc = service.create_lora_training_client(BASE, rank=4, seed=5)
        trainer_id = next(w for w in pool.procs if "-trainer-" in w)
        samplers = [w for w in pool.procs if "-sampler" in w]
        tc.sync_weights().sampler_id  # noqa: B018 - v0
        prompt = treadle.ModelInput.from_ints([1, 5, 9])
        on_trainer = _calls_served(pool, trainer_id, "SampleCall")
        on_pool = sum(_calls_served(pool, w, "SampleCall") for w in samplers)
        weights = f"treadle://{tc.model_id}/latest"
        colocated = service.create_sampling_client(weights=weights, placement="colocated")
        res = colocated.sample(prompt, num_samples=2, sampling_params=PARAMS).result(120)
        assert {v for s in res.sequences for v in s.token_versions()} == {0}
        _wait_served(pool, trainer_id, "SampleCall", on_trainer + 1)
        assert sum(_calls_served(pool, w, "SampleCall") for w in samplers) == on_pool
        pooled = service.create_sampling_client(weights=weights, placement="pool")
        res = pooled.sample(prompt, num_samples=2, sampling_params=PARAMS).result(120)
        assert {v for s in res.sequences for v in s.token_versions()} == {0}
        deadline = time.monotonic() + 30
        while sum(_calls_served(pool, w, "SampleCall") for w in samplers) == on_pool:
            assert time.monotonic() < deadline, pool.tail()
            time.sleep(0.05)
        assert _calls_served(pool, trainer_id, "SampleCall") == on_trainer + 1
        kept = dict(
            pool.sql(
                "SELECT id, placement FROM samplers WHERE id IN (:a, :b)",
                a=colocated.sampler_id,
                b=pooled.sampler_id,
            )
        )
        assert kept == {colocated.sampler_id: "colocated", pooled.sampler_id: "pool"}
        # the sampler a sync makes chooses the same way (tinker's name too)
        on_pool = sum(_calls_served(pool, w, "SampleCall") for w in samplers)
        synced = tc.sync_weights(placement="colocated")
        res = synced.sample(prompt, num_samples=2, sampling_params=PARAMS).result(120)
        assert {v for s in res.sequences for v in s.token_versions()} == {0}
        _wait_served(pool, trainer_id, "SampleCall", on_trainer + 2)
        assert sum(_calls_served(pool, w, "SampleCall") for w in samplers) == on_pool
        saved = tc.save_weights_and_get_sampling_client(placement="pool")
        res = saved.sample(prompt, num_samples=2, sampling_params=PARAMS).result(120)
        assert {v for s in res.sequences for v in s.token_versions()} == {0}
        deadline = time.monotonic() + 30
        while sum(_calls_served(pool, w, "SampleCall") for w in samplers) == on_pool:
            assert time.monotonic() < deadline, pool.tail()
            time.sleep(0.05)
        assert _calls_served(pool, trainer_id, "SampleCall") == on_trainer + 2
        kept = dict(
            pool.sql(
                "SELECT id, placement FROM samplers WHERE id IN (:a, :b)",
                a=synced.sampler_id,
                b=saved.sampler_id,
            )
        )
        assert kept == {synced.sampler_id: "colocated", saved.sampler_id: "pool"}
    finally:
        service.close()


def test_the_pool_latest_follows_a_model_rewound_by_load_state(pool: Pool) -> None:
    """Model B ships v0..v3 to the pool, then loads model A's checkpoint of step 2:
    its next sync is v2 again, with A's weights, and the pool serves those (sampler
    and trainer logprobs agree), not the v2 files B shipped before."""
    service = treadle.ServiceClient(pool.server.address, api_key=pool.key)
    try:
        tok = service.get_tokenizer(BASE)
        a = service.create_lora_training_client(BASE, rank=4, seed=11)
        b = service.create_lora_training_client(BASE, rank=4, seed=12)
        for tc, text in ((a, "abcabcabc"), (b, "xyzxyzxyz")):
            for _ in range(2):
                tc.forward_backward([next_token_datum(tok.encode(text))], "cross_entropy")
                tc.optim_step(treadle.AdamParams(learning_rate=5e-2))
        saved = a.save_state("at2").result(120)
        assert saved.step == 2
        latest = service.create_sampling_client(weights=f"treadle://{b.model_id}/latest")
        prompt = [1, 5, 9]
        for v in (2, 3):  # B's own v2 and v3 on the pool
            assert b.sync_weights().version == v
            res = latest.sample(prompt, num_samples=1, sampling_params=PARAMS).result(120)
            assert set(res.sequences[0].token_versions()) == {v}
            if v == 2:
                b.forward_backward([next_token_datum(tok.encode("xyzxyz"))], "cross_entropy")
                b.optim_step(treadle.AdamParams(learning_rate=5e-2))
        assert b.load_state(saved.path).result(120) == 2
        assert b.sync_weights().version == 2
        params = treadle.SamplingParams(max_tokens=8, temperature=1.0, seed=3)
        res = latest.sample(prompt, num_samples=4, sampling_params=params).result(120)
        for seq in res.sequences:
            assert set(seq.token_versions()) == {2}
            datum = next_token_datum([*prompt, *seq.tokens])
            (out,) = b.forward_logprobs([datum]).result(120).loss_fn_outputs
            trained = np.asarray(out["logprobs"])[-len(seq.tokens) :]
            assert np.max(np.abs(trained - np.asarray(seq.logprobs))) < 1e-4
    finally:
        service.close()


def test_an_inflight_sync_moves_pool_sequences_to_the_new_version(pool: Pool) -> None:
    """``sync_weights(inflight=True)``: sequences still generating on a pool worker
    continue under the new version from their next token; versions per token say so."""
    service = treadle.ServiceClient(pool.server.address, api_key=pool.key)
    try:
        tc = service.create_lora_training_client(BASE, rank=4, seed=3)
        tok = service.get_tokenizer(BASE)
        trainer_id = next(w for w in pool.procs if "-trainer-" in w)
        on_trainer = _calls_served(pool, trainer_id, "SampleCall")
        tc.sync_weights().sampler_id  # noqa: B018 - v0 on the pool
        latest = service.create_sampling_client(weights=f"treadle://{tc.model_id}/latest")
        prompt = tok.encode("abc")
        samplers = [w for w in pool.procs if "-sampler" in w]
        admitted = sum(_calls_received(pool, w, "SampleCall") for w in samplers)
        # 16 samples of up to 600 tokens: most are still generating when v1 lands
        running = latest.sample(prompt, 16, treadle.SamplingParams(max_tokens=600, seed=4))
        tc.forward_backward([next_token_datum(tok.encode("abcabcabc"))], "cross_entropy")
        tc.optim_step(treadle.AdamParams(learning_rate=5e-2))
        # the sync must find the sample admitted under v0 (on a busy host the pool
        # worker may not have taken it off the queue yet)
        deadline = time.monotonic() + 60
        while sum(_calls_received(pool, w, "SampleCall") for w in samplers) == admitted:
            assert time.monotonic() < deadline, pool.tail()
            time.sleep(0.05)
        assert tc.sync_weights(inflight=True).version == 1
        res = running.result(timeout=240)
        for seq in res.sequences:  # contiguous spans, v0 first, never back to v0
            assert [v.version for v in seq.versions] in ([0], [0, 1]), seq.versions
            assert seq.versions[0].start == 0
            assert sum(v.length for v in seq.versions) == len(seq.tokens)
        switched = [s for s in res.sequences if len(s.versions) == 2]
        assert switched, [len(s.tokens) for s in res.sequences]
        later = latest.sample(prompt, 1, treadle.SamplingParams(max_tokens=4)).result(120)
        assert set(later.sequences[0].token_versions()) == {1}
        # treadle.rl's async loop with in-flight syncs, sampling on the pool
        stats = list(
            async_loop(
                tc, latest, prompts(), reward, steps=3, groups_per_step=2, group_size=4,
                buffer_groups=2, max_staleness=4, inflight=True, sampling_params=PARAMS,
                timeout=120.0,
            )
        )  # fmt: skip
        assert [s.step for s in stats] == [1, 2, 3]
        assert all(s.rollouts == 8 and max(s.staleness) <= 4 for s in stats), stats
        assert tc.get_info().version == 4
        assert _calls_served(pool, trainer_id, "SampleCall") == on_trainer  # all on the pool
    finally:
        service.close()


def _received_by(p: Pool, workers: list[str]) -> dict[str, int]:
    return {w: _calls_received(p, w, "SampleCall") for w in workers}


def _spans(seq: treadle.SampledSequence) -> list[tuple[int, int, int]]:
    return [(v.start, v.length, v.version) for v in seq.versions]


def test_partial_rollouts_resume_on_the_pool_worker_that_keeps_them(pool: Pool) -> None:
    """Partial rollouts (``token_budget``) sampled on the pool resume on the worker
    that keeps them, under the weights the sampler reads now: after a sync, a
    ``latest`` sampler's resumed sequences carry v0 then v1, and each part's
    logprobs agree with the trainer's at its version within 1e-4. Handles kept on
    two pool workers (two sample calls, routed by load) are refused in one resume
    (INVALID_ARGUMENT naming ``resume_handles``, none consumed) and resume one call
    at a time; a handle resumes once."""
    service = treadle.ServiceClient(pool.server.address, api_key=pool.key)
    try:
        tc = service.create_lora_training_client(BASE, rank=4, seed=21)
        trainer_id = next(w for w in pool.procs if "-trainer-" in w)
        samplers = [w for w in pool.procs if "-sampler" in w and pool.procs[w].poll() is None]
        assert len(samplers) == 2, samplers
        routes = pool.server.ctx.dispatcher.pool  # type: ignore[attr-defined]
        deadline = time.monotonic() + 30
        while len(routes.workers(BASE)) < 2:  # the server routes to both (a fresh fixture)
            assert time.monotonic() < deadline, pool.tail()
            time.sleep(0.1)
        on_trainer = _calls_served(pool, trainer_id, "ResumeCall")
        tc.sync_weights().sampler_id  # noqa: B018 - v0 on the pool
        latest = service.create_sampling_client(weights=f"treadle://{tc.model_id}/latest")
        prompt = [1, 5, 9]
        # a long partial sample holds one pool worker...
        before = _received_by(pool, samplers)
        long = latest.sample(
            prompt, 8, treadle.SamplingParams(max_tokens=800, token_budget=400, ignore_eos=True)
        )
        deadline = time.monotonic() + 60
        while _received_by(pool, samplers) == before:
            assert time.monotonic() < deadline, pool.tail()
            time.sleep(0.02)
        (held,) = [w for w, n in _received_by(pool, samplers).items() if n > before[w]]
        # ...so a short one, routed by load, goes to the other
        before = _received_by(pool, samplers)
        budget = treadle.SamplingParams(max_tokens=12, token_budget=4, ignore_eos=True, seed=2)
        short = latest.sample(prompt, 2, budget).result(120)
        (other,) = [w for w, n in _received_by(pool, samplers).items() if n > before[w]]
        assert other != held
        long_res = long.result(240)
        for seq in [*long_res.sequences, *short.sequences]:
            assert seq.stop_reason == "partial" and seq.resume_handle, seq
        mixed = [long_res.sequences[0].resume_handle, short.sequences[0].resume_handle]
        with pytest.raises(
            treadle.InvalidArgumentError, match="resume_handles: kept on 2 sampler workers"
        ):
            latest.resume(mixed, treadle.SamplingParams(max_tokens=800)).result(60)

        # an update between the parts: v1, published to both pool workers
        tc.forward_backward([next_token_datum([1, 5, 9, 7, 3])], "cross_entropy")
        tc.optim_step(treadle.AdamParams(learning_rate=5e-2))
        assert tc.sync_weights().version == 1
        handles = [s.resume_handle or "" for s in short.sequences]
        more = treadle.SamplingParams(max_tokens=12, ignore_eos=True)
        resumed = latest.resume(handles, more).result(120)
        v0 = f"treadle://{tc.model_id}/v/0"
        for seq, first in zip(resumed.sequences, short.sequences, strict=True):
            assert list(seq.tokens[:4]) == list(first.tokens)
            assert _spans(seq) == [(0, 4, 0), (4, 8, 1)], seq.versions
            datum = next_token_datum([*prompt, *seq.tokens])
            now, then = (
                np.asarray(
                    tc.forward_logprobs([datum], reference=ref)
                    .result(120)
                    .loss_fn_outputs[0]["logprobs"]
                )[-12:]
                for ref in (False, v0)
            )
            sampled = np.asarray(seq.logprobs)
            assert np.max(np.abs(then[:4] - sampled[:4])) < 1e-4
            assert np.max(np.abs(now[4:] - sampled[4:])) < 1e-4
        assert _calls_served(pool, other, "ResumeCall") == 1
        assert _calls_served(pool, held, "ResumeCall") == 0
        # the long call's handles (untouched by the refused mix) resume on theirs
        handles = [s.resume_handle or "" for s in long_res.sequences]
        resumed = latest.resume(handles, treadle.SamplingParams(max_tokens=401)).result(240)
        assert [_spans(s) for s in resumed.sequences] == [[(0, 400, 0), (400, 1, 1)]] * 8
        assert _calls_served(pool, held, "ResumeCall") == 1
        assert _calls_served(pool, trainer_id, "ResumeCall") == on_trainer
        with pytest.raises(treadle.NotFoundError, match="not found"):  # each resumes once
            latest.resume(handles[:1], treadle.SamplingParams(max_tokens=402)).result(60)
    finally:
        service.close()


def test_grpo_on_the_pool_agrees_learns_and_survives_a_sampler_kill(pool: Pool) -> None:
    service = treadle.ServiceClient(pool.server.address, api_key=pool.key)
    try:
        tc = service.create_lora_training_client(BASE, rank=8, seed=0)
        trainer_id = next(w for w in pool.procs if "-trainer-" in w)
        samplers = [w for w in pool.procs if "-sampler" in w]
        on_trainer = _calls_served(pool, trainer_id, "SampleCall")
        assert pool.sql("SELECT worker_id FROM models WHERE id = :m", m=tc.model_id) == [
            (trainer_id,)
        ]

        # sampler vs trainer logprobs under one version, sampled on the pool
        sampler = tc.sync_weights()
        prompt = treadle.ModelInput.from_ints([1, 5, 9])
        res = sampler.sample(prompt, num_samples=4, sampling_params=PARAMS).result(120)
        for seq in res.sequences:
            datum = next_token_datum([1, 5, 9, *seq.tokens])
            (out,) = tc.forward_logprobs([datum]).result(120).loss_fn_outputs
            trained = np.asarray(out["logprobs"])[-len(seq.tokens) :]
            assert np.max(np.abs(trained - np.asarray(seq.logprobs))) < 1e-4

        step = grpo_train_step(adam=treadle.AdamParams(learning_rate=0.01))
        kw = dict(steps=12, groups_per_step=4, group_size=8, sampling_params=PARAMS, timeout=240.0)
        stats, killed = [], samplers[0]
        for s in sync_loop(tc, prompts(), reward, train_step=step, **kw):
            stats.append(s)
            if s.step == 3:  # SIGKILL one pool worker while the next batch samples
                threading.Timer(0.3, lambda: pool.procs[killed].send_signal(signal.SIGKILL)).start()
        assert [s.step for s in stats] == list(range(1, 13)), pool.tail()
        assert pool.procs[killed].wait(30) == -signal.SIGKILL
        # on-policy: every token's version is the trainer's, and the ratio is 1
        assert all(s.staleness == {0: 32} for s in stats), [s.staleness for s in stats]
        for s in stats:
            if s.metrics.get("trained_rollouts", 0) > 0:
                assert (
                    abs(s.metrics["ratio:min"] - 1) < 1e-4
                    and abs(s.metrics["ratio:max"] - 1) < 1e-4
                )
        rewards = [s.reward for s in stats]
        assert np.mean(rewards[-3:]) > np.mean(rewards[:3]) + 0.05, rewards
        # sampled on the pool, never on the trainer; the survivor served after the kill
        assert _calls_served(pool, trainer_id, "SampleCall") == on_trainer
        assert all(_calls_served(pool, w, "SampleCall") > 0 for w in samplers), pool.tail()
        assert _calls_served(pool, trainer_id, "ShipVersionCall") >= 9
        after = pool.sql("SELECT status FROM workers WHERE id = :w", w=killed)
        assert after == [("dead",)], after
        # sampled tokens on the pool count in the tenant's usage as colocated ones do
        sampled = sum(len(s.tokens) for s in res.sequences) + 12 * 32 * PARAMS.max_tokens
        ((counted,),) = pool.sql(
            "SELECT tokens_sampled FROM usage WHERE model_id = :m", m=tc.model_id
        )
        assert 0 < counted <= sampled, (counted, sampled)

        # a version that cannot be shipped: UNAVAILABLE, and the pool keeps the old one
        def published() -> list[tuple[Any, ...]]:
            return pool.sql(
                "SELECT max(version) FROM weight_versions WHERE model_id = :m", m=tc.model_id
            )

        before = published()
        latest = service.create_sampling_client(weights=f"treadle://{tc.model_id}/latest")
        assert pool.proxy is not None
        pool.proxy.cut()
        tc.forward_backward([next_token_datum([1, 5, 9, 2])], "cross_entropy").result(120)
        tc.optim_step(treadle.AdamParams(learning_rate=0.01)).result(120)
        with pytest.raises(treadle.UnavailableError, match="could not be shipped"):
            tc.sync_weights().sampler_id  # noqa: B018 - raises the sync's error
        assert published() == before
        (old,) = before[0]
        res = latest.sample(prompt, num_samples=1, sampling_params=PARAMS).result(120)
        assert set(res.sequences[0].token_versions()) == {old}
        # the store back: the next sync publishes the trainer's version (its steps,
        # one more than the pool served) and the pool serves it
        pool.proxy.restore()
        served = sum(_calls_served(pool, w, "SampleCall") for w in samplers[1:])
        assert tc.sync_weights().version == old + 1
        assert published() == [(old + 1,)]
        res = latest.sample(prompt, num_samples=1, sampling_params=PARAMS).result(120)
        assert set(res.sequences[0].token_versions()) == {old + 1}
        _wait_served(pool, samplers[1], "SampleCall", served + 1)
        assert _calls_served(pool, trainer_id, "SampleCall") == on_trainer

        # no pool worker left, under --sampler-placement pool: UNAVAILABLE naming the base
        survivor = samplers[1]
        budget = treadle.SamplingParams(max_tokens=8, token_budget=2, ignore_eos=True)
        kept = latest.sample(prompt, 1, budget).result(120).sequences[0].resume_handle or ""
        assert kept
        weights = f"treadle://{tc.model_id}/latest"
        chose_pool = service.create_sampling_client(weights=weights, placement="pool")
        pool.procs[survivor].send_signal(signal.SIGKILL)
        deadline = time.monotonic() + 60
        while pool.sql("SELECT status FROM workers WHERE id = :w", w=survivor) != [("dead",)]:
            assert time.monotonic() < deadline, pool.tail()
            time.sleep(0.2)
        # its partial rollouts went with it: a resume says so
        with pytest.raises(
            treadle.NotFoundError, match=f"kept on sampler worker {survivor}, which is gone"
        ):
            latest.resume([kept], treadle.SamplingParams(max_tokens=8)).result(60)
        with pytest.raises(
            treadle.UnavailableError,
            match=f"no sampler worker serves base model '{BASE}' \\(--sampler-placement pool",
        ):
            latest.sample(prompt, num_samples=1, sampling_params=PARAMS).result(120)
        # ...as does one that chose the pool itself while the pool served its base
        # (transient: a pool worker may come back)
        with pytest.raises(
            treadle.UnavailableError,
            match=f"no sampler worker serves base model '{BASE}' \\(the sampler's placement pool",
        ):
            chose_pool.sample(prompt, num_samples=1, sampling_params=PARAMS).result(120)
        # a new sampler that asks for the pool is refused when it is made, at once:
        # FAILED_PRECONDITION (the SDK does not retry it; UNAVAILABLE it did, ~6 s)
        with pytest.raises(
            treadle.FailedPreconditionError,
            match=f"no sampler worker serves base model '{BASE}' \\(the sampler's placement pool",
        ):
            service.create_sampling_client(weights=weights, placement="pool")
        # ...as is a sync whose sampler asks for it (FAILED_PRECONDITION: refused in
        # its turn, it takes its seq_id and makes no sampler)
        count = "SELECT count(*) FROM samplers WHERE model_id = :m"
        made = pool.sql(count, m=tc.model_id)
        with pytest.raises(
            treadle.FailedPreconditionError,
            match=f"no sampler worker serves base model '{BASE}' \\(the sampler's placement pool",
        ):
            tc.sync_weights(placement="pool").sampler_id  # noqa: B018 - raises the sync's error
        assert pool.sql(count, m=tc.model_id) == made
        # ...and one that chose auto samples on the model's own worker
        auto = service.create_sampling_client(weights=weights, placement="auto")
        res = auto.sample(prompt, num_samples=2, sampling_params=PARAMS).result(120)
        assert {v for s in res.sequences for v in s.token_versions()} == {old + 1}
        _wait_served(pool, trainer_id, "SampleCall", on_trainer + 1)
        synced = tc.sync_weights(placement="auto")  # the next seq_id: no gap
        res = synced.sample(prompt, num_samples=2, sampling_params=PARAMS).result(120)
        assert {v for s in res.sequences for v in s.token_versions()} == {old + 1}
        _wait_served(pool, trainer_id, "SampleCall", on_trainer + 2)
        # a sync with no pool worker to publish to stands; its sampler, placed on the
        # pool by the server, answers UNAVAILABLE naming the base when it samples
        plain = tc.sync_weights()
        assert plain.version == old + 1
        with pytest.raises(
            treadle.UnavailableError,
            match=f"no sampler worker serves base model '{BASE}' \\(--sampler-placement pool",
        ):
            plain.sample(prompt, num_samples=1, sampling_params=PARAMS).result(120)
    finally:
        service.close()


def test_a_draining_sampler_worker_finishes_its_samples(pool: Pool) -> None:
    """SIGTERM to a pool worker with ``--drain-timeout``: it turns ``draining``,
    the samples it is generating finish and are answered, and then it exits 0."""
    worker_id = f"pool-sampler3-{os.getpid()}"
    pool.procs[worker_id], pool.logs[worker_id] = start_worker(
        worker_id, *pool.worker_args, drain_timeout_s=120.0,
        flags=("--role", "sampler"), verbose=True,
    )  # fmt: skip
    wait_for_workers(pool.database_url, [worker_id], timeout_s=120)
    service = treadle.ServiceClient(pool.server.address, api_key=pool.key)
    try:
        tc = service.create_lora_training_client(BASE, rank=4, seed=11)
        sampler = tc.sync_weights()  # the only live pool worker is the new one
        prompt = service.get_tokenizer(BASE).encode("abc")
        running = sampler.sample(prompt, 8, treadle.SamplingParams(max_tokens=600, seed=2))
        deadline = time.monotonic() + 60
        while _calls_received(pool, worker_id, "SampleCall") == 0:
            assert time.monotonic() < deadline, pool.tail()
            time.sleep(0.05)
        assert _calls_served(pool, worker_id, "SampleCall") == 0  # still generating
        pool.procs[worker_id].send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 30
        while pool.sql("SELECT status FROM workers WHERE id = :w", w=worker_id) != [("draining",)]:
            assert pool.procs[worker_id].poll() is None, pool.tail()
            assert time.monotonic() < deadline, pool.tail()
            time.sleep(0.05)
        res = running.result(timeout=180)
        assert len(res.sequences) == 8
        assert all(s.tokens and set(s.token_versions()) == {0} for s in res.sequences)
        assert _calls_served(pool, worker_id, "SampleCall") == 1  # answered by the drainer
        assert pool.procs[worker_id].wait(120) == 0, pool.tail()
    finally:
        service.close()
