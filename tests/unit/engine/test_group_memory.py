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


def test_a_lora_share_counts_the_base_layers_it_gathers(tmp_path: Path) -> None:
    """A LoRA model on a sharded base: a rank's share needs its (checkpointed)
    activations, the adapter's gradients, and the whole base weights FSDP gathers at
    once (embedding, norm, head and two layers), none of their gradients (frozen)."""
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
    spec = ModelSpec("m", "t", "tiny", 4, 0.0, 0, "float32")
    probe = build_engine(EngineConfig(base_models={"tiny": model_dir})).start()
    try:
        probe.create_model(spec).result()
        model = probe.models["m"]
        adapter = sum(p.numel() * p.element_size() for p in model.trainable.values())
        base = model.base.params
        layer = sum(t.numel() for t in vars(base.layers[0]).values() if t is not None)
        root = sum(t.numel() for t in (base.embed_tokens, base.norm, base.lm_head) if t is not None)
        gathered = (root + 2 * layer) * 4
        cfg = model.cfg
    finally:
        probe.stop()
    activations = train_memory.activation_bytes(
        cfg, ROWS // 2, LENGTH, 4, checkpointing=True, chunked_logits=False
    )
    need = activations + adapter + gathered
    outcomes = {}
    for limit in (need - 1, need):
        engine = build_engine(
            EngineConfig(
                base_models={"tiny": model_dir}, ranks=2, threads=1, train_memory_limit_bytes=limit
            )
        ).start()
        try:
            engine.create_model(spec).result()
            sharding = engine.models["m"].sharding
            assert sharding is not None and sharding.frozen
            try:
                outcomes[limit] = engine.submit("m", 1, op, "d").result(timeout=120)
            except ResourceExhaustedError as err:
                outcomes[limit] = err
        finally:
            engine.stop()
    assert isinstance(outcomes[need - 1], ResourceExhaustedError), outcomes[need - 1]
    assert not isinstance(outcomes[need], Exception), outcomes[need]
