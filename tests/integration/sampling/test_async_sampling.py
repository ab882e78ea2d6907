"""Async RL through the SDK: in-flight weight updates (PipelineRL) and streamed
rollouts, on an embedded server with the tiny model; their bad input."""

from __future__ import annotations

import asyncio
import time

import pytest

import treadle
from tests.helpers import next_token_datum, tenant_key
from treadle.server.embedded import EmbeddedServer

BASE = "tiny"


#: a third of the tiny vocabulary stops a row: lengths spread between 1 and max_tokens
STOPS = list(range(3, 40))


# ---- in-flight weight updates ----------------------------------------------------------


def test_inflight_sync_switches_sequences_still_generating(
    service: treadle.ServiceClient, tok: treadle.Tokenizer
) -> None:
    tc = service.create_lora_training_client(BASE, rank=4, seed=3)
    latest = service.create_sampling_client(weights=f"treadle://{tc.model_id}/latest")
    prompt = tok.encode("abc")
    # 16 samples with lengths from 1 to ~500 tokens (this seed) on the latest sampler
    params = treadle.SamplingParams(max_tokens=600, seed=4)
    running = latest.sample(prompt, 16, params)
    # a step and an in-flight sync, all sent at once: they land a few decode steps in
    datum = next_token_datum(tok.encode("abcabcabc"))
    tc.forward_backward([datum], "cross_entropy")
    tc.optim_step(treadle.AdamParams(learning_rate=5e-2))
    pinned = tc.sync_weights(inflight=True)
    assert pinned.version == 1
    res = running.result(timeout=120)
    for seq in res.sequences:  # contiguous spans, v0 first, never back to v0
        assert seq.versions[0].start == 0 and seq.versions[0].version == 0
        assert [v.version for v in seq.versions] in ([0], [0, 1])
        assert sum(v.length for v in seq.versions) == len(seq.tokens)
    switched = [s for s in res.sequences if len(s.versions) == 2]
    assert switched, [len(s.tokens) for s in res.sequences]
    assert all(s.versions[1].start == s.versions[0].length for s in switched)
    # a later request on the latest sampler starts on v1, as with a plain sync
    later = latest.sample(prompt, 1, treadle.SamplingParams(max_tokens=4)).result(timeout=30)
    assert later.sequences[0].token_versions() == [1] * len(later.sequences[0].tokens)


def test_inflight_sync_without_a_latest_sampler_is_invalid_argument(
    service: treadle.ServiceClient, tok: treadle.Tokenizer
) -> None:
    tc = service.create_lora_training_client(BASE, rank=4, seed=5)
    # a pinned sampler does not count: nothing on it could take the update
    service.create_sampling_client(weights=f"treadle://{tc.model_id}/v/0").sampler_id  # noqa: B018
    with pytest.raises(treadle.InvalidArgumentError, match="latest"):
        tc.sync_weights(inflight=True).sampler_id  # noqa: B018
    # the rejected call took its seq_id: the model goes on
    assert tc.sync_weights().version == 0
    latest = service.create_sampling_client(weights=f"treadle://{tc.model_id}/latest")
    assert latest.version is None
    assert tc.sync_weights(inflight=True).version == 0
    # another tenant's latest sampler is no sampler of this one: covered by the query's
    # tenant filter (one tenant per embedded server here)


# ---- streamed rollouts ------------------------------------------------------------------


def test_stream_yields_sequences_as_they_finish(
    service: treadle.ServiceClient, tok: treadle.Tokenizer
) -> None:
    sampler = service.create_sampling_client(BASE)
    prompt = tok.encode("ab")
    params = treadle.SamplingParams(max_tokens=40, seed=9, stop=STOPS)
    got = list(sampler.sample_stream_sync(prompt, 8, params))
    assert sorted(g.index for g in got) == list(range(8))  # all G, each once
    lengths = [len(g.sequence.tokens) for g in got]
    assert lengths == sorted(lengths) and lengths[0] < lengths[-1]  # short before long
    # the same sequences as the unary call with the same seed
    whole = sampler.sample(prompt, 8, params).result(timeout=30)
    for g in got:
        assert g.sequence.tokens == whole.sequences[g.index].tokens
        assert g.sequence.versions == whole.sequences[g.index].versions
        assert g.sequence.stop_reason == whole.sequences[g.index].stop_reason


def test_async_stream(service: treadle.ServiceClient, tok: treadle.Tokenizer) -> None:
    sampler = service.create_sampling_client(BASE)
    params = treadle.SamplingParams(max_tokens=30, seed=1, stop=STOPS)

    async def collect() -> list[treadle.StreamedSample]:
        return [s async for s in sampler.sample_stream(tok.encode("ba"), 5, params)]

    got = asyncio.run(collect())
    assert sorted(g.index for g in got) == list(range(5))
    lengths = [len(g.sequence.tokens) for g in got]
    assert lengths == sorted(lengths)


def test_leaving_a_stream_cancels_the_rest(
    service: treadle.ServiceClient, tok: treadle.Tokenizer
) -> None:
    sampler = service.create_sampling_client(BASE)
    prompt = tok.encode("abc")
    params = treadle.SamplingParams(max_tokens=600, seed=4)  # lengths from a few to ~500
    lengths = sorted(len(s.tokens) for s in sampler.sample(prompt, 16, params).result().sequences)
    full = sum(lengths)
    assert 16 * lengths[0] < full / 4, lengths  # the premise: the shortest ends long before

    def generated() -> int:
        time.sleep(0.3)  # the engine publishes its stats 4x a second, and once idle
        (m,) = service.get_server_info().sampler_metrics
        return m.tokens_generated

    before = generated()
    with sampler.sample_stream_sync(prompt, 16, params) as stream:
        first = next(stream)  # the shortest sample (same seed): the rest are still generating
        assert len(first.sequence.tokens) == lengths[0]
    spent = generated() - before
    assert spent < full / 2, (spent, full)


def test_stream_bad_input_is_the_unary_error(
    service: treadle.ServiceClient, tok: treadle.Tokenizer
) -> None:
    sampler = service.create_sampling_client(BASE)
    with pytest.raises(treadle.InvalidArgumentError, match="temperature"):
        list(sampler.sample_stream_sync(tok.encode("a"), 1, treadle.SamplingParams(temperature=-1)))


# ---- partial rollouts -------------------------------------------------------------------


def test_a_resumed_partial_rollout_continues_the_same_sequence(
    service: treadle.ServiceClient, tok: treadle.Tokenizer
) -> None:
    tc = service.create_lora_training_client(BASE, rank=4, seed=7)
    latest = service.create_sampling_client(weights=f"treadle://{tc.model_id}/latest")
    prompt = tok.encode("abc")
    budget = treadle.SamplingParams(max_tokens=30, seed=4, token_budget=5)
    first = latest.sample(prompt, 8, budget).result(timeout=30).sequences
    partial = [s for s in first if s.stop_reason == "partial"]
    assert partial, [s.stop_reason for s in first]
    for s in partial:
        assert len(s.tokens) == 5 and s.resume_handle and s.token_versions() == [0] * 5
    datum = next_token_datum(tok.encode("abcabcabc"))
    tc.forward_backward([datum], "cross_entropy")
    tc.optim_step(treadle.AdamParams(learning_rate=5e-2))
    assert tc.sync_weights().version == 1
    handles = [s.resume_handle for s in partial]
    rest = treadle.SamplingParams(max_tokens=30, seed=5)
    whole = latest.resume(handles, rest).result(timeout=30).sequences
    assert len(whole) == len(partial)
    for part, seq in zip(partial, whole, strict=True):
        assert seq.tokens[:5] == part.tokens and seq.logprobs[:5] == part.logprobs
        assert seq.stop_reason in ("stop", "length") and seq.resume_handle is None
        assert seq.token_versions() == [0] * 5 + [1] * (len(seq.tokens) - 5)
        # the continuation was sampled under v1, over the whole sequence prefilled
        # under v1: the trainer's logprobs (now v1) agree on it
        full = [*prompt, *seq.tokens]
        ref = (
            tc.forward_logprobs(
                [
                    treadle.Datum(
                        model_input=treadle.ModelInput.from_ints(full[:-1]),
                        loss_fn_inputs={"target_tokens": full[1:]},
                    )
                ]
            )
            .result(timeout=30)
            .loss_fn_outputs[0]
            .logprobs
        )
        got = seq.logprobs[5:]
        want = list(ref[len(prompt) - 1 :][5:])
        assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 2e-4
    # consumed now: NOT_FOUND, exactly as for a handle that never existed
    with pytest.raises(treadle.NotFoundError) as consumed:
        latest.resume(handles[:1], rest).result(timeout=30)
    with pytest.raises(treadle.NotFoundError) as never:
        latest.resume(["rh-never-existed"], rest).result(timeout=30)
    shown = [
        str(e.value).replace(h[:48], "H")
        for e, h in ((consumed, handles[0]), (never, "rh-never-existed"))
    ]
    assert shown[0] == shown[1]


def test_a_handle_of_another_model_or_tenant_is_not_found(
    server: EmbeddedServer, service: treadle.ServiceClient, tok: treadle.Tokenizer
) -> None:

    tc = service.create_lora_training_client(BASE, rank=4, seed=8)
    mine = service.create_sampling_client(weights=f"treadle://{tc.model_id}/latest")
    params = treadle.SamplingParams(max_tokens=30, seed=4, token_budget=2)
    seqs = mine.sample(tok.encode("abc"), 4, params).result(timeout=30).sequences
    handle = next(s.resume_handle for s in seqs if s.resume_handle)
    other_model = service.create_lora_training_client(BASE, rank=4, seed=9)
    theirs = service.create_sampling_client(weights=f"treadle://{other_model.model_id}/latest")
    base = service.create_sampling_client(BASE)
    for sampler in (theirs, base):
        with pytest.raises(treadle.NotFoundError, match="resume handle"):
            sampler.resume([handle], params).result(timeout=30)
    key = tenant_key(server, "intruder")
    intruder = treadle.ServiceClient(server.address, api_key=key)
    try:
        # the intruder cannot even name our sampler; with its own base sampler the
        # handle is NOT_FOUND like any other
        with pytest.raises(treadle.NotFoundError):
            intruder.create_sampling_client(BASE).resume([handle], params).result(timeout=30)
    finally:
        intruder.close()
    # none of that consumed it
    (whole,) = (
        mine.resume([handle], treadle.SamplingParams(max_tokens=6)).result(timeout=30).sequences
    )
    assert whole.tokens[:2] == next(s.tokens for s in seqs if s.resume_handle == handle)


def test_bad_partial_budgets_are_invalid_argument(
    service: treadle.ServiceClient, tok: treadle.Tokenizer
) -> None:
    sampler = service.create_sampling_client(BASE)
    with pytest.raises(treadle.InvalidArgumentError, match="token_budget"):
        sampler.sample(tok.encode("a"), 1, treadle.SamplingParams(token_budget=-1)).result(
            timeout=30
        )
    with pytest.raises(treadle.InvalidArgumentError, match="resume_handles"):
        sampler.resume([])
