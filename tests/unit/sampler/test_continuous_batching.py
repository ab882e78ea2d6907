"""Continuous batching in the torch sampler: the same tokens as sampling each request
alone, whatever the batch, the prefill chunking and the prefix reuse; finished rows
free their slots at once (and the rest stay in consecutive slots); a full queue
answers RESOURCE_EXHAUSTED. A tiny model built on the spot."""

from __future__ import annotations

from concurrent.futures import Future

import numpy as np
import pytest
import torch

from tests.gpu.checks_sync import DeviceReads
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
from treadle.errors import InvalidArgumentError, ResourceExhaustedError
from treadle.workers.engine.base_models import BaseModel
from treadle.workers.engine.versions import WeightSnapshot
from treadle.workers.sampler.backend import SampleJob
from treadle.workers.sampler.sampling import sample_tokens
from treadle.workers.sampler.torch_sampler import SamplerLimits, TorchSampler
from treadle.workers.trainer.trainer import TrainingModel, forward_backward, forward_logprobs

torch.set_num_threads(1)  # a tiny model on 2 shared cores: one thread is fastest
EOS = 2


def _trained(base: BaseModel, model_id: str, seed: int) -> TrainingModel:
    """A LoRA model a few steps away from the base (so adapters really differ)."""
    model = TrainingModel(ModelSpec(model_id, "t", "tiny", 4, 8.0, seed, "float32"), base)
    rng = np.random.default_rng(seed)
    toks = rng.integers(3, 90, size=24)
    datum = DatumData(toks[:-1], {"target_tokens": toks[1:], "weights": np.ones(23, np.float32)})
    for _ in range(3):
        forward_backward(model, ForwardBackwardOp((datum,), "cross_entropy", {}))
        model.optim_step(AdamConfig(learning_rate=3e-2))
    return model


def _ops(n: int, seed: int = 0) -> list[SampleOp]:
    """Requests of mixed prompt lengths, group sizes, lengths and truncation."""
    rng = np.random.default_rng(seed)
    ops = []
    for i in range(n):
        params = SamplingConfig(
            max_tokens=int(rng.integers(1, 24)),
            seed=100 + i,
            temperature=[1.0, 0.7, 0.0][i % 3],
            top_k=[-1, 5][i % 2],
            top_p=[1.0, 0.8][(i // 2) % 2],
        )
        prompt = rng.integers(3, 90, size=int(rng.integers(2, 40)))
        ops.append(SampleOp(prompt, int(rng.integers(1, 4)), params))
    return ops


def _run(sampler: TorchSampler, work: list[tuple[SampleOp, WeightSnapshot]]) -> list[SampleResult]:
    futures: list[Future[SampleResult]] = []
    for op, snapshot in work:
        fut: Future[SampleResult] = Future()
        sampler.submit(SampleJob(sampler.base, op, snapshot), fut)
        futures.append(fut)
    while sampler.has_work():
        sampler.step()
        _check_compact(sampler)
    return [f.result() for f in futures]


def _check_compact(sampler: TorchSampler) -> None:
    assert [r.slot for r in sampler.running] == list(range(len(sampler.running)))
    assert all(r.stop_reason is None for r in sampler.running)


def _alone(base: BaseModel, op: SampleOp, snapshot: WeightSnapshot) -> SampleResult:
    sampler = TorchSampler(base, limits=SamplerLimits(num_slots=4, max_len=128))
    return _run(sampler, [(op, snapshot)])[0]


def _assert_same(a: SampleResult, b: SampleResult) -> None:
    assert len(a.sequences) == len(b.sequences)
    for x, y in zip(a.sequences, b.sequences, strict=True):
        np.testing.assert_array_equal(x.tokens, y.tokens)
        np.testing.assert_allclose(x.logprobs, y.logprobs, atol=1e-5)
        assert x.stop_reason == y.stop_reason
        assert x.versions == y.versions


def test_continuous_batching_equals_sequential_sampling(
    base: BaseModel, base_snap: WeightSnapshot
) -> None:
    """More requests than slots, chunked prefill, few staging slots: same tokens."""
    ops = _ops(14)
    limits = SamplerLimits(num_slots=6, max_len=64, prefill_slots=2, max_prefill_tokens=16)
    batched = _run(TorchSampler(base, limits=limits), [(op, base_snap) for op in ops])
    for op, got in zip(ops, batched, strict=True):
        _assert_same(got, _alone(base, op, base_snap))


def test_multi_lora_rows_equal_single_adapter_runs(
    base: BaseModel, base_snap: WeightSnapshot
) -> None:
    """One decode batch mixing two adapters, two versions of one, and the base."""
    m1, m2 = _trained(base, "a", 1), _trained(base, "b", 2)
    v_old = m1.snapshot()
    m1.adapter.b[0]["q_proj"].data.add_(0.05)  # type: ignore[union-attr]
    m1.version += 1
    snaps = [base_snap, m1.snapshot(), v_old, m2.snapshot()]
    ops = _ops(8, seed=3)
    work = [(op, snaps[i % len(snaps)]) for i, op in enumerate(ops)]
    batched = _run(TorchSampler(base, limits=SamplerLimits(num_slots=16, max_len=64)), work)
    for (op, s), got in zip(work, batched, strict=True):
        _assert_same(got, _alone(base, op, s))


def test_requests_finishing_prefill_together_draw_as_if_alone(
    base: BaseModel, base_snap: WeightSnapshot
) -> None:
    """Requests whose prompts finish in one prefill forward have their first tokens
    chosen in one batch: each row still draws from its own prompt's logits with its
    own seed and parameters (the same tokens as sampling each request alone), and
    the step reads the device once for all of them and once for the decode."""
    rng = np.random.default_rng(7)
    ops = [
        SampleOp(
            rng.integers(3, 90, size=6 + i % 2),
            1 + i % 3,
            SamplingConfig(
                max_tokens=3 + i % 4,
                seed=500 + i,
                temperature=[1.0, 0.6, 1.3, 0.0][i % 4],
                top_k=[-1, 8][i % 2],
                top_p=[1.0, 0.9][(i // 2) % 2],
                ignore_eos=i % 3 == 0,
            ),
        )
        for i in range(6)
    ]
    limits = SamplerLimits(
        num_slots=16, max_len=64, prefill_slots=6, max_prefill_tokens=64, prepack=False
    )  # prepacking (the CPU only) reads no device but is not what is counted here
    sampler = TorchSampler(base, limits=limits)
    futures: list[Future[SampleResult]] = []
    for op in ops:
        fut: Future[SampleResult] = Future()
        sampler.submit(SampleJob(sampler.base, op, base_snap), fut)
        futures.append(fut)
    with DeviceReads() as mode:
        sampler.step()  # every prompt in one forward, then a decode
    assert not sampler.queue and not sampler.prefilling
    # the tokens' reads (``token_choice.to_host``): the first tokens' one, the decode's
    # one (the prefill forward's own reads of its CPU slot ids are the CPU's only)
    assert mode.reads.count("cpu") == 2, mode.reads
    while sampler.has_work():
        sampler.step()
        _check_compact(sampler)
    for op, fut in zip(ops, futures, strict=True):
        _assert_same(fut.result(), _alone(base, op, base_snap))


def test_full_finetune_rows_decode_beside_lora_rows(
    base: BaseModel, base_snap: WeightSnapshot
) -> None:
    """Rows of different base weights decode as separate groups (gathered slots)."""
    spec = ModelSpec("full", "t", "tiny", 0, 0.0, 0, "float32")
    full = TrainingModel(spec, base)
    with torch.no_grad():
        full.params.layers[0].q_proj.add_(0.05)
    work = [(op, [base_snap, full.snapshot()][i % 2]) for i, op in enumerate(_ops(6, seed=5))]
    batched = _run(TorchSampler(base, limits=SamplerLimits(num_slots=8, max_len=64)), work)
    for (op, s), got in zip(work, batched, strict=True):
        _assert_same(got, _alone(base, op, s))


def test_sampled_logprobs_agree_with_forward_logprobs(base: BaseModel) -> None:
    model = _trained(base, "lp", 4)
    op = SampleOp(np.arange(5, 25), 3, SamplingConfig(max_tokens=20, seed=1, temperature=0.8))
    result = _alone(base, op, model.snapshot())
    data = tuple(
        DatumData(
            np.concatenate([op.prompt, s.tokens])[:-1],
            {"target_tokens": np.concatenate([op.prompt, s.tokens])[1:]},
        )
        for s in result.sequences
    )
    got = forward_logprobs(model, ForwardLogprobsOp(data, temperature=0.8))
    for s, lp in zip(result.sequences, got.logprobs, strict=True):
        np.testing.assert_allclose(s.logprobs, lp[op.prompt.size - 1 :], atol=1e-4)


def test_rows_that_stop_early_free_their_slot_at_once(
    base: BaseModel, base_snap: WeightSnapshot
) -> None:
    sampler = TorchSampler(base, limits=SamplerLimits(num_slots=3, max_len=64))
    short = SampleOp(np.arange(3, 9), 2, SamplingConfig(max_tokens=3, seed=1, ignore_eos=True))
    long = SampleOp(np.arange(3, 12), 1, SamplingConfig(max_tokens=30, seed=2, ignore_eos=True))
    waiting = SampleOp(np.arange(4, 10), 2, SamplingConfig(max_tokens=3, seed=3))
    futures = []
    for o in (short, long, waiting):
        fut: Future[SampleResult] = Future()
        sampler.submit(SampleJob(sampler.base, o, base_snap), fut)
        futures.append(fut)
    sampler.step()  # short (2 rows) and long (1 row) fill the 3 slots; waiting queues
    assert len(sampler.running) == 3 and len(sampler.queue) == 1
    sampler.step()  # short's rows end (3 tokens: prefill + 2 decodes) and free their slots
    assert futures[0].done() and not futures[1].done()
    assert [r.request.op for r in sampler.running] == [long]
    assert sampler.stats().free_slots == 2
    sampler.step()  # the waiting request takes them
    assert {r.request.op.num_samples for r in sampler.running} == {1, 2}
    assert len(sampler.running) == 3
    _check_compact(sampler)
    while sampler.has_work():
        sampler.step()
        _check_compact(sampler)
    assert [len(s.tokens) for s in futures[1].result().sequences] == [30]
    assert sampler.stats().free_slots == 3


def test_prefix_reuse_gives_identical_tokens_and_logprobs(
    base: BaseModel, base_snap: WeightSnapshot
) -> None:
    rng = np.random.default_rng(7)
    system = rng.integers(3, 90, size=40)
    ops = [
        SampleOp(
            np.concatenate([system, rng.integers(3, 90, size=k)]),
            2,
            SamplingConfig(max_tokens=12, seed=k),
        )
        for k in (1, 5, 9)
    ]
    ops.append(SampleOp(system.copy(), 1, SamplingConfig(max_tokens=12, seed=0)))  # all cached
    sampler = TorchSampler(base, limits=SamplerLimits(num_slots=8, max_len=96, prefill_slots=2))
    got = []
    for o in ops:  # one after another: each finds the previous prompt staged
        got.append(_run(sampler, [(o, base_snap)])[0])
    assert sampler.stats().prefix_reused_tokens >= 3 * 40 - 1
    for o, g in zip(ops, got, strict=True):
        _assert_same(g, _alone(base, o, base_snap))


def test_separate_requests_for_one_prompt_share_its_prefill(
    base: BaseModel, base_snap: WeightSnapshot
) -> None:
    """G samples sent as G requests at once: one prefill, the others copy it."""
    prompt = np.arange(3, 43)
    ops = [SampleOp(prompt, 1, SamplingConfig(max_tokens=6, seed=s)) for s in range(5)]
    sampler = TorchSampler(base, limits=SamplerLimits(num_slots=8, max_len=64, prefill_slots=4))
    got = _run(sampler, [(o, base_snap) for o in ops])
    assert sampler.stats().prompt_tokens == prompt.size + 4  # the last token, 4 times
    assert sampler.stats().prefix_reused_tokens == 4 * (prompt.size - 1)
    for o, g in zip(ops, got, strict=True):
        _assert_same(g, _alone(base, o, base_snap))


def test_prefix_cache_is_keyed_by_weights(base: BaseModel, base_snap: WeightSnapshot) -> None:
    model = _trained(base, "pk", 5)
    prompt = np.arange(3, 43)
    op = SampleOp(prompt, 1, SamplingConfig(max_tokens=8, seed=3))
    sampler = TorchSampler(base, limits=SamplerLimits(num_slots=4, max_len=64))
    _run(sampler, [(op, base_snap)])
    assert sampler.stats().prefix_reused_tokens == 0
    lora = _run(sampler, [(op, model.snapshot())])[0]
    assert sampler.stats().prefix_reused_tokens == 0  # other weights: no reuse
    _assert_same(lora, _alone(base, op, model.snapshot()))
    _run(sampler, [(op, base_snap)])
    assert sampler.stats().prefix_reused_tokens == prompt.size - 1


def test_a_long_prompt_prefills_in_chunks_while_rows_decode(
    base: BaseModel, base_snap: WeightSnapshot
) -> None:
    limits = SamplerLimits(num_slots=4, max_len=128, max_prefill_tokens=16)
    sampler = TorchSampler(base, limits=limits)
    running = SampleOp(np.arange(3, 8), 1, SamplingConfig(max_tokens=40, seed=1, ignore_eos=True))
    long = SampleOp(np.arange(3, 83), 1, SamplingConfig(max_tokens=4, seed=2))
    fut_a: Future[SampleResult] = Future()
    fut_b: Future[SampleResult] = Future()
    sampler.submit(SampleJob(sampler.base, running, base_snap), fut_a)
    sampler.step()
    sampler.submit(SampleJob(sampler.base, long, base_snap), fut_b)
    before = sampler.tokens_generated
    steps = 0
    while sampler.prefilling or sampler.queue:
        sampler.step()
        steps += 1
    assert steps == 5  # 80 prompt tokens, 16 per step
    assert sampler.tokens_generated - before >= 5  # the running row kept decoding
    while sampler.has_work():
        sampler.step()
    _assert_same(fut_b.result(), _alone(base, long, base_snap))
    _assert_same(fut_a.result(), _alone(base, running, base_snap))


def test_a_full_queue_answers_resource_exhausted(
    base: BaseModel, base_snap: WeightSnapshot
) -> None:
    sampler = TorchSampler(base, limits=SamplerLimits(num_slots=2, max_len=32, max_queued=3))
    op = SampleOp(np.arange(3, 8), 2, SamplingConfig(max_tokens=4, seed=0))
    futures = []
    for _ in range(3):
        fut: Future[SampleResult] = Future()
        sampler.submit(SampleJob(sampler.base, op, base_snap), fut)
        futures.append(fut)
    with pytest.raises(ResourceExhaustedError, match="queued"):
        sampler.submit(SampleJob(sampler.base, op, base_snap), Future())
    while sampler.has_work():  # the queued ones still complete, one group at a time
        sampler.step()
    assert all(len(f.result().sequences) == 2 for f in futures)


def test_ignore_eos_runs_every_sequence_to_max_tokens(
    base: BaseModel, base_snap: WeightSnapshot
) -> None:
    # A biased sampler would stop early on EOS; ignore_eos must not.
    ops = [
        SampleOp(np.arange(3, 9), 4, SamplingConfig(max_tokens=25, seed=s, ignore_eos=True))
        for s in range(3)
    ]
    results = _run(
        TorchSampler(base, limits=SamplerLimits(num_slots=16, max_len=64)),
        [(o, base_snap) for o in ops],
    )
    for r in results:
        assert all(len(s.tokens) == 25 and s.stop_reason == "length" for s in r.sequences)


def test_seeded_rows_do_not_depend_on_batch_neighbours() -> None:
    """The sampling function itself is per row: the same row draws the same token."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 1000, generator=g)
    u = torch.rand(6, generator=g, dtype=torch.float64)
    temps, ks, ps = (
        [1.0, 0.5, 1.0, 0.0, 2.0, 1.0],
        [-1, 10, -1, -1, 50, 3],
        [1.0, 1.0, 0.9, 1.0, 0.5, 1.0],
    )
    all_tokens, all_lps = sample_tokens(logits, temps, ks, ps, u)
    for b in range(6):
        tok, lp = sample_tokens(
            logits[b : b + 1], temps[b : b + 1], ks[b : b + 1], ps[b : b + 1], u[b : b + 1]
        )
        assert int(tok) == int(all_tokens[b])
        assert float(lp) == pytest.approx(float(all_lps[b]), abs=1e-6)
    # The logprob is at the row's temperature, before truncation.
    ref = torch.log_softmax(logits / 0.5, -1)[1, all_tokens[1]]
    assert float(all_lps[1]) == pytest.approx(float(ref), abs=1e-5)
    assert int(all_tokens[3]) == int(logits[3].argmax())


def test_inverse_cdf_sampling_matches_the_distribution() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0, -1.0]]).expand(20000, -1).contiguous()
    u = torch.rand(20000, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    tokens, _ = sample_tokens(logits, [1.0] * 20000, [-1] * 20000, [1.0] * 20000, u)
    freq = torch.bincount(tokens, minlength=4).double() / 20000
    np.testing.assert_allclose(freq.numpy(), torch.softmax(logits[0], -1).numpy(), atol=0.015)
    # top-k 2 and top-p keep only the head
    tokens, _ = sample_tokens(logits, [1.0] * 20000, [2] * 20000, [1.0] * 20000, u)
    assert set(tokens.tolist()) == {1, 2}
    tokens, _ = sample_tokens(logits, [1.0] * 20000, [-1] * 20000, [0.5] * 20000, u)
    assert set(tokens.tolist()) == {2}


@pytest.mark.parametrize(
    ("params", "prompt_len", "field"),
    [
        ({"stop_strings": ("x" * 257,)}, 4, "stop"),
        ({}, 64, "prompt"),  # the prompt alone fills the context
        ({"max_tokens": 61}, 4, "max_tokens"),  # prompt + max_tokens past the context
        ({"top_p": 1.5}, 4, "top_p"),
        ({"top_p": -0.1}, 4, "top_p"),
        ({"top_k": -2}, 4, "top_k"),
    ],
)
def test_bad_input_is_invalid_argument_naming_the_field(
    base: BaseModel, base_snap: WeightSnapshot, params: dict, prompt_len: int, field: str
) -> None:
    sampler = TorchSampler(base, limits=SamplerLimits(num_slots=2, max_len=64))
    op = SampleOp(np.arange(3, 3 + prompt_len), 1, SamplingConfig(**params))
    with pytest.raises(InvalidArgumentError, match=rf"^INVALID_ARGUMENT: {field}\b"):
        sampler.submit(SampleJob(sampler.base, op, base_snap), Future())
    assert not sampler.has_work()
