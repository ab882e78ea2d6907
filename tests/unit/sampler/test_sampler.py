"""The torch sampler at engine level: continuous batching, slots, stops, truncation,
logprobs against the trainer, validation. A tiny model built on the spot; no server."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future

import numpy as np
import pytest
import torch

from treadle.common.engine.domain import (
    AdamConfig,
    DatumData,
    ForwardBackwardOp,
    ForwardLogprobsOp,
    ModelSpec,
    SampleOp,
    SampleResult,
    SamplingConfig,
)
from treadle.errors import InvalidArgumentError
from treadle.workers.engine.base_models import BaseModel
from treadle.workers.engine.versions import WeightSnapshot
from treadle.workers.model.llama import forward_hidden, lm_logits
from treadle.workers.sampler.backend import SampleJob
from treadle.workers.sampler.torch_sampler import TorchSampler
from treadle.workers.trainer import trainer
from treadle.workers.trainer.trainer import TrainingModel

torch.set_num_threads(1)  # a tiny model on 2 shared cores: one thread is fastest
MAX_LEN = 128
EOS = 2


def ids(text: str) -> np.ndarray:
    return np.array([3 + (ord(c) - 32) for c in text], dtype=np.int64)  # char ids


CANDIDATES = ("hello", "abc", "12+3=", "xyz", "The ", "q")


@pytest.fixture(scope="module")
def long_prompt(base: BaseModel, base_snap: WeightSnapshot) -> str:
    """A prompt whose greedy continuation on the base runs 100 tokens without EOS,
    so a request on it can only end by max_tokens, a stop we set, or cancellation."""
    for text in CANDIDATES:
        res = run_alone(base, op(text, 1, max_tokens=100, temperature=0), base_snap)
        if res.sequences[0].stop_reason == "length":
            return text
    pytest.fail("no candidate prompt decodes greedily without EOS")


def _train(model: TrainingModel, texts: Sequence[str], steps: int, lr: float) -> None:
    data = []
    for text in texts:
        toks = ids(text) if isinstance(text, str) else np.asarray(text)
        data.append(
            DatumData(
                tokens=toks[:-1],
                inputs={"target_tokens": toks[1:], "weights": np.ones(toks.size - 1, np.float32)},
            )
        )
    for _ in range(steps):
        trainer.forward_backward(model, ForwardBackwardOp(tuple(data), "cross_entropy", {}))
        model.optim_step(AdamConfig(learning_rate=lr))


@pytest.fixture(scope="module")
def lora_model(base: BaseModel) -> TrainingModel:
    """A LoRA model moved well away from the base."""
    model = TrainingModel(ModelSpec("m-lora", "t", "tiny", 4, 8.0, 1, "float32"), base)
    _train(model, ["12+3=15", "hello world"], steps=4, lr=2e-2)
    return model


def sampler(base: BaseModel, slots: int = 8) -> TorchSampler:
    return TorchSampler(base, num_slots=slots, max_len=MAX_LEN)


def op(prompt: str | np.ndarray, n: int = 1, **params: object) -> SampleOp:
    prompt_ids = ids(prompt) if isinstance(prompt, str) else prompt
    return SampleOp(prompt=prompt_ids, num_samples=n, params=SamplingConfig(**params))  # type: ignore[arg-type]


def drain(s: TorchSampler, max_steps: int = 10_000) -> int:
    steps = 0
    while s.has_work():
        s.step()
        steps += 1
        assert steps < max_steps
    return steps


def run_alone(base: BaseModel, o: SampleOp, snap: WeightSnapshot) -> SampleResult:
    s = sampler(base)
    fut: Future[SampleResult] = Future()
    s.submit(SampleJob(s.base, o, snap), fut)
    drain(s)
    return fut.result(0)


def assert_same(a: SampleResult, b: SampleResult, *, atol: float = 1e-5) -> None:
    assert len(a.sequences) == len(b.sequences)
    for x, y in zip(a.sequences, b.sequences, strict=True):
        np.testing.assert_array_equal(x.tokens, y.tokens)
        np.testing.assert_allclose(x.logprobs, y.logprobs, atol=atol, rtol=0)
        assert x.stop_reason == y.stop_reason
        assert x.versions == y.versions


# ---- continuous batching -------------------------------------------------------------------


def test_batched_requests_equal_each_request_alone(
    base: BaseModel, base_snap: WeightSnapshot, lora_model: TrainingModel
) -> None:
    lora_snap = lora_model.snapshot()
    requests = [
        (op("12+3=", 3, max_tokens=10, seed=1), base_snap),
        (op("hello", 2, max_tokens=14, temperature=0.7, seed=2), lora_snap),
        (op("abc", 1, max_tokens=6, top_k=5, seed=3), lora_snap),
        (op("7*6=4", 2, max_tokens=9, top_p=0.8, temperature=1.3, seed=4), base_snap),
        (op("xyz", 1, max_tokens=12, temperature=0), lora_snap),
    ]
    s = sampler(base, slots=6)  # not all fit at once: some wait for free slots
    futures = []
    for o, snap in requests:
        fut: Future[SampleResult] = Future()
        s.submit(SampleJob(s.base, o, snap), fut)
        futures.append(fut)
    drain(s)
    for (o, snap), fut in zip(requests, futures, strict=True):
        assert_same(fut.result(0), run_alone(base, o, snap))
    versions = {
        v for f in futures[1:3] for seq in f.result(0).sequences for (_, _, v) in seq.versions
    }
    assert versions == {lora_model.version}


def test_seeded_samples_reproduce_and_differ_by_seed_and_index(
    base: BaseModel, base_snap: WeightSnapshot
) -> None:
    a = run_alone(base, op("hi", 4, max_tokens=8, seed=5), base_snap)
    b = run_alone(base, op("hi", 4, max_tokens=8, seed=5), base_snap)
    c = run_alone(base, op("hi", 4, max_tokens=8, seed=6), base_snap)
    assert_same(a, b, atol=0)
    tokens = [tuple(q.tokens) for q in a.sequences]
    assert len(set(tokens)) > 1
    assert tokens != [tuple(q.tokens) for q in c.sequences]


def test_a_finished_row_frees_its_slots_for_a_queued_request(
    base: BaseModel, base_snap: WeightSnapshot, long_prompt: str
) -> None:
    long_op = op(long_prompt, 2, max_tokens=40, temperature=0)
    assert all(q.stop_reason == "length" for q in run_alone(base, long_op, base_snap).sequences)
    s = sampler(base, slots=4)
    short, waiting = op("12+3=", 2, max_tokens=2, seed=0), op("abc", 2, max_tokens=3, seed=1)
    futs: list[Future[SampleResult]] = [Future(), Future(), Future()]
    for o, f in zip((short, long_op, waiting), futs, strict=True):
        s.submit(SampleJob(s.base, o, base_snap), f)
    s.step()
    assert s.stats().queued_requests == 1  # 2 + 2 rows fill the 4 slots
    steps = 0
    while not futs[2].done():
        s.step()
        steps += 1
        assert steps < 30
    assert futs[0].done() and not futs[1].done()  # admitted before the long one ended
    assert len(s.running) == 2
    drain(s)
    assert s.stats().free_slots == 4
    # the reused slots held another request's cache: the results must not show it
    assert_same(futs[2].result(0), run_alone(base, waiting, base_snap))
    assert_same(futs[1].result(0), run_alone(base, long_op, base_snap))


def test_cancelled_requests_free_their_slots(
    base: BaseModel, base_snap: WeightSnapshot, long_prompt: str
) -> None:
    s = sampler(base, slots=4)
    running: Future[SampleResult] = Future()
    queued: Future[SampleResult] = Future()
    s.submit(
        SampleJob(s.base, op(long_prompt, 4, max_tokens=100, temperature=0), base_snap), running
    )
    s.submit(SampleJob(s.base, op("abc", 2, max_tokens=100, temperature=0), base_snap), queued)
    for _ in range(3):
        s.step()
    assert s.stats().running_rows == 4 and s.stats().queued_requests == 1
    assert running.cancel() and queued.cancel()
    s.step()
    stats = s.stats()
    assert (stats.running_rows, stats.queued_requests, stats.free_slots) == (0, 0, 4)
    assert not s.has_work()
    after = run_alone(base, op("abc", 2, max_tokens=5, seed=3), base_snap)
    fut: Future[SampleResult] = Future()
    s.submit(SampleJob(s.base, op("abc", 2, max_tokens=5, seed=3), base_snap), fut)
    drain(s)
    assert_same(fut.result(0), after)


def test_max_tokens_zero_returns_empty_sequences(
    base: BaseModel, base_snap: WeightSnapshot
) -> None:
    res = run_alone(base, op("abc", 2, max_tokens=0), base_snap)
    assert [len(q.tokens) for q in res.sequences] == [0, 0]
    assert all(q.stop_reason == "length" for q in res.sequences)


# ---- stopping -----------------------------------------------------------------------------


def _greedy(base: BaseModel, snap: WeightSnapshot, prompt: str, n: int = 30) -> list[int]:
    res = run_alone(base, op(prompt, 1, max_tokens=n, temperature=0), snap)
    assert res.sequences[0].stop_reason == "length"
    return res.sequences[0].tokens.tolist()


def test_stop_token_ids(base: BaseModel, base_snap: WeightSnapshot, long_prompt: str) -> None:
    g = _greedy(base, base_snap, long_prompt)
    i = next(i for i in range(3, len(g)) if g[i] not in g[:i])  # a first occurrence
    res = run_alone(
        base, op(long_prompt, 2, max_tokens=30, temperature=0, stop_token_ids=(g[i],)), base_snap
    )
    for seq in res.sequences:
        assert seq.tokens.tolist() == g[: i + 1]  # the stop token is returned
        assert seq.stop_reason == "stop_token"
        assert len(seq.logprobs) == i + 1


def test_stop_strings(base: BaseModel, base_snap: WeightSnapshot, long_prompt: str) -> None:
    g = _greedy(base, base_snap, long_prompt)
    tokenizer = sampler(base).tokenizer

    def text(tokens: list[int]) -> str:
        return tokenizer.decode(tokens, skip_special_tokens=False)

    full = text(g)
    j = next(j for j in range(3, len(full) - 2) if full[j : j + 2] not in full[: j + 1])
    stop = full[j : j + 2]
    expected = next(k for k in range(1, len(g) + 1) if stop in text(g[:k]))
    assert 3 < expected < len(g)
    res = run_alone(
        base,
        op(long_prompt, 1, max_tokens=30, temperature=0, stop_strings=(stop, "~~~~")),
        base_snap,
    )
    (seq,) = res.sequences
    assert seq.stop_reason == "stop_string"
    assert seq.tokens.tolist() == g[:expected]  # stops on the token that completes it


def test_eos_stops_a_sequence(base: BaseModel) -> None:
    model = TrainingModel(ModelSpec("m-eos", "t", "tiny", 4, 8.0, 2, "float32"), base)
    _train(model, [np.array([*ids("ab"), EOS])], steps=25, lr=1e-2)
    res = run_alone(base, op("ab", 2, max_tokens=10, temperature=0), model.snapshot())
    for seq in res.sequences:
        assert seq.tokens.tolist() == [EOS] and seq.stop_reason == "stop"


# ---- choosing tokens and their logprobs ----------------------------------------------------


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_top_k_one_is_greedy(
    base: BaseModel, lora_model: TrainingModel, temperature: float
) -> None:
    snap = lora_model.snapshot()
    greedy = run_alone(base, op("hello", 2, max_tokens=20, temperature=0), snap)
    top1 = run_alone(
        base, op("hello", 2, max_tokens=20, temperature=temperature, top_k=1, seed=9), snap
    )
    for g, t in zip(greedy.sequences, top1.sequences, strict=True):
        np.testing.assert_array_equal(g.tokens, t.tokens)
        if temperature == 1.0:  # greedy reports its logprobs at T = 1
            np.testing.assert_allclose(g.logprobs, t.logprobs, atol=1e-6, rtol=0)


@pytest.mark.parametrize(
    ("temperature", "top_p", "top_k"), [(1.0, 1.0, -1), (0.7, 0.9, -1), (0.7, 1.0, 4)]
)
def test_logprobs_equal_the_trainers(
    base: BaseModel, lora_model: TrainingModel, temperature: float, top_p: float, top_k: int
) -> None:
    """log_softmax(logits / T) before truncation, exactly what the trainer computes."""
    prompt = ids("12+3=")
    res = run_alone(
        base,
        op(prompt, 4, max_tokens=12, temperature=temperature, top_p=top_p, top_k=top_k, seed=7),
        lora_model.snapshot(),
    )
    data = []
    for seq in res.sequences:
        full = np.concatenate([prompt, seq.tokens])
        data.append(DatumData(tokens=full[:-1], inputs={"target_tokens": full[1:]}))
    out = trainer.forward_logprobs(
        lora_model, ForwardLogprobsOp(tuple(data), temperature=temperature)
    )
    for seq, lp in zip(res.sequences, out.logprobs, strict=True):
        np.testing.assert_allclose(seq.logprobs, lp[prompt.size - 1 :], atol=1e-4, rtol=0)


def test_truncation_keeps_samples_inside_the_nucleus(
    base: BaseModel, lora_model: TrainingModel
) -> None:
    """With top_k = 3 every sampled token is among the 3 likeliest at its position."""
    prompt = ids("hello")
    res = run_alone(base, op(prompt, 4, max_tokens=10, top_k=3, seed=11), lora_model.snapshot())
    for seq in res.sequences:
        full = np.concatenate([prompt, seq.tokens])
        snap = lora_model.snapshot()
        with torch.no_grad():
            tokens = torch.from_numpy(full[None, :-1])
            hidden = forward_hidden(base.cfg, snap.params, tokens, lora=snap.adapter)
            logits = lm_logits(base.cfg, snap.params, hidden, lora=snap.adapter)[
                0, prompt.size - 1 :
            ]
        top3 = logits.topk(3, dim=-1).indices
        for t, tok in enumerate(seq.tokens.tolist()):
            assert tok in top3[t].tolist()


# ---- validation -------------------------------------------------------------------------------

BAD: dict[str, tuple[SampleOp, str]] = {
    "empty_prompt": (op(np.zeros(0, dtype=np.int64)), "prompt"),
    "prompt_outside_vocab": (op(np.array([5, 10_000])), "prompt"),
    "negative_prompt_token": (op(np.array([-1, 5])), "prompt"),
    "prompt_fills_the_context": (op(np.full(MAX_LEN, 5)), "prompt"),
    "zero_samples": (op("ab", 0), "num_samples"),
    "more_samples_than_slots": (op("ab", 9), "num_samples"),
    "negative_max_tokens": (op("ab", max_tokens=-1), "max_tokens"),
    "past_the_context": (op("ab", max_tokens=MAX_LEN), "max_tokens"),
    "negative_temperature": (op("ab", temperature=-0.1), "temperature"),
    "nan_temperature": (op("ab", temperature=float("nan")), "temperature"),
    "top_p_zero": (op("ab", top_p=0.0), "top_p"),
    "top_p_above_one": (op("ab", top_p=1.01), "top_p"),
    "top_k_below_minus_one": (op("ab", top_k=-3), "top_k"),
    "empty_stop_string": (op("ab", stop_strings=("",)), "stop"),
    "stop_id_outside_vocab": (op("ab", stop_token_ids=(10_000,)), "stop"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_validation_names_the_field(base: BaseModel, base_snap: WeightSnapshot, case: str) -> None:
    bad, field = BAD[case]
    s = sampler(base)
    fut: Future[SampleResult] = Future()
    with pytest.raises(InvalidArgumentError) as err:
        s.submit(SampleJob(s.base, bad, base_snap), fut)
    assert err.value.message.startswith(field), err.value.message
    assert not s.has_work() and not fut.done()
    good = op("ab", 1, max_tokens=2, seed=0)
    s.submit(SampleJob(s.base, good, base_snap), fut)
    drain(s)
    assert len(fut.result(0).sequences) == 1
