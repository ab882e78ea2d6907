"""Starting a worker's group of ranks (``--ranks N``) on torch.distributed.

Rendezvous is torch's own: a ``TCPStore`` served by rank 0's process (on
``--rdzv-endpoint HOST:PORT``, or a free loopback port when the group is one
host), which every rank joins before ``init_process_group`` over it (gloo on
the CPU, NCCL on CUDA with one GPU a rank). The ranks of a host are processes
started here (``multiprocessing``'s spawn, as ``torch.multiprocessing.spawn``
does); ranks on other hosts are started there by ``treadle worker --ranks N
--nnodes M --node-rank K --rdzv-endpoint HOST:PORT``. Global rank =
``node_rank * ranks + local rank``; rank 0 (node 0, local rank 0) is the
process that runs the engine and talks to the server.

``--ranks 1 --nnodes 1`` (the default) starts nothing: the engine runs alone,
with no torch.distributed in its path.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import timedelta
from multiprocessing.process import BaseProcess

import torch
import torch.distributed as dist

from treadle.errors import InvalidArgumentError, UnavailableError
from treadle.workers.device import device
from treadle.workers.device.host_load import usable_cpus
from treadle.workers.engine.base_models import BaseModelRegistry
from treadle.workers.engine.config import EngineConfig
from treadle.workers.engine.loop import Engine
from treadle.workers.group.channel import CommandChannel
from treadle.workers.group.follower import resolve_rank_device, serve_rank
from treadle.workers.group.leader import GroupPeers
from treadle.workers.group.options import check_group, endpoint, grouped

log = logging.getLogger("treadle.group")

#: the least time the ranks have to start and join (starting a process that imports
#: torch takes seconds; --collective-timeout bounds it when longer)
START_TIMEOUT_S = 120.0
#: how long a rank on another host tries to reach the rendezvous endpoint
CONNECT_TIMEOUT_S = 10.0


@dataclass
class RankProcesses:
    """The ranks this process started on its host."""

    procs: list[BaseProcess]

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def dead(self) -> list[BaseProcess]:
        return [p for p in self.procs if not p.is_alive()]

    def stop(self, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(5)


def _backend(where: torch.device) -> str:
    return "nccl" if where.type == "cuda" else "gloo"


def _spawn(
    config: EngineConfig, host: str, port: int, first_rank: int, local_ranks: range
) -> RankProcesses:
    ctx = mp.get_context("spawn")
    procs: list[BaseProcess] = []
    world = config.ranks * config.nnodes
    for local in local_ranks:
        rank = first_rank + local
        p = ctx.Process(
            target=rank_main,
            args=(config, host, port, rank, local, world),
            name=f"treadle-rank-{rank}",
            daemon=True,
        )
        p.start()
        procs.append(p)
    return RankProcesses(procs)


def rank_main(
    config: EngineConfig, host: str, port: int, rank: int, local_rank: int, world: int
) -> None:
    """A rank other than 0 (the target of its process): join, then execute commands."""
    timeout = timedelta(seconds=config.collective_timeout_s)
    store = dist.TCPStore(host, port, is_master=False, timeout=timeout)
    where = resolve_rank_device(config, local_rank)
    if where.type == "cuda":
        torch.cuda.set_device(where)
    try:  # what the rank will load is there: else the group's start says why
        registry = BaseModelRegistry(config.base_models, where)
        for name in registry.names():
            registry.config(name)
    except Exception as err:
        store.set(f"failed/{rank}", f"{type(err).__name__}: {err}")
        raise SystemExit(1) from err
    store.set(f"joined/{rank}", "1")
    dist.init_process_group(
        _backend(where),
        store=dist.PrefixStore("pg", store),
        rank=rank,
        world_size=world,
        timeout=timeout,
    )
    try:
        serve_rank(CommandChannel(store, rank, world), config, where)
    finally:
        dist.destroy_process_group()


class WorkerGroup:
    """Rank 0's group: the store it serves, the ranks it started, its peers.

    ``on_lost`` is called (with the reason) once a collective failed: a rank died
    or hung. The ranks this process started are killed at once, so none is left
    waiting on a rank that is gone; what happens to the worker is the caller's
    (``restart_or_exit``: a server or Celery worker re-executes itself with a
    fresh group, or exits for its supervisor, as after a worker crash)."""

    def __init__(self, config: EngineConfig, on_lost: Callable[[str], None] | None = None) -> None:
        check_group(config)
        self.config = config
        self._on_lost = on_lost
        world = config.ranks * config.nnodes
        host, port = endpoint(config.rdzv_endpoint) if config.rdzv_endpoint else ("127.0.0.1", 0)
        timeout = timedelta(seconds=config.collective_timeout_s)
        try:
            self.store = dist.TCPStore(
                host,
                port,
                world_size=world,
                is_master=True,
                wait_for_workers=False,
                timeout=timeout,
            )
        except (RuntimeError, dist.DistError) as err:
            flag = "--rdzv-endpoint" if config.rdzv_endpoint else "--ranks"
            raise InvalidArgumentError(
                f"{flag}: cannot serve the rendezvous on {host}:{port}: {err}"
            ) from err
        self.procs = _spawn(config, host, self.store.port, 0, range(1, config.ranks))
        self._wait_joined(world, max(timeout, timedelta(seconds=START_TIMEOUT_S)))
        where = resolve_rank_device(config, 0)
        dist.init_process_group(
            _backend(where),
            store=dist.PrefixStore("pg", self.store),
            rank=0,
            world_size=world,
            timeout=timeout,
        )
        self.peers = GroupPeers(
            CommandChannel(self.store, 0, world), on_broken=self._broken, on_closed=self.close
        )
        print(f"treadle: a worker of {world} ranks ({_backend(where)})", flush=True)

    def _wait_joined(self, world: int, timeout: timedelta) -> None:
        """Every rank joined the store, or the reason one did not (not a hang)."""
        deadline = time.monotonic() + timeout.total_seconds()
        keys = [f"joined/{r}" for r in range(1, world)]
        while True:
            for r in range(1, world):
                if self.store.check([f"failed/{r}"]):
                    self.procs.stop(1)
                    why = self.store.get(f"failed/{r}").decode()
                    raise UnavailableError(f"the worker's group did not start: rank {r}: {why}")
            dead = self.procs.dead()
            if dead:
                self.procs.stop(1)
                codes = ", ".join(f"{p.name} exited with {p.exitcode}" for p in dead)
                raise UnavailableError(f"the worker's group did not start: {codes}")
            if all(self.store.check([k]) for k in keys):
                return
            if time.monotonic() > deadline:
                self.procs.stop(1)
                raise UnavailableError(
                    f"the worker's group did not start: {world} ranks expected, "
                    f"{1 + sum(self.store.check([k]) for k in keys)} joined in "
                    f"{timeout.total_seconds():g} s"
                )
            time.sleep(0.05)

    def _broken(self, why: str) -> None:
        # the ranks left would wait on a rank that is gone: stop them now
        for p in self.procs.procs:
            if p.is_alive():
                p.kill()
        if self._on_lost is not None:
            self._on_lost(why)

    def close(self) -> None:
        self.procs.stop()
        if dist.is_initialized():
            dist.destroy_process_group()


def build_engine(config: EngineConfig, on_lost: Callable[[str], None] | None = None) -> Engine:
    """The engine of a worker: rank 0 of its group when ``--ranks``/``--nnodes`` ask
    for one (``Engine.stop`` then stops the group; ``on_lost``: ``WorkerGroup``),
    else alone."""
    if not grouped(config):
        return Engine(config)
    config = shared_cores(config)
    return Engine(config, peers=WorkerGroup(config, on_lost).peers)


def restart_or_exit(config: EngineConfig) -> Callable[[str], None]:
    """``on_lost`` for a worker process (``treadle serve`` or ``treadle worker``) with
    ``config``'s ``--group-restarts``: ``exit_soon`` with its allowance."""
    return lambda why: exit_soon(why, config.group_restarts)


def shared_cores(config: EngineConfig) -> EngineConfig:
    """On the CPU, ranks of one host share its cores: with ``--threads 0`` (torch's
    default, every core) each rank takes cores / ranks threads, not all of them
    (N ranks each spinning on every core run slower than one)."""
    if config.threads > 0 or device.resolve(config.device).type != "cpu":
        return config
    cores = len(usable_cpus())
    return replace(config, threads=max(1, cores // config.ranks))


#: seconds between a group losing a rank and its process exiting (``exit_soon``):
#: time for the failed call's UNAVAILABLE to reach its caller
EXIT_AFTER_S = 2.0


#: how many times this worker process restarted its group so far (set across re-exec)
RESTARTED_ENV = "TREADLE_GROUP_RESTARTED"


def exit_soon(why: str, restarts: int = 0) -> None:
    """A worker process whose group lost a rank restarts shortly, the failed call
    answered first: it re-executes itself (the same command line and process id,
    a fresh group of ranks), at most ``restarts`` times in its life
    (``--group-restarts``); after that it exits with status 1 for its supervisor
    to restart it. Either way the server brings its models back at their last
    applied step (checkpoint and ops log), as after any worker crash
    (docs/scaling.md)."""
    done = int(os.environ.get(RESTARTED_ENV, "0") or 0)
    if done < restarts:
        log.critical(
            "group: a rank was lost (%s); restarting with a fresh group in %.0f s "
            "(restart %d of --group-restarts %d)",
            why, EXIT_AFTER_S, done + 1, restarts,
        )  # fmt: skip
        timer = threading.Timer(EXIT_AFTER_S, _reexec, (done + 1,))
    else:
        log.critical(
            "group: a rank was lost (%s); exiting in %.0f s (restarted %d times, "
            "--group-restarts %d)",
            why, EXIT_AFTER_S, done, restarts,
        )  # fmt: skip
        timer = threading.Timer(EXIT_AFTER_S, os._exit, (1,))
    timer.daemon = True
    timer.start()


def _reexec(count: int) -> None:
    """This process, started again in place (its ranks are gone already)."""
    os.environ[RESTARTED_ENV] = str(count)
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    try:
        os.execv(sys.executable, sys.orig_argv)
    except OSError:
        log.exception("group: could not restart this process; exiting")
        os._exit(1)


def run_node(config: EngineConfig) -> int:
    """A host other than node 0: start its ranks and wait for them (they exit when
    rank 0 stops or is gone)."""
    check_group(config)
    host, port = endpoint(config.rdzv_endpoint)
    try:
        dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=CONNECT_TIMEOUT_S))
    except (RuntimeError, dist.DistError) as err:
        raise InvalidArgumentError(
            f"--rdzv-endpoint: nothing answers at {host}:{port} "
            f"(start node 0 first, with the same --rdzv-endpoint): {err}"
        ) from err
    first = config.node_rank * config.ranks
    procs = _spawn(shared_cores(config), host, port, first, range(config.ranks))
    print(
        f"treadle: node {config.node_rank}: ranks {first}..{first + config.ranks - 1} of "
        f"{config.ranks * config.nnodes} joined {host}:{port}",
        flush=True,
    )
    for p in procs.procs:
        p.join()
    return max((p.exitcode or 0) for p in procs.procs)
