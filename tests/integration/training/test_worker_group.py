"""A worker as a group of ranks (``--ranks 2``, gloo on the CPU; issue 36).

The same training through the SDK on a 2-rank embedded server and on a 1-rank
one gives the same numbers: five steps of a full fine-tune and of LoRA (losses,
``forward_logprobs``, sampled tokens and logprobs under a fixed seed). A state
saved by the 2-rank worker loads on the 1-rank one and the reverse, and the next
step is the same on either. On 2 ranks the full fine-tune is sharded (each rank
holds half of its weights and Adam moments), and so is the LoRA model's frozen
base (its adapters are replicated): what rank 0 holds is checked against the
1-rank worker's. float64, so the comparison is of the arithmetic,
not of float32 rounding in Adam (``test_remote_equals_local``'s ``ADAM_EPS``).

Multi-process: the 2-rank server spawns a second process that joins the first
over a TCPStore; the servers share one data directory one after the other, so a
``treadle://`` path saved by one resolves on the next.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

import treadle
from tests.helpers import char_ids, next_token_datum
from treadle.server.config import ServerConfig
from treadle.server.embedded import EmbeddedServer
from treadle.workers.engine.loop import Engine

pytestmark = pytest.mark.slow

BASE = "tiny"
TIMEOUT = 120.0
STEPS = 5
TOLERANCE = 1e-5
LR = {"full": 2e-3, "lora": 1e-2}
#: three datums: 2 ranks take two and one (uneven shares, and a loss that is a sum)
TRAIN = [next_token_datum(char_ids(t)) for t in ("12+3=15", "hello world", "9*9=81")]
PROBE = [next_token_datum(char_ids(t)) for t in ("abc+def", "7*6=42")]
PROMPT = char_ids("1+2=")


@dataclass
class Run:
    losses: list[float]
    probe: list[np.ndarray]
    sampled: list[tuple[list[int], list[float]]]
    saved: str
    next_loss: float
    after_next: list[np.ndarray]
    #: bytes of the weights and Adam moments rank 0 holds after training
    held: int
    sharded: bool


@contextmanager
def _server(
    data: Path, model_dir: Path, ranks: int
) -> Iterator[tuple[treadle.ServiceClient, Engine]]:
    config = ServerConfig(data_dir=data, models={BASE: model_dir}, port=0, threads=1, ranks=ranks)
    srv = EmbeddedServer(config).start()
    engine: Engine = srv.ctx.dispatcher.engine  # type: ignore[attr-defined]
    assert engine.peers.size == ranks
    client = treadle.ServiceClient(srv.address, api_key=srv.api_key)
    try:
        yield client, engine
    finally:
        client.close()
        srv.stop()


def _new(service: treadle.ServiceClient, kind: str) -> treadle.TrainingClient:
    if kind == "lora":
        return service.create_lora_training_client(BASE, rank=4, seed=1, dtype="float64")
    return service.create_training_client(BASE, seed=1, dtype="float64")


def _step(tc: treadle.TrainingClient, kind: str) -> float:
    fb = tc.forward_backward(TRAIN, "cross_entropy")
    tc.optim_step(treadle.AdamParams(learning_rate=LR[kind])).result(TIMEOUT)
    return float(fb.result(TIMEOUT).metrics["loss:sum"])


def _probe(tc: treadle.TrainingClient) -> list[np.ndarray]:
    out = tc.forward_logprobs(PROBE).result(timeout=TIMEOUT)
    return [np.asarray(o.logprobs) for o in out.loss_fn_outputs]


def _held(engine: Engine, model_id: str) -> tuple[int, bool]:
    model = engine.models[model_id]
    opt = model.optimizer
    tensors = [*opt.params.values(), *opt.exp_avg.values(), *opt.exp_avg_sq.values()]
    return sum(t.numel() * t.element_size() for t in tensors), model.sharding is not None


def _train(service: treadle.ServiceClient, engine: Engine, kind: str) -> Run:
    tc = _new(service, kind)
    losses = [_step(tc, kind) for _ in range(STEPS)]
    held, sharded = _held(engine, tc.model_id)
    probe = _probe(tc)
    params = treadle.SamplingParams(max_tokens=6, temperature=1.0, seed=3)
    result = tc.sync_weights().sample(PROMPT, 2, params).result(TIMEOUT)
    sampled = [(list(s.tokens), list(s.logprobs)) for s in result.sequences]
    saved = tc.save_state(f"{kind}-{STEPS}").result(TIMEOUT).path
    next_loss = _step(tc, kind)
    return Run(losses, probe, sampled, saved, next_loss, _probe(tc), held, sharded)


def _resume(service: treadle.ServiceClient, kind: str, path: str) -> tuple[float, list]:
    tc = service.create_training_client_from_state(path)
    return _step(tc, kind), _probe(tc)


def _close(a: list[np.ndarray], b: list[np.ndarray]) -> None:
    for x, y in zip(a, b, strict=True):
        np.testing.assert_allclose(x, y, rtol=0, atol=TOLERANCE)


def test_two_ranks_train_sample_and_checkpoint_as_one(tmp_path: Path, tiny_model_dir: Path) -> None:
    data = tmp_path / "data"
    with _server(data, tiny_model_dir, ranks=2) as (service, engine):
        two = {kind: _train(service, engine, kind) for kind in ("full", "lora")}
    with _server(data, tiny_model_dir, ranks=1) as (service, engine):
        one = {kind: _train(service, engine, kind) for kind in ("full", "lora")}
        from_two = {kind: _resume(service, kind, two[kind].saved) for kind in two}
    with _server(data, tiny_model_dir, ranks=2) as (service, engine):
        from_one = {kind: _resume(service, kind, one[kind].saved) for kind in one}

    # the full fine-tune is sharded (FSDP2): rank 0 holds half (its rows of each
    # tensor, at most one row more than half where the rows are odd); a LoRA model's
    # base is sharded (``tests/unit/trainer/test_fsdp_lora.py`` counts its shards), its
    # adapter and moments replicated
    full_two, full_one = two["full"], one["full"]
    print(f"weights + Adam on rank 0: 2 ranks {full_two.held} B, 1 rank {full_one.held} B")
    assert full_two.sharded and not full_one.sharded
    assert full_one.held / 2 <= full_two.held < full_one.held / 2 + full_one.held / 1000
    assert two["lora"].sharded and not one["lora"].sharded
    assert two["lora"].held == one["lora"].held

    for kind in ("full", "lora"):
        a, b = two[kind], one[kind]
        print(f"{kind}: 2 ranks {a.losses} / 1 rank {b.losses}")
        np.testing.assert_allclose(a.losses, b.losses, rtol=TOLERANCE)
        assert a.losses[-1] < a.losses[0]  # it learns
        _close(a.probe, b.probe)
        for (tok_a, lp_a), (tok_b, lp_b) in zip(a.sampled, b.sampled, strict=True):
            assert tok_a == tok_b
            np.testing.assert_allclose(lp_a, lp_b, rtol=0, atol=TOLERANCE)
        np.testing.assert_allclose(a.next_loss, b.next_loss, rtol=TOLERANCE)
        # a 2-rank state on 1 rank, and a 1-rank state on 2 ranks: the same next step
        for loss, after in (from_two[kind], from_one[kind]):
            np.testing.assert_allclose(loss, b.next_loss, rtol=TOLERANCE)
            _close(after, b.after_next)
