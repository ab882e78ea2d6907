"""The torch sampler's placements sample alike: on a thread of its own
(``torch-thread``) or in a process of its own (``torch-process``), the samples
of the base, of a pinned version and of the latest weights, while the model
trains beside them, are those of the sampler on the engine thread (``torch``),
for a LoRA model and a full fine-tune. Driven through the engine's API."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.unit.engine_ops import create_lora, tiny_engine, train_step
from treadle.common.engine.domain import (
    SampleOp,
    SampleResult,
    SamplerTarget,
    SamplingConfig,
    SyncWeightsOp,
)
from treadle.workers.engine.loop import Engine

torch.set_num_threads(1)
pytestmark = pytest.mark.timeout(180)


def _ops() -> list[SampleOp]:
    rng = np.random.default_rng(0)
    return [
        SampleOp(
            rng.integers(3, 90, size=int(rng.integers(3, 12))),
            int(rng.integers(1, 3)),
            SamplingConfig(max_tokens=int(rng.integers(4, 20)), seed=i, temperature=0.8),
        )
        for i in range(6)
    ]


def _run(engine: Engine, rank: int) -> list[SampleResult]:
    """Samples of the base and of a pinned version while the model trains, then of
    its latest weights (version 4: trained further, published again)."""
    model_id = f"m{rank}"
    create_lora(engine, model_id, rank)
    seq = train_step(engine, model_id, 1)
    engine.submit(model_id, seq, SyncWeightsOp(), "sync").result(30)  # version 1
    targets = [SamplerTarget("tiny"), SamplerTarget("tiny", model_id, version=1)]
    futures = [engine.sample(targets[i % 2], op) for i, op in enumerate(_ops())]
    seq += 1
    for _ in range(3):  # training goes on beside the sampling
        seq = train_step(engine, model_id, seq)
    engine.submit(model_id, seq, SyncWeightsOp(), "sync2").result(30)  # version 4
    futures.append(engine.sample(SamplerTarget("tiny", model_id), _ops()[0]))
    return [f.result(60) for f in futures]


@pytest.fixture(scope="module")
def inline(tiny_model_dir: Path) -> Iterator[dict[int, list[SampleResult]]]:
    """What the sampler on the engine thread samples, for each rank (once)."""
    engine = tiny_engine(tiny_model_dir, "torch")
    try:
        yield {rank: _run(engine, rank) for rank in (4, 0)}
    finally:
        engine.stop()


@pytest.fixture(scope="module", params=["torch-thread", "torch-process"])
def hosted(request: pytest.FixtureRequest, tiny_model_dir: Path) -> Iterator[Engine]:
    engine = tiny_engine(tiny_model_dir, request.param)
    yield engine
    engine.stop()


@pytest.mark.parametrize("rank", [4, 0], ids=["lora", "full"])
def test_every_placement_samples_what_the_engine_thread_samples(
    inline: dict[int, list[SampleResult]], hosted: Engine, rank: int
) -> None:
    want, got = inline[rank], _run(hosted, rank)
    assert len(got) == len(want)
    for a, b in zip(want, got, strict=True):
        assert len(a.sequences) == len(b.sequences)
        for x, y in zip(a.sequences, b.sequences, strict=True):
            np.testing.assert_array_equal(x.tokens, y.tokens)
            np.testing.assert_allclose(x.logprobs, y.logprobs, atol=1e-5)
            assert (x.versions, x.stop_reason) == (y.versions, y.stop_reason)
    # the pinned version is version 1, the latest version 4: each sampled as asked
    assert {s.versions[0][2] for r in got[1:6:2] for s in r.sequences} == {1}
    assert {s.versions[0][2] for s in got[-1].sequences} == {4}
