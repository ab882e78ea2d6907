"""A full fine-tune sharded over 2 ranks with FSDP2 (``workers.trainer.fsdp``, issue
36) equals the same model whole on one rank.

Each of two real processes on gloo holds the model twice: whole (the one-rank
reference, fed every datum) and sharded with ``fully_shard`` (fed the rank's
share of the datums). Three steps of two calls each (one of them a single
datum, so rank 1 has none and joins FSDP's collectives with zeros), clipped
AdamW: the ranks' losses add up to the one rank's, the step's metrics are equal,
each rank's local shards are its rows of the one rank's weights and Adam moments
(FSDP's ``Shard(0)``, uneven here: a vocabulary and an MLP of odd sizes), so a
rank holds half of the model; the tensors rank 0 gathers one at a time and
``unshard`` on every rank give the one rank's tensors back, and so do a
checkpoint rank 0 writes one gathered tensor at a time and a published version
it builds as they come (a clone, a shared-memory buffer, a file), none of
which keeps a gathered tensor while the next is gathered. float64: agreement
to rounding.

One of the calls has a KL penalty: its reference logprobs (the base's) go
through the base sharded over the group (``ShardedBases``), which rank 1 then
holds only as shards. ``forward_logprobs`` of the model and of its base
(``reference``) runs on the shards too, the datums split across the ranks (a
call of one datum: rank 1 has none and joins the all-gathers), the results
gathered on rank 0 in datum order: equal to the one rank's to 1e-10 in float64
and 1e-5 in float32, and no weight is left whole after the pass.
"""

from __future__ import annotations

import gc
import math
import weakref
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import TypeVar

import numpy as np
import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch.distributed.tensor import DTensor

from tests.unit.trainer.two_ranks import on_two_ranks
from treadle.common.engine.domain import (
    AdamConfig,
    DatumData,
    ForwardBackwardOp,
    ForwardLogprobsOp,
    ModelSpec,
)
from treadle.workers.engine.base_models import BaseModelRegistry
from treadle.workers.engine.versions import WeightSnapshot
from treadle.workers.group import collectives
from treadle.workers.model.params import LlamaParams
from treadle.workers.model.published import (
    WeightsFile,
    WeightsKeeper,
    WholeWeights,
    clone_weights,
)
from treadle.workers.model.tiny import build_tiny_model
from treadle.workers.sampler.process.shm import shared_fill
from treadle.workers.trainer import checkpoint, fsdp, trainer
from treadle.workers.trainer.sharded_base import KeepWhole, ShardedBases, ShardsOnly
from treadle.workers.trainer.trainer import TrainingModel
from treadle.workers.trainer.whole import WEIGHTS, WholeTensors, join

pytestmark = pytest.mark.slow

STEPS = 3
_Op = TypeVar("_Op", ForwardBackwardOp, ForwardLogprobsOp)
ADAM = AdamConfig(learning_rate=1e-2, weight_decay=0.1, grad_clip_norm=0.5)
SPEC = ModelSpec("m", "t", "tiny", 0, 0.0, 1, "float64")
TOLERANCE = 1e-10


def _datum(rng: np.random.Generator, length: int) -> DatumData:
    inputs = {
        "target_tokens": rng.integers(3, 60, length),
        "weights": rng.random(length),
        "logprobs": -rng.random(length),
        "advantages": rng.normal(size=length),
    }
    return DatumData(rng.integers(3, 60, length), inputs)


def _calls() -> list[ForwardBackwardOp]:
    rng = np.random.default_rng(0)
    three = tuple(_datum(rng, n) for n in (7, 12, 5))  # shares of 2 and 1
    one = (_datum(rng, 9),)  # rank 1's share is empty
    kl = {"kl_beta": 0.1}  # the base's reference logprobs, through the sharded base
    return [
        ForwardBackwardOp(three, "importance_sampling", kl),
        ForwardBackwardOp(one, "cross_entropy", {}),
    ]


def _forward_calls() -> list[ForwardLogprobsOp]:
    rng = np.random.default_rng(1)
    three = tuple(_datum(rng, n) for n in (7, 12, 5))
    one = (_datum(rng, 9),)  # rank 1's share is empty
    return [
        ForwardLogprobsOp(three),
        ForwardLogprobsOp(one, temperature=0.7),
        ForwardLogprobsOp(three, reference=True),
        ForwardLogprobsOp(one, reference=True),
    ]


def _share(op: _Op, rank: int) -> _Op:
    first = -(-len(op.data) // 2)  # rank 0 takes the larger share
    return replace(op, data=op.data[:first] if rank == 0 else op.data[first:])


def _check_forward_logprobs(
    rank: int, mine: TrainingModel, one: TrainingModel, bases: ShardedBases, tolerance: float
) -> None:
    """Each ``forward_logprobs`` on the shards, gathered on rank 0, equals the one rank's."""
    for op in _forward_calls():
        got = collectives.forward_logprobs(mine, _share(op, rank), bases)
        assert not isinstance(got, Exception), got
        gathered: list[object] = [None, None]
        dist.all_gather_object(gathered, got)
        merged = collectives.merge_results([g for g in gathered if g is not None])  # type: ignore[misc]
        want = trainer.forward_logprobs(one, op)
        assert len(merged.logprobs) == len(op.data)
        for lp_got, lp_want in zip(merged.logprobs, want.logprobs, strict=True):
            assert lp_got.dtype == lp_want.dtype
            np.testing.assert_allclose(lp_got, lp_want, rtol=0, atol=tolerance)
        # nothing left whole: the layers and the root (embedding, norm, head) resharded
        for sharding in (mine.sharding, bases.root(mine.base)):
            assert isinstance(sharding, fsdp.FsdpShards)
            for name, p in sharding.params().named_tensors():
                assert isinstance(p, DTensor), name


def _rows(whole: torch.Tensor, rank: int) -> torch.Tensor:
    chunks = torch.chunk(whole, 2, dim=0)
    return chunks[rank] if rank < len(chunks) else whole[:0]


def _bytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _held(model: TrainingModel) -> int:
    opt = model.optimizer
    return _bytes([*opt.params.values(), *opt.exp_avg.values(), *opt.exp_avg_sq.values()])


def _check_streamed_reads(rank: int, mine: TrainingModel, one: TrainingModel, out: Path) -> None:
    """Rank 0 reads the sharded model whole one tensor at a time (rank 1 joining each
    gather): a checkpoint written so has the one rank's tensors; a read of the
    moments alone still gathers the weights before them (so the ranks stay in
    step), and what a read leaves is gathered when it closes."""
    if rank == 1:
        for _ in range(3):
            join(mine, moments=True)
        return
    tensors = WholeTensors(mine, moments=True)
    checkpoint.save_state(mine, out / "two", 5, tensors)
    checkpoint.save_state(one, out / "one", 5)
    for name in ("weights.safetensors", "optimizer.safetensors"):
        got, want = load_file(out / "two" / name), load_file(out / "one" / name)
        assert got.keys() == want.keys()
        for key, t in want.items():
            torch.testing.assert_close(got[key], t, rtol=0, atol=TOLERANCE)
    tensors = WholeTensors(mine, moments=True)
    moments = dict(tensors.moments())  # the weights skipped: gathered all the same
    assert moments.keys() == one.optimizer.state_tensors().keys()
    with pytest.raises(ValueError, match="read already"):
        next(tensors.weights())
    tensors = WholeTensors(mine, moments=True)
    next(tensors.weights())
    tensors.close()  # the rest: gathered


def _watched(
    tensors: Iterator[tuple[str, torch.Tensor]], alive: list[int]
) -> Iterator[tuple[str, torch.Tensor]]:
    """``tensors`` as they are, noting as each arrives (gathered) how many of the
    earlier ones are still alive: what the reader kept beyond its own copies."""
    handed: list[weakref.ref[torch.Tensor]] = []
    for name, t in tensors:
        alive.append(sum(ref() is not None for ref in handed))
        handed.append(weakref.ref(t))
        yield name, t
        del t


def _shared_keeper(weights: WholeWeights) -> LlamaParams:
    return LlamaParams.from_state_dict(weights.cfg, shared_fill(weights.entries, weights.tensors))


def _check_published(rank: int, mine: TrainingModel, one: TrainingModel, out: Path) -> None:
    """A published version of the sharded model, built on rank 0 as each tensor is
    gathered (rank 1 joining each gather), equals the one rank's, whichever way the
    sampler backend keeps it: a clone, one shared-memory buffer, a file (vLLM's).
    No gathered tensor is alive when the next one is gathered: rank 0 holds the
    version and one whole tensor beyond its shards, never the weights twice."""
    keepers: list[WeightsKeeper] = [
        clone_weights,
        _shared_keeper,
        lambda w: WeightsFile.write(w, out),
    ]
    if rank == 1:
        for _ in keepers:
            join(mine)
        return
    want = one.published()
    assert isinstance(want, WeightSnapshot)
    model_bytes = _bytes(list(want.params.parameters()))
    for keep in keepers:
        tensors = WholeTensors(mine)
        alive: list[int] = []
        entries = tensors.entries(WEIGHTS)
        got = mine.published(keep, mine.whole_weights(entries, _watched(tensors.weights(), alive)))
        assert isinstance(got, WeightSnapshot) and got.version == one.version == STEPS
        assert len(alive) == len(entries) and max(alive) == 0, alive
        if isinstance(got.weights, WeightsFile):
            directory = got.weights.directory
            assert got.weights.nbytes >= model_bytes  # the version is the file, not in memory
        else:
            assert _bytes(list(got.params.parameters())) == model_bytes  # one copy
        params = got.params
        for (name, t), (_, w) in zip(
            params.named_tensors(), want.params.named_tensors(), strict=True
        ):
            assert not isinstance(t, DTensor), name
            torch.testing.assert_close(t, w, rtol=0, atol=TOLERANCE)
        del got, params
    gc.collect()
    assert not directory.exists()  # the file goes with the last holder of the version


def _rank(rank: int, model_dir: Path, out: Path) -> None:
    base = BaseModelRegistry({"tiny": model_dir}).get("tiny", torch.float64)
    twin_base = BaseModelRegistry({"tiny": model_dir}).get("tiny", torch.float64)
    one, mine = TrainingModel(SPEC, twin_base), TrainingModel(SPEC, base)
    fsdp.shard(mine)
    bases = ShardedBases(KeepWhole() if rank == 0 else ShardsOnly())
    assert mine.sharding is not None
    # FSDP's Shard(0): this rank's rows of each tensor, half of the model
    for name, whole in one.trainable.items():
        assert mine.trainable[name].shape == _rows(whole, rank).shape, name
    assert any(w.shape[0] % 2 for w in one.trainable.values())  # uneven rows are used
    held = torch.tensor([_held(mine)], dtype=torch.int64)
    dist.all_reduce(held)
    assert int(held) == _held(one)

    for _ in range(STEPS):
        for op in _calls():
            got = collectives.forward_backward(mine, _share(op, rank), bases)
            want = trainer.forward_backward(one, op)
            assert not isinstance(got, Exception)
            mine_loss = 0.0 if got is None else got.metrics["loss:sum"]
            loss = torch.tensor(mine_loss, dtype=torch.float64)
            dist.all_reduce(loss)  # losses are sums: the ranks' add up to the call's
            assert math.isclose(float(loss), want.metrics["loss:sum"], rel_tol=TOLERANCE)
        got_step, want_step = mine.optim_step(ADAM), one.optim_step(ADAM)
        for key, value in want_step.metrics.items():
            assert math.isclose(got_step.metrics[key], value, rel_tol=TOLERANCE), key
        assert want_step.metrics["grad_norm:value"] > ADAM.grad_clip_norm  # clipped
    # the KL's reference went through the base sharded once; rank 1 keeps its shards only
    assert base.loaded == (rank == 0)
    _check_forward_logprobs(rank, mine, one, bases, TOLERANCE)

    opt_one, opt_mine = one.optimizer, mine.optimizer
    for state_one, state_mine in (
        (opt_one.params, opt_mine.params),
        (opt_one.exp_avg, opt_mine.exp_avg),
        (opt_one.exp_avg_sq, opt_mine.exp_avg_sq),
    ):
        for name, whole in state_one.items():
            torch.testing.assert_close(
                state_mine[name], _rows(whole.detach(), rank), rtol=0, atol=TOLERANCE
            )
    if rank == 0:
        tensors = WholeTensors(mine, moments=True)
        weights, moments = dict(tensors.weights()), dict(tensors.moments())
        for name, whole in opt_one.params.items():
            torch.testing.assert_close(weights[name], whole.detach(), rtol=0, atol=TOLERANCE)
            torch.testing.assert_close(
                moments[f"exp_avg_sq.{name}"], opt_one.exp_avg_sq[name], rtol=0, atol=TOLERANCE
            )
    else:
        join(mine, moments=True)
    _check_streamed_reads(rank, mine, one, out)
    _check_published(rank, mine, one, out)
    fsdp.unshard(mine)
    assert mine.sharding is None
    for name, whole in opt_one.params.items():
        torch.testing.assert_close(opt_mine.params[name], whole.detach(), rtol=0, atol=TOLERANCE)
        torch.testing.assert_close(
            opt_mine.exp_avg[name], opt_one.exp_avg[name], rtol=0, atol=TOLERANCE
        )


def _rank_float32(rank: int, model_dir: Path) -> None:
    """float32: one optimizer step moves the weights, then every ``forward_logprobs``."""
    base = BaseModelRegistry({"tiny": model_dir}).get("tiny", torch.float32)
    twin_base = BaseModelRegistry({"tiny": model_dir}).get("tiny", torch.float32)
    spec = replace(SPEC, dtype="float32")
    one, mine = TrainingModel(spec, twin_base), TrainingModel(spec, base)
    fsdp.shard(mine)
    bases = ShardedBases(ShardsOnly())  # rank 0 as with vLLM: no whole base kept
    for op in _calls():
        collectives.forward_backward(mine, _share(op, rank), bases)
        trainer.forward_backward(one, op)
    mine.optim_step(ADAM)
    one.optim_step(ADAM)
    _check_forward_logprobs(rank, mine, one, bases, 1e-5)
    assert not base.loaded  # the reference read the shards only


def test_fsdp_on_two_ranks_equals_one(tmp_path: Path) -> None:
    # odd sizes: FSDP's rows split unevenly (50 and 49 of the MLP's 99, say)
    model_dir = build_tiny_model(
        tmp_path / "tiny", "tiny", 0, overrides={"vocab_size": 97, "intermediate_size": 99}
    )
    on_two_ranks(_rank, model_dir, tmp_path)


def test_fsdp_forward_logprobs_float32(tmp_path: Path) -> None:
    model_dir = build_tiny_model(
        tmp_path / "tiny", "tiny", 0, overrides={"vocab_size": 97, "intermediate_size": 99}
    )
    on_two_ranks(_rank_float32, model_dir)
