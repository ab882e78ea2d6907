"""A full fine-tune's state sharded over 2 ranks (``workers.trainer.sharding``, issue
36): flat shards padded to an even size (tensors of odd sizes here), gradients
reduce-scattered, AdamW stepping only each rank's shards with the clip and
update norms summed over the ranks. Three steps, clipped, equal one AdamW on the
whole tensors with the ranks' gradients summed: weights, moments, metrics.

Two real processes on gloo (torch.distributed), float64: agreement to rounding.
"""

from __future__ import annotations

import math
import multiprocessing as mp
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from treadle.common.engine.domain import AdamConfig
from treadle.workers.trainer.optimizer import AdamW
from treadle.workers.trainer.sharding import FlatShards

pytestmark = pytest.mark.slow

SHAPES = {"a": (3, 5), "b": (7,), "c": (2, 3, 3)}  # 15, 7, 18 elements: two are odd
STEPS = 3
ADAM = AdamConfig(learning_rate=1e-2, weight_decay=0.1, grad_clip_norm=0.5)


def _whole(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=gen, dtype=torch.float64) for n, s in SHAPES.items()}


def _rank(rank: int, port: int) -> None:
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=timedelta(60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    try:
        sharding = FlatShards({n: tuple(s) for n, s in SHAPES.items()}, 8)
        reference = AdamW({n: t.clone() for n, t in _whole(0).items()})
        mine = AdamW({n: sharding.take(t) for n, t in _whole(0).items()})
        mine.reduce = sharding.all_sum
        assert sum(t.numel() for t in mine.params.values()) == 8 + 4 + 9  # ceil(n / 2) each
        for step in range(STEPS):
            grads = [_whole(100 + 10 * step + r) for r in range(2)]  # rank r's gradient
            for n, p in reference.params.items():
                p.grad = grads[0][n] + grads[1][n]
            for n, p in mine.params.items():
                p.grad = sharding.reduce(grads[rank][n], p)
            want, got = reference.step(ADAM), mine.step(ADAM)
            for key in ("grad_norm:value", "update_norm:value"):
                assert math.isclose(got[key], want[key], rel_tol=1e-12), (key, got, want)
            assert want["grad_norm:value"] > ADAM.grad_clip_norm  # the clip is exercised
        for state, whole in (
            (mine.params, reference.params),
            (mine.exp_avg, reference.exp_avg),
            (mine.exp_avg_sq, reference.exp_avg_sq),
        ):
            for n, shard in state.items():
                torch.testing.assert_close(sharding.gather(n, shard), whole[n], rtol=0, atol=1e-12)
                padding = shard.numel() * 2 - whole[n].numel()
                if rank == 1 and padding:
                    assert torch.all(shard[-padding:] == 0)  # the padding never moves
    finally:
        dist.destroy_process_group()


def test_sharded_adamw_equals_whole() -> None:
    port = _free_port()
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank, args=(r, port)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0, 0]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
