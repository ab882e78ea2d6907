"""A published version shipped from a trainer's engine to a sampler worker's
(``ShipVersionCall`` / ``LoadVersionCall``): the sampler worker, which holds no
training model, samples exactly what the trainer's own sampler samples under
that version (same tokens, logprobs within 1e-5, the version on every token),
for a LoRA adapter and a full fine-tune, until the model is deleted; a file that
is another version is refused."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.unit.engine_ops import random_datum
from treadle.common.engine.domain import (
    AdamConfig,
    ForwardBackwardOp,
    ModelSpec,
    OptimStepOp,
    SampleOp,
    SamplerTarget,
    SamplingConfig,
    SyncResult,
    SyncWeightsOp,
)
from treadle.common.engine.messages import LoadVersionCall, Shipped, ShipVersionCall
from treadle.errors import FailedPreconditionError, NotFoundError
from treadle.workers.engine.loop import Engine, EngineConfig

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def engines(tiny_model_dir: Path) -> Iterator[tuple[Engine, Engine]]:
    trainer = Engine(EngineConfig({"tiny": tiny_model_dir}, threads=1)).start()
    pool = Engine(EngineConfig({"tiny": tiny_model_dir}, threads=1)).start()
    yield trainer, pool
    trainer.stop()
    pool.stop()


def _trained(trainer: Engine, model_id: str, rank: int) -> int:
    """A model one optimizer step away from its base, synced: its version."""
    trainer.create_model(ModelSpec(model_id, "t", "tiny", rank, 8.0, 1, "float32")).result(30)
    rng = np.random.default_rng(0)
    ops = [
        ForwardBackwardOp((random_datum(rng, 9),), "cross_entropy", {}),
        OptimStepOp(AdamConfig(learning_rate=0.05)),
        SyncWeightsOp(),
    ]
    futures = [trainer.submit(model_id, i, op, f"d{i}") for i, op in enumerate(ops, 1)]
    synced = futures[-1].result(60)
    assert isinstance(synced, SyncResult)
    return synced.version


@pytest.mark.parametrize("rank", [4, 0], ids=["lora", "full"])
def test_a_shipped_version_samples_as_on_the_trainer(
    engines: tuple[Engine, Engine], tmp_path: Path, rank: int
) -> None:
    trainer, pool = engines
    model_id = f"m-{rank}"
    version = _trained(trainer, model_id, rank)
    assert version == 1
    shipped = trainer.call(ShipVersionCall(model_id, version, str(tmp_path / "v1"))).result(30)
    assert isinstance(shipped, Shipped) and shipped.size_bytes > 0
    target = SamplerTarget("tiny", model_id, version, "t")
    assert not pool.has_model(model_id)
    with pytest.raises(NotFoundError):  # not served before it is loaded
        pool.check_sampler_target(target).result(10)
    assert pool.call(LoadVersionCall(target, str(tmp_path / "v1"))).result(30).version == 1

    op = SampleOp(np.array([5, 9, 12]), 2, SamplingConfig(max_tokens=6, seed=7, ignore_eos=True))
    here = trainer.sample(target, op).result(60)
    there = pool.sample(target, op).result(60)
    latest = pool.sample(SamplerTarget("tiny", model_id, None, "t"), op).result(60)
    assert not pool.has_model(model_id)  # served, never trained there
    for a, b, c in zip(here.sequences, there.sequences, latest.sequences, strict=True):
        assert a.tokens.tolist() == b.tokens.tolist() == c.tokens.tolist()
        assert np.max(np.abs(a.logprobs - b.logprobs)) < 1e-5
        assert b.versions == c.versions == ((0, 6, 1),)
    pool.delete_model(model_id).result(10)  # the model was deleted: its versions go
    with pytest.raises(NotFoundError):
        pool.check_sampler_target(target).result(10)


def test_a_file_of_another_version_is_refused(
    engines: tuple[Engine, Engine], tmp_path: Path
) -> None:
    trainer, pool = engines
    version = _trained(trainer, "m-x", 4)
    trainer.call(ShipVersionCall("m-x", version, str(tmp_path / "v"))).result(30)
    wrong = SamplerTarget("tiny", "m-x", version + 1, "t")
    with pytest.raises(FailedPreconditionError, match="not treadle://m-x/v/2"):
        pool.call(LoadVersionCall(wrong, str(tmp_path / "v"))).result(30)
    with pytest.raises(NotFoundError):  # nothing half-loaded
        pool.check_sampler_target(wrong).result(10)


def test_latest_is_the_version_last_published_not_the_highest(
    engines: tuple[Engine, Engine], tmp_path: Path
) -> None:
    """A model rewound by ``load_state`` publishes lower numbers again: a ``latest``
    sampler on the pool reads the version last loaded as latest; a version loaded
    for a pinned sampler leaves the latest as it was."""
    trainer, pool = engines
    version = _trained(trainer, "m-rw", 4)
    paths = {}
    for v in (0, version):
        paths[v] = str(tmp_path / f"v{v}")
        trainer.call(ShipVersionCall("m-rw", v, paths[v])).result(30)
    latest = SamplerTarget("tiny", "m-rw", None, "t")

    def load(v: int, *, as_latest: bool) -> None:
        target = SamplerTarget("tiny", "m-rw", v, "t")
        pool.call(LoadVersionCall(target, paths[v], latest=as_latest)).result(30)

    load(version, as_latest=True)
    load(0, as_latest=False)  # a pinned sampler's version
    assert pool.check_sampler_target(latest).result(10) == version
    load(0, as_latest=True)  # published again after a rewind
    assert pool.check_sampler_target(latest).result(10) == 0
    op = SampleOp(np.array([5, 9]), 1, SamplingConfig(max_tokens=3, seed=1, ignore_eos=True))
    assert pool.sample(latest, op).result(60).sequences[0].versions == ((0, 3, 0),)
    load(version, as_latest=False)  # already served, loaded for a pinned sampler
    assert pool.check_sampler_target(latest).result(10) == 0
    pool.delete_model("m-rw").result(10)
