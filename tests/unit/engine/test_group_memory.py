"""The memory refusal of a worker group counts per rank (issue 36, item 7): a
``forward_backward`` is checked for each rank's share of its datums, so a call
one rank would refuse (RESOURCE_EXHAUSTED before any compute) runs on two,
each holding the activations of half of it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from treadle.common.engine.domain import (
    DatumData,
    ForwardBackwardOp,
    ModelSpec,
)
from treadle.errors import ResourceExhaustedError
from treadle.workers.engine.config import EngineConfig
from treadle.workers.group.launch import build_engine
from treadle.workers.model.tiny import build_tiny_model
from treadle.workers.trainer import memory as train_memory

pytestmark = pytest.mark.slow

ROWS, LENGTH = 8, 32


def _need(cfg: object, rows: int, trainable_bytes: int) -> int:
    return trainable_bytes + train_memory.activation_bytes(
        cfg,  # type: ignore[arg-type]
        rows,
        LENGTH,
        4,
        checkpointing=False,
        chunked_logits=False,
    )


def test_the_refusal_counts_a_ranks_share(tmp_path: Path) -> None:
    model_dir = build_tiny_model(tmp_path / "tiny", preset="tiny", seed=0)
    rng = np.random.default_rng(0)
    data = tuple(
        DatumData(
            rng.integers(3, 60, LENGTH),
            {"target_tokens": rng.integers(3, 60, LENGTH), "weights": np.ones(LENGTH)},
        )
        for _ in range(ROWS)
    )
    op = ForwardBackwardOp(data, "cross_entropy", {})
    spec = ModelSpec("m", "t", "tiny", 0, 0.0, 0, "float32")
    outcomes = {}
    for ranks in (1, 2):
        probe = build_engine(EngineConfig(base_models={"tiny": model_dir})).start()
        probe.create_model(spec).result()
        model = probe.models["m"]
        trainable = sum(p.numel() * p.element_size() for p in model.trainable.values())
        # between a half's need and the whole's: one rank refuses, two take it
        limit = (_need(model.cfg, ROWS // 2, trainable) + _need(model.cfg, ROWS, trainable)) // 2
        probe.stop()
        engine = build_engine(
            EngineConfig(
                base_models={"tiny": model_dir},
                ranks=ranks,
                threads=1,
                train_memory_limit_bytes=limit,
            )
        ).start()
        try:
            engine.create_model(spec).result()
            try:
                outcomes[ranks] = engine.submit("m", 1, op, "d").result(timeout=120)
            except ResourceExhaustedError as err:
                outcomes[ranks] = err
        finally:
            engine.stop()
    assert isinstance(outcomes[1], ResourceExhaustedError), outcomes[1]
    assert not isinstance(outcomes[2], Exception), outcomes[2]
    assert outcomes[2].metrics["ntokens:sum"] == ROWS * LENGTH  # type: ignore[union-attr]
