"""The service end to end through the SDK: models, tokenizer, sampling, training,
weight sync and its versions, reference logprobs, lifecycle and cancellation."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from concurrent.futures import CancelledError
from pathlib import Path

import numpy as np
import pytest

import treadle
from tests.helpers import next_token_datum
from treadle.server.embedded import EmbeddedServer

BASE = "tiny"
TOL = 1e-4


def _completion_datum(prompt: Sequence[int], completion: Sequence[int]) -> treadle.Datum:
    """prompt + completion as a datum whose targets at positions len(prompt)-1.. are
    the completion tokens."""
    full = [*prompt, *completion]
    weights = [0.0] * (len(prompt) - 1) + [1.0] * len(completion)
    return next_token_datum(full, weights)


def _train(tc: treadle.TrainingClient, datum: treadle.Datum, steps: int, lr: float = 2e-2) -> int:
    """``steps`` optimizer steps on one datum, all in flight at once; the last step."""
    futures = []
    for _ in range(steps):
        tc.forward_backward([datum], "cross_entropy")
        futures.append(tc.optim_step(treadle.AdamParams(learning_rate=lr)))
    return futures[-1].result(timeout=60).step


def _trained_lp(tc: treadle.TrainingClient, datum: treadle.Datum, **kw: object) -> np.ndarray:
    return tc.forward_logprobs([datum], **kw).result(timeout=30).loss_fn_outputs[0].logprobs


# ---- models, server info, tokenizer ----------------------------------------------------


def test_create_lora_and_full_models(service: treadle.ServiceClient) -> None:
    lora = service.create_lora_training_client(BASE, rank=4)
    full = service.create_training_client(BASE)
    li, fi = lora.get_info(), full.get_info()
    assert li.is_lora and li.lora_rank == 4 and li.base_model == BASE
    assert not fi.is_lora and fi.lora_rank == 0 and fi.base_model == BASE
    for info in (li, fi):
        assert info.version == 0
        assert info.next_seq_id == 1
        assert info.status == "active"
    assert li.model_id != fi.model_id


def test_server_info_lists_the_base_model(service: treadle.ServiceClient) -> None:
    info = service.get_server_info()
    names = [b.name for b in info.base_models]
    assert names == [BASE]
    base = info.base_models[0]
    assert base.arch == "llama"
    assert base.vocab_size >= 99  # 3 specials + 96 characters
    assert base.max_context > 0 and base.num_params > 0
    assert info.api_version == "treadle.v1"
    assert info.workers == []  # the engine runs in the server's process: no workers


def test_tokenizer_round_trips(tok: treadle.Tokenizer) -> None:
    text = "12+34=46\nHello, world!"
    ids = tok.encode(text)
    assert len(ids) == len(text)  # character tokenizer
    assert tok.decode(ids) == text
    assert tok.eos_token_id == 2 and tok.bos_token_id == 1 and tok.pad_token_id == 0


def test_the_tokenizers_and_the_models_vocab_sizes_are_told_apart(
    service: treadle.ServiceClient, tok: treadle.Tokenizer, tiny_model_dir: Path
) -> None:
    """99 ids in the tokenizer, 104 rows in the model (padded to a multiple of 8):
    two quantities, each documented as which it is and pointing to the other."""
    base = service.get_server_info().base_models[0]
    config = json.loads((tiny_model_dir / "config.json").read_text())
    assert base.vocab_size == config["vocab_size"] == 104  # the model's embedding rows
    assert tok.vocab_size == 99  # the tokenizer's ids, specials included
    assert tok.decode([tok.vocab_size, base.vocab_size - 1]) == ""  # padding has no text
    assert "BaseModelInfo.vocab_size" in (treadle.Tokenizer.vocab_size.__doc__ or "")
    assert "Tokenizer.vocab_size" in (treadle.types.BaseModelInfo.__doc__ or "")


# ---- sampling ------------------------------------------------------------------------------


def test_sample_logprobs_num_samples_and_seeds(
    service: treadle.ServiceClient, tok: treadle.Tokenizer
) -> None:
    sampler = service.create_sampling_client(base_model=BASE)
    prompt = tok.encode("12+3=")
    params = treadle.SamplingParams(max_tokens=6, seed=11)
    a = sampler.sample(prompt, 3, params).result(timeout=30)
    b = sampler.sample(prompt, 3, params).result(timeout=30)
    c = sampler.sample(prompt, 3, treadle.SamplingParams(max_tokens=6, seed=12)).result(timeout=30)
    assert len(a.sequences) == 3 and len(c.sequences) == 3
    for seq in a.sequences:
        assert 1 <= len(seq.tokens) <= 6
        assert len(seq.logprobs) == len(seq.tokens)
        assert all(np.isfinite(seq.logprobs)) and all(lp <= 0 for lp in seq.logprobs)
        assert seq.stop_reason in ("stop", "length")
        if seq.stop_reason == "length":
            assert len(seq.tokens) == 6
    assert [s.tokens for s in a.sequences] == [s.tokens for s in b.sequences]
    for x, y in zip(a.sequences, b.sequences, strict=True):  # up to float rounding
        np.testing.assert_allclose(x.logprobs, y.logprobs, atol=1e-5, rtol=0)
    assert [s.tokens for s in a.sequences] != [s.tokens for s in c.sequences]
    # the G samples of one request are not copies of each other
    assert len({tuple(s.tokens) for s in a.sequences}) > 1


def test_ignore_eos_runs_every_sequence_to_max_tokens(
    service: treadle.ServiceClient, tok: treadle.Tokenizer
) -> None:
    sampler = service.create_sampling_client(base_model=BASE)
    prompt = tok.encode("12+3=")
    plain = treadle.SamplingParams(max_tokens=40, temperature=1.5, seed=3)
    stopped = sampler.sample(prompt, 16, plain).result(timeout=60).sequences
    # the precondition that makes this test mean something: EOS does stop some
    assert any(s.stop_reason == "stop" for s in stopped)
    forced = treadle.SamplingParams(max_tokens=40, temperature=1.5, seed=3, ignore_eos=True)
    full = sampler.sample(prompt, 16, forced).result(timeout=60).sequences
    assert all(s.stop_reason == "length" and len(s.tokens) == 40 for s in full)
    for a, b in zip(stopped, full, strict=True):  # the same draws up to the first EOS
        n = len(a.tokens) - (a.stop_reason == "stop")
        assert list(b.tokens[:n]) == list(a.tokens[:n])


# ---- training --------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["lora", "full"])
def test_training_lowers_the_loss_of_the_trained_datum(
    service: treadle.ServiceClient, tok: treadle.Tokenizer, kind: str
) -> None:
    tc = (
        service.create_lora_training_client(BASE, rank=4)
        if kind == "lora"
        else service.create_training_client(BASE)
    )
    datum = next_token_datum(tok.encode("12+3=15"))
    lr = 2e-2 if kind == "lora" else 3e-3  # every weight moves in a full fine-tune
    losses = []
    for _ in range(4):
        out = tc.forward_backward([datum], "cross_entropy").result(timeout=30)
        step = tc.optim_step(treadle.AdamParams(learning_rate=lr)).result(timeout=30)
        losses.append(out.metrics["loss:sum"])
        assert np.isfinite(step.metrics["grad_norm:value"])
    after = -_trained_lp(tc, datum).sum()
    assert step.step == 4 and tc.get_info().version == 4
    assert all(b < a for a, b in zip(losses, losses[1:], strict=False)), losses
    assert after < losses[0] - 1.0
    # loss:sum is the sum of -logprob over the weighted targets
    assert out.metrics["ntokens:sum"] == len(datum.model_input)


# ---- weight sync: sampler logprobs == trainer logprobs ---------------------------------------


@pytest.mark.parametrize("kind", ["lora", "full"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_synced_sampler_matches_trainer_logprobs(
    service: treadle.ServiceClient, tok: treadle.Tokenizer, kind: str, temperature: float
) -> None:
    tc = (
        service.create_lora_training_client(BASE, rank=4, seed=3)
        if kind == "lora"
        else service.create_training_client(BASE)
    )
    _train(tc, next_token_datum(tok.encode("7*6=42")), steps=3)
    sampler = tc.sync_weights()
    assert sampler.version == 3
    prompt = tok.encode("7*6=")
    params = treadle.SamplingParams(max_tokens=8, temperature=temperature, seed=5)
    res = sampler.sample(prompt, 4, params).result(timeout=30)
    datums = [_completion_datum(prompt, s.tokens) for s in res.sequences]
    out = tc.forward_logprobs(datums, temperature=temperature).result(timeout=30)
    ref_t1 = tc.forward_logprobs(datums).result(timeout=30) if temperature != 1.0 else None
    for seq, lp_out in zip(res.sequences, out.loss_fn_outputs, strict=True):
        trainer_lp = lp_out.logprobs[len(prompt) - 1 :]
        np.testing.assert_allclose(seq.logprobs, trainer_lp, atol=TOL, rtol=0)
        assert seq.token_versions() == [3] * len(seq.tokens)
        assert seq.versions == [treadle.VersionSpan(0, len(seq.tokens), 3)]
    if ref_t1 is not None:  # the temperature really changes the numbers
        t1 = np.concatenate([o.logprobs[len(prompt) - 1 :] for o in ref_t1.loss_fn_outputs])
        sampled = np.concatenate([s.logprobs for s in res.sequences])
        assert np.abs(t1 - sampled).max() > 1e-3


def test_the_tinker_aliases_forward_their_arguments_or_refuse_them(
    service: treadle.ServiceClient, tok: treadle.Tokenizer
) -> None:
    tc = service.create_lora_training_client(BASE, rank=4, seed=3)
    datum = next_token_datum(tok.encode("7*6=42"))
    at_t2 = tc.forward_logprobs([datum], temperature=2.0).result(timeout=30)
    via_alias = tc.forward([datum], "importance_sampling", temperature=2.0).result(timeout=30)
    np.testing.assert_array_equal(
        via_alias.loss_fn_outputs[0].logprobs, at_t2.loss_fn_outputs[0].logprobs
    )
    at_t1 = tc.forward([datum]).result(timeout=30)
    assert (
        np.abs(at_t1.loss_fn_outputs[0].logprobs - at_t2.loss_fn_outputs[0].logprobs).max() > 1e-3
    )
    with pytest.raises(treadle.InvalidArgumentError, match="loss_fn"):
        tc.forward([datum], "no_such_loss")
    with pytest.raises(TypeError, match="loss_fn_config"):
        tc.forward([datum], "ppo", {"clip_low_threshold": 0.8})
    with pytest.raises(TypeError, match="save_state"):
        tc.save_weights_and_get_sampling_client("step-1")
    with pytest.raises(TypeError):
        tc.forward([datum], "cross_entropy", retry_config=None)  # type: ignore[call-arg]
    sampler = tc.save_weights_and_get_sampling_client()
    assert sampler.version == 0


def test_pinned_version_stays_and_latest_follows_syncs(
    service: treadle.ServiceClient, tok: treadle.Tokenizer
) -> None:
    tc = service.create_lora_training_client(BASE, rank=4, seed=1)
    latest = service.create_sampling_client(weights=f"treadle://{tc.model_id}/latest")
    assert latest.version is None and latest.model_id == tc.model_id
    prompt = tok.encode("ab")
    params = treadle.SamplingParams(max_tokens=4, seed=2)

    def versions(s: treadle.SamplingClient) -> set[int]:
        res = s.sample(prompt, 2, params).result(timeout=30)
        return {v for seq in res.sequences for v in seq.token_versions()}

    assert versions(latest) == {0}
    datum = next_token_datum(tok.encode("abcabc"))
    _train(tc, datum, steps=2)
    assert versions(latest) == {0}  # trained but not yet synced
    pinned = tc.sync_weights()
    assert pinned.version == 2
    assert versions(latest) == {2}
    _train(tc, datum, steps=1)
    tc.sync_weights().sampler_id  # noqa: B018 - wait for the sync to land
    assert versions(latest) == {3}
    assert versions(pinned) == {2}
    again = service.create_sampling_client(weights=f"treadle://{tc.model_id}/v/2")
    assert again.version == 2 and versions(again) == {2}


def test_base_model_sampler_is_version_zero(
    service: treadle.ServiceClient, tok: treadle.Tokenizer
) -> None:
    sampler = service.create_sampling_client(base_model=BASE)
    assert sampler.version == 0 and sampler.model_id is None and sampler.base_model == BASE
    res = sampler.sample(tok.encode("hi"), 2, treadle.SamplingParams(max_tokens=3, seed=0))
    for seq in res.result(timeout=30).sequences:
        assert seq.token_versions() == [0] * len(seq.tokens)


def test_reference_logprobs_equal_the_base_sampler(
    service: treadle.ServiceClient, tok: treadle.Tokenizer
) -> None:
    tc = service.create_lora_training_client(BASE, rank=4, seed=2)
    _train(tc, next_token_datum(tok.encode("hello world")), steps=3)
    base = service.create_sampling_client(base_model=BASE)
    prompt = tok.encode("hello")
    for temperature in (1.0, 0.7):
        res = base.sample(
            prompt, 3, treadle.SamplingParams(max_tokens=6, temperature=temperature, seed=9)
        ).result(timeout=30)
        datums = [_completion_datum(prompt, s.tokens) for s in res.sequences]
        ref = tc.forward_logprobs(datums, reference=True, temperature=temperature).result(30)
        pol = tc.forward_logprobs(datums, temperature=temperature).result(30)
        diffs = []
        for seq, r, p in zip(res.sequences, ref.loss_fn_outputs, pol.loss_fn_outputs, strict=True):
            np.testing.assert_allclose(
                seq.logprobs, r.logprobs[len(prompt) - 1 :], atol=TOL, rtol=0
            )
            diffs.append(np.abs(p.logprobs - r.logprobs).max())
        assert max(diffs) > 1e-3  # the adapter really changed the policy


# ---- lifecycle ------------------------------------------------------------------------------


def test_list_get_delete_models(service: treadle.ServiceClient, tok: treadle.Tokenizer) -> None:
    tc = service.create_lora_training_client(BASE, rank=2)
    ids = {m.model_id for m in service.list_models()}
    assert tc.model_id in ids
    info = service.get_model_info(tc.model_id)
    assert info.model_id == tc.model_id and info.lora_rank == 2
    service.delete_model(tc.model_id)
    assert tc.model_id not in {m.model_id for m in service.list_models()}
    with pytest.raises(treadle.NotFoundError):
        service.get_model_info(tc.model_id)
    with pytest.raises(treadle.NotFoundError):
        tc.forward_logprobs([next_token_datum(tok.encode("abc"))]).result(timeout=30)
    with pytest.raises(treadle.NotFoundError):
        service.delete_model(tc.model_id)
    with pytest.raises(treadle.NotFoundError):
        service.create_sampling_client(weights=f"treadle://{tc.model_id}/latest")


# ---- cancellation ---------------------------------------------------------------------------


def test_cancelled_sample_frees_its_rows(
    server: EmbeddedServer, service: treadle.ServiceClient, tok: treadle.Tokenizer
) -> None:
    engine = server.ctx.dispatcher.engine  # type: ignore[union-attr]
    sampler = service.create_sampling_client(base_model=BASE)
    # a prompt whose greedy continuation runs 300 tokens without EOS: the long
    # request below could only end early by being cancelled
    for text in ("hello", "abc", "12+3=", "xyz", "The ", "q"):
        prompt = tok.encode(text)
        probe = sampler.sample(prompt, 1, treadle.SamplingParams(max_tokens=300, temperature=0))
        if probe.result(timeout=60).sequences[0].stop_reason == "length":
            break
    else:
        pytest.fail("no candidate prompt decodes greedily without EOS")

    (torch_sampler,) = engine.sampler.core.samplers.values()
    slots = torch_sampler.stats().num_slots  # sized by memory unless --sampler-slots says
    fut = sampler.sample(prompt, slots, treadle.SamplingParams(max_tokens=1000, temperature=0))
    deadline = time.monotonic() + 20
    while torch_sampler.stats().running_rows < slots:
        assert time.monotonic() < deadline, "the long request never started"
        time.sleep(0.005)
    generated = torch_sampler.stats().tokens_generated
    assert fut.cancel()
    with pytest.raises(CancelledError):
        fut.result(timeout=1)
    deadline = time.monotonic() + 5
    while torch_sampler.stats().running_rows or torch_sampler.stats().queued_requests:
        assert time.monotonic() < deadline, "cancelled rows still hold their slots"
        time.sleep(0.01)
    assert torch_sampler.stats().free_slots == slots
    # it stopped well before its 1000 tokens per row
    assert torch_sampler.stats().tokens_generated - generated < slots * 500
    t0 = time.monotonic()
    res = sampler.sample(prompt, 1, treadle.SamplingParams(max_tokens=4, seed=0)).result(30)
    assert len(res.sequences[0].tokens) >= 1
    assert time.monotonic() - t0 < 10
