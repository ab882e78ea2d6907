"""A queue per rank, fed by rank 0, in the group's ``TCPStore``.

Rank 0 writes command ``n`` for rank ``r`` under ``cmd/n/r``; rank ``r`` waits for
its next key, reads it and deletes it. Waiting is not a collective: an idle rank
waits as long as the worker is idle, while the collectives of a call run under
the bounded ``--collective-timeout``. The store lives in rank 0's process, so a
rank whose rank 0 died sees the connection close and exits: no rank is left
spinning.
"""

from __future__ import annotations

import pickle
from datetime import timedelta

import torch.distributed as dist

from treadle.workers.group.commands import RankCommand

#: how long one wait lasts before it checks the store is still there
_POLL = timedelta(seconds=2)


class RankGone(Exception):
    """Rank 0 (and with it the group's store) is gone."""


class CommandChannel:
    def __init__(self, store: dist.Store, rank: int, world_size: int) -> None:
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self._next = 0

    def post(self, per_rank: list[RankCommand]) -> None:
        """Rank 0: command ``per_rank[r - 1]`` for each rank ``r`` >= 1."""
        n, self._next = self._next, self._next + 1
        for r, command in enumerate(per_rank, start=1):
            self.store.set(f"cmd/{n}/{r}", pickle.dumps(command))  # type: ignore[arg-type]

    def take(self) -> RankCommand:
        """Another rank: its next command, waiting as long as it takes."""
        key = f"cmd/{self._next}/{self.rank}"
        while True:
            try:
                self.store.wait([key], _POLL)
                break
            except dist.DistStoreError:  # a timeout: nothing yet
                continue
            except dist.DistNetworkError as err:
                raise RankGone(str(err)) from err
        command: RankCommand = pickle.loads(self.store.get(key))
        self.store.delete_key(key)
        self._next += 1
        return command
