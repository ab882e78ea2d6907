"""The bar every sampler backend meets (``tests/sampler_backends.py`` lists them),
through the SDK against a served tiny model, one server per backend.

Same seed, same tokens whatever shares the batch; behaviour logprobs agree
with ``forward_logprobs`` on the same weights; stop reasons; ``n = G``; rows of
three tenants' adapters at different versions in one batch equal to each run
alone; an in-flight update shows as a second version span; a partial rollout
resumes into the same sequence; bad input is INVALID_ARGUMENT naming the
field; more requests than rows are queued (or RESOURCE_EXHAUSTED), never a
dead worker.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import treadle
from tests.sampler_backends import BACKENDS, BackendCase
from treadle.server.config import ServerConfig
from treadle.server.embedded import EmbeddedServer

BASE = "tiny"
SLOTS = 16
pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module", params=BACKENDS, ids=[b.name for b in BACKENDS])
def backend(request: pytest.FixtureRequest) -> BackendCase:
    case: BackendCase = request.param
    reason = case.skip_reason()
    if reason is not None:
        pytest.skip(reason)
    return case


@pytest.fixture(scope="module")
def server(
    backend: BackendCase,
    tmp_path_factory: pytest.TempPathFactory,
    tiny_model_dir: Path,
    request: pytest.FixtureRequest,
) -> Iterator[EmbeddedServer]:
    if backend.session_server:  # shared by the session (it serves BASE with SLOTS rows)
        yield request.getfixturevalue(backend.session_server)
        return
    settings = {"threads": 1, "sampler_slots": SLOTS, **backend.settings}
    config = ServerConfig(
        data_dir=tmp_path_factory.mktemp(f"conformance-{backend.name}") / "data",
        models={BASE: tiny_model_dir},
        port=0,
        sampler=backend.name,
        **settings,
    )
    srv = EmbeddedServer(config).start()
    yield srv
    srv.stop()


def _datum(tokens: list[int], weights: bool = True) -> treadle.Datum:
    inputs: dict[str, list[int] | list[float]] = {"target_tokens": tokens[1:]}
    if weights:
        inputs["weights"] = [1.0] * (len(tokens) - 1)
    return treadle.Datum(
        model_input=treadle.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs=inputs
    )


def _step(tc: treadle.TrainingClient, tok: treadle.Tokenizer, text: str = "abcabcabc") -> None:
    """One SFT step, so the weights move away from the last version."""
    tc.forward_backward([_datum(tok.encode(text))], "cross_entropy")
    tc.optim_step(treadle.AdamParams(learning_rate=5e-2)).result(timeout=60)


def _train_and_sync_inflight(tc: treadle.TrainingClient, tok: treadle.Tokenizer) -> None:
    """A step and an in-flight sync, sent at once: they land while rows decode."""
    tc.forward_backward([_datum(tok.encode("abcabcabc"))], "cross_entropy")
    tc.optim_step(treadle.AdamParams(learning_rate=5e-2))
    assert tc.sync_weights(inflight=True).version == 1


def _assert_v0_then_v1(response: treadle.SampleResponse, max_tokens: int) -> None:
    """Every sequence ran ``max_tokens`` tokens: version 0, then version 1 to its end."""
    for seq in response.sequences:
        spans = [(v.start, v.length, v.version) for v in seq.versions]
        assert len(spans) == 2, spans  # v0 then v1, contiguous, never back
        (s0, n0, v0), (s1, n1, v1) = spans
        assert (s0, v0, v1, s1, n0 + n1) == (0, 0, 1, n0, max_tokens)


def _trainer_logprobs(
    tc: treadle.TrainingClient, prompt: list[int], seq: treadle.SampledSequence, temperature: float
) -> np.ndarray:
    full = [*prompt, *seq.tokens]
    out = tc.forward_logprobs([_datum(full, weights=False)], temperature=temperature).result(60)
    return np.asarray(out.loss_fn_outputs[0].logprobs[len(prompt) - 1 :])


# ---- reproducibility and agreement ------------------------------------------------------


def test_same_seed_same_tokens_whatever_shares_the_batch(
    service: treadle.ServiceClient, tok: treadle.Tokenizer, backend: BackendCase
) -> None:
    sampler = service.create_sampling_client(BASE)
    prompt = tok.encode("12+3=")
    params = treadle.SamplingParams(max_tokens=24, temperature=0.9, seed=11)
    alone = sampler.sample(prompt, 3, params).result(timeout=60).sequences
    # now beside other requests: other prompts, lengths, temperatures, seeds
    others = [
        sampler.sample(tok.encode(p), g, treadle.SamplingParams(max_tokens=n, seed=s))
        for p, g, n, s in (("Hello", 4, 40, 1), ("x", 2, 8, 2), ("4*5=", 5, 30, None))
    ]
    crowded = sampler.sample(prompt, 3, params)
    for o in others:
        o.result(timeout=60)
    for a, b in zip(alone, crowded.result(timeout=60).sequences, strict=True):
        assert a.tokens == b.tokens
        assert np.abs(np.subtract(a.logprobs, b.logprobs)).max() <= backend.logprob_tolerance


@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.7, 0.9)])
def test_behaviour_logprobs_agree_with_the_trainer(
    service: treadle.ServiceClient,
    tok: treadle.Tokenizer,
    backend: BackendCase,
    temperature: float,
    top_p: float,
) -> None:
    tc = service.create_lora_training_client(BASE, rank=4, seed=21)
    _step(tc, tok)
    sampler = tc.sync_weights()
    params = treadle.SamplingParams(max_tokens=16, temperature=temperature, top_p=top_p, seed=3)
    if top_p < 1 and not backend.truncates:
        with pytest.raises(treadle.InvalidArgumentError, match="top_p"):
            sampler.sample(tok.encode("abc"), 2, params).result(timeout=60)
        return
    worst = 0.0
    for text in ("12+3=", "Hello"):
        prompt = tok.encode(text)
        for seq in sampler.sample(prompt, 4, params).result(timeout=60).sequences:
            want = _trainer_logprobs(tc, prompt, seq, temperature)
            worst = max(worst, float(np.abs(want - np.asarray(seq.logprobs)).max()))
    assert worst <= backend.logprob_tolerance


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_prompt_logprobs_agree_with_the_trainer(
    service: treadle.ServiceClient,
    tok: treadle.Tokenizer,
    backend: BackendCase,
    temperature: float,
) -> None:
    """Every prompt token's score (None for the first) and the top k at each
    position, from the prefill: forward_logprobs' numbers at the same T."""
    tc = service.create_lora_training_client(BASE, rank=4, seed=22)
    _step(tc, tok)
    sampler = tc.sync_weights()
    prompt = tok.encode("12+3=15, Hello abcabc")
    params = treadle.SamplingParams(max_tokens=2, temperature=temperature, seed=4)
    if not backend.scores_prompt:
        with pytest.raises(treadle.InvalidArgumentError, match="prompt_logprobs"):
            sampler.sample(prompt, 1, params, include_prompt_logprobs=True).result(timeout=60)
        return
    k = 3
    res = sampler.sample(prompt, 2, params, True, topk_prompt_logprobs=k).result(timeout=60)
    got, topk = res.prompt_logprobs, res.topk_prompt_logprobs
    assert got is not None and topk is not None
    assert len(got) == len(topk) == len(prompt) and got[0] is None and topk[0] is None
    full = tc.forward_logprobs([_datum(prompt, weights=False)], temperature=temperature)
    want = np.asarray(full.result(60).loss_fn_outputs[0].logprobs)
    assert np.abs(np.asarray(got[1:], dtype=np.float64) - want).max() <= backend.logprob_tolerance
    for lp, row in zip(got[1:], topk[1:], strict=True):
        assert row is not None and len(row) == k
        lps = [x for _, x in row]
        assert lps == sorted(lps, reverse=True)
        assert lp is not None and lp <= lps[0] + backend.logprob_tolerance
    assert len(res.sequences) == 2  # the samples come as asked


# ---- what comes back -------------------------------------------------------------------


def test_n_samples_with_their_versions(
    service: treadle.ServiceClient, tok: treadle.Tokenizer
) -> None:
    tc = service.create_lora_training_client(BASE, rank=4, seed=22)
    _step(tc, tok)
    sampler = tc.sync_weights()
    res = sampler.sample(tok.encode("abc"), 8, treadle.SamplingParams(max_tokens=12, seed=5))
    seqs = res.result(timeout=60).sequences
    assert len(seqs) == 8
    for seq in seqs:
        assert 1 <= len(seq.tokens) <= 12 and len(seq.logprobs) == len(seq.tokens)
        assert seq.token_versions() == [1] * len(seq.tokens)


def _why(seq: treadle.SampledSequence) -> str:
    return seq.stopped_by or seq.stop_reason if seq.stop_reason == "stop" else seq.stop_reason


def test_stop_reasons(service: treadle.ServiceClient, tok: treadle.Tokenizer) -> None:
    sampler = service.create_sampling_client(BASE)
    prompt = tok.encode("abc")
    stops = list(range(3, 40))  # a third of the vocabulary: most rows stop early
    by_token = sampler.sample(
        prompt, 8, treadle.SamplingParams(max_tokens=30, seed=1, stop=stops, ignore_eos=True)
    ).result(timeout=60)
    reasons = {_why(s) for s in by_token.sequences}
    assert reasons <= {"stop_token", "length"} and "stop_token" in reasons
    for s in by_token.sequences:
        if _why(s) == "stop_token":
            assert s.tokens[-1] in stops and not set(s.tokens[:-1]) & set(stops)
        else:
            assert len(s.tokens) == 30
    free = sampler.sample(
        prompt, 4, treadle.SamplingParams(max_tokens=30, seed=1, ignore_eos=True)
    ).result(timeout=60)
    stop_string = tok.decode(free.sequences[0].tokens[2:4])  # met after 4 tokens
    by_string = sampler.sample(
        prompt, 4, treadle.SamplingParams(max_tokens=30, seed=1, stop=stop_string, ignore_eos=True)
    ).result(timeout=60)
    assert {_why(s) for s in by_string.sequences} <= {"stop_string", "length"}
    first = by_string.sequences[0]  # the same seed: the same tokens until the stop
    assert _why(first) == "stop_string" and first.tokens == free.sequences[0].tokens[:4]
    for s in by_string.sequences:
        if _why(s) == "stop_string":
            assert stop_string in tok.decode(s.tokens)
            assert stop_string not in tok.decode(s.tokens[:-1])
    assert [(_why(s), len(s.tokens)) for s in free.sequences] == [("length", 30)] * 4


def test_three_tenants_adapters_in_one_batch_equal_each_alone(
    server: EmbeddedServer,
    service: treadle.ServiceClient,
    tok: treadle.Tokenizer,
    backend: BackendCase,
) -> None:
    from treadle.server.auth import generate_key, hash_key
    from treadle.server.db import queries

    assert server.ctx is not None
    clients = [service]
    for name in ("tenant-b", "tenant-c"):
        key = generate_key()
        with server.ctx.sessions() as s:
            tenant = queries.ensure_tenant(s, name)
            queries.create_api_key(s, tenant.id, hash_key(key), key[:12])
            s.commit()
        clients.append(treadle.ServiceClient(server.address, api_key=key))
    try:
        samplers = []
        for i, client in enumerate(clients):  # tenant i's adapter, pinned at version i + 1
            tc = client.create_lora_training_client(BASE, rank=4, seed=30 + i)
            for _ in range(i + 1):
                _step(tc, tok, text="abcabcabc"[i:] + "xyz")
            samplers.append(tc.sync_weights())
        assert [s.version for s in samplers] == [1, 2, 3]
        prompt = tok.encode("Hello")
        params = treadle.SamplingParams(max_tokens=20, temperature=0.8, seed=9)
        alone = [s.sample(prompt, 2, params).result(timeout=60).sequences for s in samplers]
        together = [s.sample(prompt, 2, params) for s in samplers]
        for seqs, fut, version in zip(alone, together, (1, 2, 3), strict=True):
            mixed = fut.result(timeout=60).sequences
            for a, b in zip(seqs, mixed, strict=True):
                assert a.tokens == b.tokens and a.token_versions() == [version] * len(a.tokens)
                diff = np.abs(np.subtract(a.logprobs, b.logprobs)).max()
                assert diff <= backend.logprob_tolerance
        # the adapters differ: not one of them samples what another does
        firsts = [tuple(seqs[0].tokens) for seqs in alone]
        assert len(set(firsts)) == 3
    finally:
        for client in clients[1:]:
            client.close()


# ---- async RL ------------------------------------------------------------------------


def test_an_inflight_update_shows_as_a_second_version_span(
    service: treadle.ServiceClient, tok: treadle.Tokenizer
) -> None:
    tc = service.create_lora_training_client(BASE, rank=4, seed=40)
    latest = service.create_sampling_client(weights=f"treadle://{tc.model_id}/latest")
    pinned = service.create_sampling_client(weights=f"treadle://{tc.model_id}/v/0")
    params = treadle.SamplingParams(max_tokens=1000, seed=4, ignore_eos=True)
    # v0 served once first (a backend may load it on first use: vLLM writes and
    # loads the adapter), so the rows below are decoding when the update lands
    latest.sample(tok.encode("abc"), 1, treadle.SamplingParams(max_tokens=2)).result(timeout=180)
    running = latest.sample(tok.encode("abc"), 8, params)
    beside = [
        s.sample(tok.encode("abc"), 1, params)
        for s in (pinned, service.create_sampling_client(BASE))
    ]
    # a step and an in-flight sync, sent at once: they land while the rows decode
    _train_and_sync_inflight(tc, tok)
    _assert_v0_then_v1(running.result(timeout=180), 1000)
    # neither a pinned version nor the base follows the model's updates
    for fut in beside:
        assert fut.result(timeout=180).sequences[0].token_versions() == [0] * 1000
    # a request admitted after the update samples the new version from its start
    after = latest.sample(tok.encode("abc"), 1, treadle.SamplingParams(max_tokens=4))
    assert set(after.result(timeout=60).sequences[0].token_versions()) == {1}


#: a full fine-tune's first sample may start an engine of its own (vLLM: minutes on 2 busy cores)
FIRST_FULL_S = 600


@pytest.mark.timeout(900)
def test_a_full_fine_tunes_versions_sample_their_own_weights(
    service: treadle.ServiceClient, tok: treadle.Tokenizer, backend: BackendCase
) -> None:
    """A full fine-tune's versions, pinned and latest, each sampled under its own
    weights (on vLLM: swapped in and out of the model's engine), beside the base."""
    tc = service.create_training_client(BASE, seed=50)
    prompt = tok.encode("12+3=")
    params = treadle.SamplingParams(max_tokens=16, seed=7, ignore_eos=True)
    base = service.create_sampling_client(BASE).sample(prompt, 2, params).result(60).sequences
    _step(tc, tok)
    v1 = tc.sync_weights()
    first = v1.sample(prompt, 2, params).result(timeout=FIRST_FULL_S).sequences
    worst = 0.0
    for seq in first:
        assert seq.token_versions() == [1] * 16
        worst = max(
            worst, float(np.abs(_trainer_logprobs(tc, prompt, seq, 1.0) - seq.logprobs).max())
        )
    assert [s.tokens for s in first] != [s.tokens for s in base]  # v1 is not the base
    _step(tc, tok)
    v2 = tc.sync_weights()
    # v1 again (its engine holds v2 by now on vLLM), v2 and the base, all at once
    again, latest, base_again = (
        c.sample(prompt, 2, params) for c in (v1, v2, service.create_sampling_client(BASE))
    )
    for a, b in zip(first, again.result(timeout=120).sequences, strict=True):
        assert a.tokens == b.tokens
        assert np.abs(np.subtract(a.logprobs, b.logprobs)).max() <= backend.logprob_tolerance
    for seq in latest.result(timeout=120).sequences:
        assert seq.token_versions() == [2] * 16
        worst = max(
            worst, float(np.abs(_trainer_logprobs(tc, prompt, seq, 1.0) - seq.logprobs).max())
        )
    assert worst <= backend.logprob_tolerance
    for a, b in zip(base, base_again.result(timeout=120).sequences, strict=True):
        assert a.tokens == b.tokens  # the base model's weights untouched


@pytest.mark.timeout(900)
def test_a_full_fine_tunes_inflight_update_shows_as_a_second_version_span(
    service: treadle.ServiceClient, tok: treadle.Tokenizer
) -> None:
    tc = service.create_training_client(BASE, seed=51)
    tc.sync_weights()
    latest = service.create_sampling_client(weights=f"treadle://{tc.model_id}/latest")
    pinned = service.create_sampling_client(weights=f"treadle://{tc.model_id}/v/0")
    params = treadle.SamplingParams(max_tokens=600, seed=4, ignore_eos=True)
    latest.sample([1, 2], 1).result(timeout=FIRST_FULL_S)  # its engine started (vLLM)
    running = latest.sample(tok.encode("abc"), 4, params)
    beside = pinned.sample(tok.encode("abc"), 1, params)
    _train_and_sync_inflight(tc, tok)
    _assert_v0_then_v1(running.result(timeout=240), 600)
    assert beside.result(timeout=240).sequences[0].token_versions() == [0] * 600
    after = latest.sample(tok.encode("abc"), 1, treadle.SamplingParams(max_tokens=4))
    assert set(after.result(timeout=60).sequences[0].token_versions()) == {1}


def test_a_partial_rollout_resumes_into_the_same_sequence(
    service: treadle.ServiceClient, tok: treadle.Tokenizer, backend: BackendCase
) -> None:
    tc = service.create_lora_training_client(BASE, rank=4, seed=41)
    latest = service.create_sampling_client(weights=f"treadle://{tc.model_id}/latest")
    prompt = tok.encode("abc")
    budget = treadle.SamplingParams(max_tokens=20, seed=4, token_budget=5, ignore_eos=True)
    first = latest.sample(prompt, 4, budget).result(timeout=60).sequences
    assert [(s.stop_reason, len(s.tokens)) for s in first] == [("partial", 5)] * 4
    _step(tc, tok)
    assert tc.sync_weights().version == 1
    rest = treadle.SamplingParams(max_tokens=20, seed=5, ignore_eos=True)
    whole = latest.resume([s.resume_handle for s in first], rest).result(timeout=60).sequences
    for part, seq in zip(first, whole, strict=True):
        assert seq.tokens[:5] == part.tokens and seq.logprobs[:5] == part.logprobs
        assert (seq.stop_reason, len(seq.tokens), seq.resume_handle) == ("length", 20, None)
        assert seq.token_versions() == [0] * 5 + [1] * 15
        # the continuation is v1's, over the whole sequence prefilled under v1
        want = _trainer_logprobs(tc, prompt, seq, 1.0)[5:]
        assert np.abs(want - np.asarray(seq.logprobs[5:])).max() <= 2 * backend.logprob_tolerance
    with pytest.raises(treadle.NotFoundError, match="resume handle"):
        latest.resume([first[0].resume_handle], rest).result(timeout=60)  # consumed


def test_a_resume_refused_consumes_nothing(
    service: treadle.ServiceClient, tok: treadle.Tokenizer
) -> None:
    sampler = service.create_sampling_client(BASE)
    budget = treadle.SamplingParams(max_tokens=20, seed=6, token_budget=4, ignore_eos=True)
    (part,) = sampler.sample(tok.encode("ab"), 1, budget).result(timeout=60).sequences
    assert part.resume_handle is not None
    with pytest.raises(treadle.InvalidArgumentError, match="max_tokens: counts the whole"):
        sampler.resume([part.resume_handle], treadle.SamplingParams(max_tokens=4)).result(60)
    with pytest.raises(treadle.NotFoundError, match="resume handle"):
        sampler.resume([part.resume_handle, "rh-nope"], budget).result(timeout=60)
    with pytest.raises(treadle.InvalidArgumentError, match="resume_handles"):
        sampler.resume([]).result(timeout=60)
    rest = treadle.SamplingParams(max_tokens=6, ignore_eos=True)
    (whole,) = sampler.resume([part.resume_handle], rest).result(timeout=60).sequences
    assert whole.tokens[:4] == part.tokens and len(whole.tokens) == 6


def test_a_stream_yields_the_same_sequences_as_they_finish(
    service: treadle.ServiceClient, tok: treadle.Tokenizer
) -> None:
    sampler = service.create_sampling_client(BASE)
    prompt = tok.encode("ab")
    params = treadle.SamplingParams(max_tokens=40, seed=9, stop=list(range(3, 40)))
    got = list(sampler.sample_stream_sync(prompt, 6, params))
    assert sorted(g.index for g in got) == list(range(6))  # all G, each once
    lengths = [len(g.sequence.tokens) for g in got]
    assert lengths == sorted(lengths)  # short ones first
    whole = sampler.sample(prompt, 6, params).result(timeout=60)
    for g in got:
        want = whole.sequences[g.index]
        assert (g.sequence.tokens, g.sequence.logprobs) == (want.tokens, want.logprobs)
        assert (g.sequence.versions, g.sequence.stop_reason) == (want.versions, want.stop_reason)


# ---- bad input and pressure ------------------------------------------------------------


@pytest.mark.parametrize(
    ("prompt_len", "params", "field"),
    [
        (5, treadle.SamplingParams(max_tokens=4, top_p=1.5), "top_p"),
        (5, treadle.SamplingParams(max_tokens=4, temperature=-1.0), "temperature"),
        (5, treadle.SamplingParams(max_tokens=5000), "max_tokens"),
        (5, treadle.SamplingParams(max_tokens=4, token_budget=-1), "token_budget"),
        (1030, treadle.SamplingParams(max_tokens=4), "prompt"),
        (-1, treadle.SamplingParams(max_tokens=4), "prompt"),  # a token id past the vocabulary
    ],
)
def test_bad_input_is_invalid_argument_naming_the_field(
    service: treadle.ServiceClient, prompt_len: int, params: treadle.SamplingParams, field: str
) -> None:
    sampler = service.create_sampling_client(BASE)
    prompt = [5] * prompt_len if prompt_len > 0 else [5, 10**6]
    with pytest.raises(treadle.InvalidArgumentError, match=field):
        sampler.sample(prompt, 1, params).result(timeout=60)
    with pytest.raises(treadle.InvalidArgumentError, match="num_samples"):
        sampler.sample([5, 6], SLOTS + 1, treadle.SamplingParams(max_tokens=4)).result(60)


def test_more_requests_than_rows_queue_and_the_worker_lives(
    service: treadle.ServiceClient, tok: treadle.Tokenizer
) -> None:
    sampler = service.create_sampling_client(BASE)
    params = treadle.SamplingParams(max_tokens=24, seed=1, ignore_eos=True)
    futures = [sampler.sample(tok.encode("abc"), SLOTS // 2, params) for _ in range(8)]
    done = 0
    for fut in futures:  # 4x the rows there are: queued, or refused as RESOURCE_EXHAUSTED
        try:
            seqs = fut.result(timeout=180).sequences
        except treadle.ResourceExhaustedError:
            continue
        assert [len(s.tokens) for s in seqs] == [24] * (SLOTS // 2)
        done += 1
    assert done >= 2
    after = sampler.sample(
        tok.encode("x"), 1, treadle.SamplingParams(max_tokens=3, ignore_eos=True)
    )
    assert len(after.result(timeout=60).sequences[0].tokens) == 3
