"""What an engine reports to the operator (``Engine.report``): its device and
memory, the training models it holds and how many are LoRA adapters, and its
scheduler's queue per tenant, as of its latest round."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from tests.unit.engine_ops import random_datum
from treadle.common.engine.domain import ForwardBackwardOp, ModelSpec, TenantQueue
from treadle.workers.engine.loop import Engine, EngineConfig

torch.set_num_threads(1)


def test_report_counts_models_adapters_and_waiting_calls(tiny_model_dir: Path) -> None:
    engine = Engine(EngineConfig({"tiny": tiny_model_dir}, threads=1))  # stepped here
    empty = engine.report()
    assert (empty.device, empty.models, empty.adapters, empty.served, empty.queue) == (
        "cpu",
        0,
        0,
        0,
        (),
    )
    made = [
        engine.create_model(ModelSpec("lora-1", "t-a", "tiny", 4, 8.0, 1, "float32")),
        engine.create_model(ModelSpec("lora-2", "t-b", "tiny", 2, 4.0, 1, "float32")),
        engine.create_model(ModelSpec("full", "t-b", "tiny", 0, 0.0, 1, "float32")),
    ]
    op = ForwardBackwardOp((random_datum(np.random.default_rng(0), 9),), "cross_entropy", {})
    gap = [engine.submit("lora-1", seq, op, f"d{seq}") for seq in (2, 3)]  # seq_id 1 missing
    engine.step()
    assert all(f.done() and f.exception() is None for f in made)
    report = engine.report()
    assert (report.models, report.adapters, report.served) == (3, 2, 0)
    assert report.queue == (TenantQueue("t-a", waiting=2, running=0, deficit=0),)
    assert not any(f.done() for f in gap)
    memory = report.memory
    assert memory.used_bytes > 0 and 0 < memory.free_bytes <= memory.total_bytes
    engine.delete_model("full")
    engine.step()
    assert (engine.report().models, engine.report().adapters) == (2, 2)
