"""Two gloo ranks in spawned processes, for the trainer's collective tests."""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from tests.integration.services import free_port


def on_two_ranks(target: Callable[..., None], *args: Any, timeout_s: float = 240) -> None:
    """``target(rank, *args)`` on each of 2 ranks of a gloo group (one torch thread
    each); both processes must exit 0. ``target`` must be a module-level function."""
    port = free_port()
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank, args=(target, r, port, args)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout_s)
    assert [p.exitcode for p in procs] == [0, 0]


def _rank(target: Callable[..., None], rank: int, port: int, args: tuple[Any, ...]) -> None:
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=timedelta(60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    torch.set_num_threads(1)
    try:
        target(rank, *args)
    finally:
        dist.destroy_process_group()
