"""The training step's memory savers keep its numbers, and its memory check refuses
before any compute: the chunked unembedding equals whole logits (values, entropy,
gradients); activation checkpointing equals keeping the activations; a batch over
the worker's memory limit is RESOURCE_EXHAUSTED with the size and what to change,
leaving weights and accumulated gradients exactly as they were."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from treadle.common.engine.domain import DatumData, ForwardBackwardOp, ModelSpec
from treadle.errors import ResourceExhaustedError
from treadle.workers.engine.base_models import BaseModel, BaseModelRegistry
from treadle.workers.model.llama import target_logprobs
from treadle.workers.trainer import memory as train_memory
from treadle.workers.trainer import trainer
from treadle.workers.trainer.chunked_logprobs import chunked_target_logprobs
from treadle.workers.trainer.trainer import TrainingModel

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def base64(tiny_model_dir: Path) -> BaseModel:
    return BaseModelRegistry({"tiny": tiny_model_dir}).get("tiny", torch.float64)


def _op(rows: int, length: int, seed: int = 0) -> ForwardBackwardOp:
    rng = np.random.default_rng(seed)
    data = tuple(
        DatumData(
            rng.integers(3, 90, size=length),
            {
                "target_tokens": rng.integers(3, 90, size=length),
                "weights": rng.random(length).astype(np.float32),
            },
        )
        for _ in range(rows)
    )
    return ForwardBackwardOp(data=data, loss_fn="cross_entropy", loss_config={}, temperature=0.7)


def _full(base: BaseModel, **kwargs: object) -> TrainingModel:
    spec = ModelSpec("m", "t", "tiny", 0, 0.0, 0, "float64")
    return TrainingModel(spec, base, **kwargs)  # type: ignore[arg-type]


def _grads(model: TrainingModel) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.trainable.items() if p.grad is not None}


def test_chunked_unembedding_equals_whole_logits() -> None:
    gen = torch.Generator().manual_seed(0)
    B, T, H, V, temp = 3, 5, 8, 40, 0.7
    hidden = torch.randn(B, T, H, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(V, H, generator=gen, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, V, (B, T), generator=gen)
    upstream = torch.randn(B, T, generator=gen, dtype=torch.float64)

    lp, ent = chunked_target_logprobs(
        hidden, weight, targets, temp, with_entropy=True, chunk_bytes=4 * V * 4
    )  # 4 positions a chunk: 15 positions in 4 chunks
    (lp * upstream).sum().backward()
    g_h, g_w = hidden.grad.clone(), weight.grad.clone()  # type: ignore[union-attr]
    hidden.grad, weight.grad = None, None

    logits = hidden @ weight.T
    ref = target_logprobs(logits, targets, temp)
    logp = torch.log_softmax(logits.detach() / temp, dim=-1)
    ref_ent = -(logp.exp() * logp).sum(-1)
    (ref * upstream).sum().backward()
    torch.testing.assert_close(lp, ref, rtol=1e-12, atol=1e-12)
    assert ent is not None
    torch.testing.assert_close(ent, ref_ent, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(g_h, hidden.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(g_w, weight.grad, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("chunked", [False, True])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_memory_savers_keep_the_step(
    base64: BaseModel, monkeypatch: pytest.MonkeyPatch, chunked: bool, checkpointing: bool
) -> None:
    op = _op(3, 9)
    plain = _full(base64)
    want = trainer.forward_backward(plain, op)
    if chunked:
        monkeypatch.setattr(trainer, "LOGITS_CHUNK_BYTES", 0)
    saver = _full(base64, checkpoint_activations=checkpointing)
    got = trainer.forward_backward(saver, op)
    for a, b in zip(got.logprobs, want.logprobs, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)
    assert got.metrics == pytest.approx(want.metrics, rel=1e-10)
    g_want, g_got = _grads(plain), _grads(saver)
    assert set(g_got) == set(g_want)
    for n in g_want:
        torch.testing.assert_close(g_got[n], g_want[n], rtol=1e-10, atol=1e-12)


def test_a_batch_over_the_memory_limit_is_refused_before_it_starts(base64: BaseModel) -> None:
    small, big = _op(1, 4, seed=1), _op(8, 32, seed=2)
    model = _full(base64, memory_limit_bytes=0)
    trainer.forward_backward(model, small)  # accumulated gradients to keep
    weights = {n: p.detach().clone() for n, p in model.trainable.items()}
    grads = _grads(model)
    need_small = train_memory.activation_bytes(
        model.cfg, 1, 4, 8, checkpointing=False, chunked_logits=False
    )
    model.memory_limit_bytes = need_small + sum(t.numel() * 8 for t in weights.values())
    with pytest.raises(ResourceExhaustedError) as err:
        trainer.forward_backward(model, big)
    msg = str(err.value)
    assert "data: this ForwardBackward needs about " in msg
    assert "MiB" in msg and "smaller ForwardBackward calls" in msg
    assert "activation checkpointing" in msg
    for n, p in model.trainable.items():
        assert torch.equal(p.detach(), weights[n])
    assert _grads(model).keys() == grads.keys()
    for n, g in _grads(model).items():
        assert torch.equal(g, grads[n])
    trainer.forward_backward(model, small)  # what fits still runs


def test_the_flags_reach_the_engine_config(tmp_path: Path) -> None:
    import argparse
    import dataclasses

    from treadle.errors import InvalidArgumentError
    from treadle.server.config import ServerConfig
    from treadle.workers.engine.flags import add_engine_flags, engine_config, engine_settings
    from treadle.workers.worker.config import WorkerConfig

    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    args = ["--activation-checkpointing", "--train-memory-limit-bytes", "12345"]
    settings = engine_settings(parser.parse_args(args))
    made = engine_config(ServerConfig(data_dir=tmp_path, **settings), {}, None)
    assert (made.activation_checkpointing, made.train_memory_limit_bytes) == (True, 12345)
    worker_fields = {f.name for f in dataclasses.fields(WorkerConfig)}
    assert {"activation_checkpointing", "train_memory_limit_bytes"} <= worker_fields
    off = engine_settings(parser.parse_args([]))
    assert (off["activation_checkpointing"], off["train_memory_limit_bytes"]) == (False, 0)
    with pytest.raises(InvalidArgumentError, match="train_memory_limit_bytes: out of range"):
        ServerConfig(data_dir=tmp_path, train_memory_limit_bytes=-1)


def test_version_zero_of_a_full_fine_tune_shares_the_base_weights(base64: BaseModel) -> None:
    """Publishing the untrained model (the engine does at creation) costs no copy;
    after a step the version is a copy of the trained weights, not the base."""
    from treadle.common.engine.domain import AdamConfig

    model = _full(base64)
    v0 = model.snapshot()
    assert v0.params.embed_tokens.data_ptr() == base64.params.embed_tokens.data_ptr()
    trainer.forward_backward(model, _op(2, 6))
    model.optim_step(AdamConfig(learning_rate=1e-2))
    v1 = model.snapshot()
    assert v1.version == 1
    for (n, t), (_, w) in zip(v1.params.named_tensors(), model.params.named_tensors(), strict=True):
        assert t.data_ptr() != w.data_ptr(), n  # a copy, not the live weights
        assert torch.equal(t, w.detach()), n
    assert not torch.equal(v1.params.embed_tokens, base64.params.embed_tokens)


def test_a_full_fine_tune_failing_mid_backward_keeps_the_earlier_gradients(
    base64: BaseModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A later ``forward_backward`` of a step that fails deep in its backward (here
    at the embedding's output: every layer's and the head's gradients exist by
    then) leaves the gradients of the calls before it bit for bit as they were;
    the weights too; accumulation then goes on from there. In-place accumulation
    during the backward (``loss.backward()``) would have changed every layer's."""
    model = _full(base64)
    op = _op(2, 9)
    trainer.forward_backward(model, op)
    trainer.forward_backward(model, _op(3, 7, seed=1))
    before = _grads(model)
    weights = {n: p.detach().clone() for n, p in model.trainable.items()}
    assert before.keys() == model.trainable.keys()
    reached: list[str] = []
    real = torch.nn.functional.embedding

    def failing_backward(g: torch.Tensor) -> torch.Tensor:
        # the head's and every layer's gradients were computed before this point
        reached.append("embedding output")
        raise RuntimeError("out of memory (injected, mid-backward)")

    def embedding(*args: object, **kwargs: object) -> torch.Tensor:
        out = real(*args, **kwargs)  # type: ignore[arg-type]
        if out.requires_grad:
            out.register_hook(failing_backward)
        return out

    monkeypatch.setattr(torch.nn.functional, "embedding", embedding)
    with pytest.raises(RuntimeError, match="mid-backward"):
        trainer.forward_backward(model, _op(2, 11, seed=2))
    monkeypatch.undo()
    assert reached == ["embedding output"]
    after = _grads(model)
    for name, g in before.items():
        assert torch.equal(after[name], g), f"{name}: the failed call changed its gradient"
    for name, p in model.trainable.items():
        assert torch.equal(p.detach(), weights[name])

    trainer.forward_backward(model, _op(2, 11, seed=2))
    fresh = _full(base64)
    for o in (op, _op(3, 7, seed=1), _op(2, 11, seed=2)):
        trainer.forward_backward(fresh, o)
    for name, p in model.trainable.items():
        assert torch.equal(p.grad, fresh.trainable[name].grad), name
