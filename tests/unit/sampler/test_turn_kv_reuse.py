"""An episode's turns on the torch sampler: a turn that asks
(``cache_completion``) leaves its prompt *and* completion KV for the next, so
that one prefills only its new observation; the reused KV gives the same tokens
and logprobs as a fresh prefill; another version's KV is never reused; a plain
request keeps nothing. A tiny model built on the spot; no server."""

from __future__ import annotations

from concurrent.futures import Future

import numpy as np
import torch

from treadle.common.engine.domain import ModelSpec, SampleOp, SampleResult, SamplingConfig
from treadle.workers.engine.base_models import BaseModel
from treadle.workers.engine.versions import WeightSnapshot
from treadle.workers.sampler.backend import SampleJob
from treadle.workers.sampler.state import SamplerLimits
from treadle.workers.sampler.torch_sampler import TorchSampler
from treadle.workers.trainer.trainer import TrainingModel

torch.set_num_threads(1)
MAX_LEN = 256
PROMPT, SAMPLED, OBSERVED, TURNS = 120, 16, 8, 3


def _run(
    s: TorchSampler, prompt: np.ndarray, snap: WeightSnapshot, seed: int, keep: bool = True
) -> SampleResult:
    params = SamplingConfig(max_tokens=SAMPLED, ignore_eos=True, seed=seed, cache_completion=keep)
    fut: Future[SampleResult] = Future()
    s.submit(SampleJob(s.base, SampleOp(prompt, 1, params), snap), fut)
    while s.has_work():
        s.step()
    return fut.result(0)


def _episode(
    s: TorchSampler, snaps: list[WeightSnapshot], keep: bool = True
) -> tuple[list[SampleResult], list[tuple[int, int]]]:
    """``TURNS`` turns: each prompt is the last one + its completion + 8 observed
    tokens. Returns each turn's result and (prompt tokens computed, reused) for it."""
    rng = np.random.default_rng(0)
    prompt = rng.integers(3, 90, PROMPT)
    out, counts = [], []
    for k in range(TURNS):
        computed, reused = s.prompt_tokens, s.prefix_reused_tokens
        res = _run(s, prompt, snaps[k], seed=k, keep=keep)
        counts.append((s.prompt_tokens - computed, s.prefix_reused_tokens - reused))
        out.append(res)
        observation = rng.integers(3, 90, OBSERVED)
        prompt = np.concatenate([prompt, res.sequences[0].tokens, observation])
    return out, counts


def test_a_turn_prefills_only_its_observation(base: BaseModel, base_snap: WeightSnapshot) -> None:
    s = TorchSampler(base, num_slots=4, max_len=MAX_LEN)
    results, counts = _episode(s, [base_snap] * TURNS)
    assert counts[0] == (PROMPT, 0)
    for computed, reused in counts[1:]:
        # the completion's last token (never fed) and the observation
        assert computed == 1 + OBSERVED
        assert reused == computed + reused - 1 - OBSERVED
    later = counts[1:]
    share = sum(r for _, r in later) / sum(c + r for c, r in later)
    assert share >= 0.9  # 0.87 when only the prompt's KV was kept

    # the same turns with nothing reused (a fresh sampler per turn) agree
    rng = np.random.default_rng(0)
    prompt = rng.integers(3, 90, PROMPT)
    for k, res in enumerate(results):
        fresh = _run(TorchSampler(base, num_slots=4, max_len=MAX_LEN), prompt, base_snap, seed=k)
        a, b = res.sequences[0], fresh.sequences[0]
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5, rtol=0)
        prompt = np.concatenate([prompt, a.tokens, rng.integers(3, 90, OBSERVED)])


def test_a_plain_request_keeps_nothing(base: BaseModel, base_snap: WeightSnapshot) -> None:
    """The same turns sent without ``cache_completion``: no completion KV is copied
    into the store, and each turn reuses only the previous turn's prompt (staged)."""
    s = TorchSampler(base, num_slots=4, max_len=MAX_LEN)
    _, counts = _episode(s, [base_snap] * TURNS, keep=False)
    assert s.prefix.kept == [] and s.prefix.kept_tokens == 0
    assert counts[0] == (PROMPT, 0)
    previous = PROMPT
    for computed, reused in counts[1:]:
        assert reused == previous  # the last turn's prompt, not its completion
        assert computed == SAMPLED + OBSERVED
        previous += SAMPLED + OBSERVED
    # a G > 1 request asking for it keeps nothing either (its rows are a group, not a turn)
    params = SamplingConfig(max_tokens=SAMPLED, ignore_eos=True, seed=0, cache_completion=True)
    fut: Future[SampleResult] = Future()
    prompt = np.random.default_rng(5).integers(3, 90, PROMPT)
    s.submit(SampleJob(s.base, SampleOp(prompt, 2, params), base_snap), fut)
    while s.has_work():
        s.step()
    fut.result(0)
    assert s.prefix.kept == []


def test_no_store_when_its_budget_is_zero(base: BaseModel, base_snap: WeightSnapshot) -> None:
    s = TorchSampler(base, limits=SamplerLimits(num_slots=4, max_len=MAX_LEN, turn_cache_slots=0))
    _, counts = _episode(s, [base_snap] * TURNS)
    assert s.prefix.kept == [] and counts[1][0] == SAMPLED + OBSERVED


def test_another_versions_kv_is_not_reused(base: BaseModel, base_snap: WeightSnapshot) -> None:
    model = TrainingModel(ModelSpec("m-kv", "t", "tiny", 4, 8.0, 1, "float32"), base)
    v1 = model.snapshot()
    s = TorchSampler(base, num_slots=4, max_len=MAX_LEN)
    # turn 1 by the base, turns 2 and 3 by the adapter: turn 2 reuses nothing of
    # turn 1 (other weights), turn 3 reuses turn 2's prompt and completion
    _, counts = _episode(s, [base_snap, v1, v1])
    assert counts[1][1] == 0
    assert counts[2][0] == 1 + OBSERVED


def test_more_episodes_than_staging_slots_keep_their_histories(
    base: BaseModel, base_snap: WeightSnapshot
) -> None:
    """12 episodes wait on their tools at once (the staging cache has 8 slots):
    each one's second turn still prefills only its observation."""
    s = TorchSampler(base, num_slots=4, max_len=MAX_LEN)
    assert s.prefix.stage.num_slots < 12
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 90, PROMPT) for _ in range(12)]
    firsts = [_run(s, p, base_snap, seed=i) for i, p in enumerate(prompts)]
    computed, reused = s.prompt_tokens, s.prefix_reused_tokens
    for i, (p, res) in enumerate(zip(prompts, firsts, strict=True)):
        _run(
            s,
            np.concatenate([p, res.sequences[0].tokens, rng.integers(3, 90, OBSERVED)]),
            base_snap,
            seed=i,
        )
    assert s.prompt_tokens - computed == 12 * (1 + OBSERVED)
    assert s.prefix_reused_tokens - reused == 12 * (PROMPT + SAMPLED - 1)


def test_the_store_of_turns_stays_within_its_budget(
    base: BaseModel, base_snap: WeightSnapshot
) -> None:
    s = TorchSampler(base, num_slots=4, max_len=MAX_LEN)
    s.prefix.max_kept_tokens = 3 * (PROMPT + SAMPLED)  # room for about 3 turns
    rng = np.random.default_rng(2)
    for i in range(6):
        _run(s, rng.integers(3, 90, PROMPT), base_snap, seed=i)
        assert s.prefix.kept_tokens <= s.prefix.max_kept_tokens
    assert 1 <= len(s.prefix.kept) <= 3
