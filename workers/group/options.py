"""The flags of a worker group (``--ranks``, ``--nnodes``, ``--node-rank``,
``--rdzv-endpoint``, ``--collective-timeout``; ``EngineOptions``) checked, each
error naming its flag. Imports torch only when the options ask for a group."""

from __future__ import annotations

from treadle.errors import InvalidArgumentError
from treadle.workers.engine.options import EngineOptions


def grouped(options: EngineOptions) -> bool:
    """Whether the options ask for a group (more than one rank, or several hosts)."""
    return options.ranks > 1 or options.nnodes > 1


def check_group(options: EngineOptions) -> None:
    """INVALID_ARGUMENT naming the flag when the group's flags cannot work here."""
    if options.ranks < 1:
        raise InvalidArgumentError(f"--ranks: {options.ranks}; a worker has at least one rank")
    if options.nnodes < 1:
        raise InvalidArgumentError(f"--nnodes: {options.nnodes}; at least one host")
    if not 0 <= options.node_rank < options.nnodes:
        raise InvalidArgumentError(
            f"--node-rank: {options.node_rank}; from 0 to --nnodes - 1 ({options.nnodes - 1})"
        )
    if options.collective_timeout_s <= 0:
        raise InvalidArgumentError(
            f"--collective-timeout: {options.collective_timeout_s}; seconds, above 0"
        )
    if options.group_restarts < 0:
        raise InvalidArgumentError(
            f"--group-restarts: {options.group_restarts}; a count, 0 or more"
        )
    if options.nnodes > 1 and not options.rdzv_endpoint:
        raise InvalidArgumentError(
            "--rdzv-endpoint: several hosts (--nnodes > 1) meet at HOST:PORT, served by node 0"
        )
    if options.rdzv_endpoint:
        endpoint(options.rdzv_endpoint)
    if not grouped(options):
        return
    from treadle.workers.device import device  # torch: only for a group

    where = device.resolve(options.device)
    if where.type == "cuda":
        import torch

        if options.ranks > torch.cuda.device_count():
            raise InvalidArgumentError(
                f"--ranks: {options.ranks} ranks, but this host has "
                f"{torch.cuda.device_count()} GPU(s) (one GPU a rank)"
            )


def endpoint(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise InvalidArgumentError(f"--rdzv-endpoint: {value!r}; write HOST:PORT")
    return host.strip("[]"), int(port)
