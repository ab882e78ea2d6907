"""Prompt logprobs on the torch sampler: every prompt token's score and the top k
at each position, from the prefill, equal to what the trainer computes for the
same weights at the same temperature; a cached prefix does not leave holes."""

from __future__ import annotations

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
from treadle.workers.sampler.torch_sampler import SamplerLimits, TorchSampler
from treadle.workers.trainer import trainer
from treadle.workers.trainer.trainer import TrainingModel

torch.set_num_threads(1)
PROMPT = np.array([5 + (7 * i) % 50 for i in range(40)], dtype=np.int64)


@pytest.fixture(scope="module")
def lora_model(base: BaseModel) -> TrainingModel:
    """A LoRA model moved away from the base (its head adapter included)."""
    model = TrainingModel(ModelSpec("m-plp", "t", "tiny", 4, 8.0, 1, "float32"), base)
    datum = DatumData(
        tokens=PROMPT[:-1],
        inputs={"target_tokens": PROMPT[1:], "weights": np.ones(PROMPT.size - 1, np.float32)},
    )
    for _ in range(3):
        trainer.forward_backward(model, ForwardBackwardOp((datum,), "cross_entropy", {}))
        model.optim_step(AdamConfig(learning_rate=2e-2))
    return model


def sampler(base: BaseModel, chunk: int = 512) -> TorchSampler:
    limits = SamplerLimits(num_slots=8, max_len=128, max_prefill_tokens=chunk)
    return TorchSampler(base, limits=limits)


def op(prompt: np.ndarray, k: int = 0, scores: bool = True, **params: object) -> SampleOp:
    config = SamplingConfig(**{"max_tokens": 2, "seed": 1, **params})  # type: ignore[arg-type]
    return SampleOp(prompt, 2, config, prompt_logprobs=scores, topk_prompt_logprobs=k)


def run(s: TorchSampler, ops: list[SampleOp], snap: WeightSnapshot) -> list[SampleResult]:
    futs: list[Future[SampleResult]] = []
    for o in ops:
        futs.append(Future())
        s.submit(SampleJob(s.base, o, snap), futs[-1])
    while s.has_work():
        s.step()
    return [f.result(0) for f in futs]


def trainer_logprobs(model: TrainingModel, prompt: np.ndarray, temperature: float) -> np.ndarray:
    datum = DatumData(tokens=prompt[:-1], inputs={"target_tokens": prompt[1:]})
    out = trainer.forward_logprobs(model, ForwardLogprobsOp((datum,), temperature=temperature))
    return np.asarray(out.logprobs[0])


@pytest.mark.parametrize(("temperature", "chunk"), [(1.0, 512), (0.7, 512), (0.7, 16), (0.0, 16)])
def test_prompt_logprobs_equal_the_trainers(
    base: BaseModel, lora_model: TrainingModel, temperature: float, chunk: int
) -> None:
    """Chunked prefills and a batch of two requests of different lengths; greedy
    (T = 0) scores at T = 1, as its sampled logprobs."""
    other = PROMPT[:23]
    res = run(
        sampler(base, chunk),
        [op(PROMPT, temperature=temperature), op(other, temperature=temperature)],
        lora_model.snapshot(),
    )
    for prompt, r in zip((PROMPT, other), res, strict=True):
        assert r.prompt is not None
        got = r.prompt.logprobs
        assert got is not None and got.shape == (prompt.size,) and np.isnan(got[0])
        want = trainer_logprobs(lora_model, prompt, temperature or 1.0)
        np.testing.assert_allclose(got[1:], want, atol=1e-4, rtol=0)
        assert r.prompt.topk_ids.shape == (prompt.size, 0)


def test_topk_prompt_logprobs_are_the_k_most_likely(
    base: BaseModel, lora_model: TrainingModel
) -> None:
    k = 5
    snap = lora_model.snapshot()
    (r,) = run(sampler(base, 16), [op(PROMPT, k=k, scores=False, temperature=0.8)], snap)
    assert r.prompt is not None
    assert r.prompt.logprobs is None  # only the top k were asked for
    ids_P_K, lps_P_K = r.prompt.topk_ids, r.prompt.topk_logprobs
    assert ids_P_K.shape == lps_P_K.shape == (PROMPT.size, k)
    assert (ids_P_K[0] == -1).all() and np.isnan(lps_P_K[0]).all()
    with torch.no_grad():
        tokens = torch.from_numpy(PROMPT[:-1])[None]
        positions = torch.arange(PROMPT.size - 1)[None]
        hidden = forward_hidden(base.cfg, snap.params, tokens, positions, lora=snap.adapter)
        logp = torch.log_softmax(
            lm_logits(base.cfg, snap.params, hidden, lora=snap.adapter)[0] / 0.8, -1
        )
    want_lps, want_ids = logp.topk(k, dim=-1)
    np.testing.assert_allclose(lps_P_K[1:], want_lps.numpy(), atol=1e-4, rtol=0)
    np.testing.assert_array_equal(ids_P_K[1:], want_ids.numpy())


def test_a_cached_prefix_leaves_no_unscored_positions(
    base: BaseModel, lora_model: TrainingModel
) -> None:
    """The same prompt sampled first without scores (its K/V now cached), then
    with them: every position is still scored, equal to the trainer's."""
    s = sampler(base)
    snap = lora_model.snapshot()
    run(s, [op(PROMPT, scores=False)], snap)
    (r,) = run(s, [op(PROMPT)], snap)
    assert r.prompt is not None and r.prompt.logprobs is not None
    assert not np.isnan(r.prompt.logprobs[1:]).any()
    np.testing.assert_allclose(
        r.prompt.logprobs[1:], trainer_logprobs(lora_model, PROMPT, 1.0), atol=1e-4, rtol=0
    )
    (plain,) = run(s, [op(PROMPT, scores=False)], snap)
    assert plain.prompt is None


@pytest.mark.parametrize(
    ("o", "field"),
    [
        (op(PROMPT, k=-1), "topk_prompt_logprobs"),
        (op(PROMPT, max_tokens=0), "prompt_logprobs"),
        (op(PROMPT, k=3, scores=False, max_tokens=0), "topk_prompt_logprobs"),
    ],
)
def test_bad_prompt_logprob_requests_name_the_field(
    base: BaseModel, o: SampleOp, field: str
) -> None:
    with pytest.raises(InvalidArgumentError, match=f"INVALID_ARGUMENT: {field}:"):
        sampler(base).validate(o)
