"""Which sampler worker of the pool keeps each partial rollout.

A sample stopped by its ``token_budget`` comes back "partial" with a resume
handle, and the worker that sampled it keeps its prompt and tokens under that
handle (``workers.sampler.partials``); a resume must go to that worker. Pool
samples are routed by load, so one tenant's handles may be kept on several pool
workers: the server notes, for each handle a pool worker answered with, which
worker keeps it, and sends a resume there.

In this server's memory only, like the handles in the workers' (bounded: beyond
``MAX_KEPT`` the oldest are forgotten). A handle this server never saw from the
pool (sampled colocated, forgotten, or from before a server restart) is not
here: its resume goes where a colocated one would, which answers NOT_FOUND
for a handle it does not keep.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from treadle.common.engine.domain import SequenceResult
from treadle.errors import InvalidArgumentError, NotFoundError

#: handles remembered (a pool worker keeps at most 65,536 per sampler of its own)
MAX_KEPT = 1 << 17


class KeptPartials:
    """Resume handle -> the pool worker that keeps its partial rollout. Used on the
    server's event loop only."""

    def __init__(self, limit: int = MAX_KEPT) -> None:
        self.limit = limit
        self._where: OrderedDict[str, str] = OrderedDict()

    def __len__(self) -> int:
        return len(self._where)

    def note(self, worker_id: str, sequences: Iterable[SequenceResult]) -> None:
        """``worker_id`` answered with ``sequences``: it keeps the partial ones."""
        for seq in sequences:
            if seq.resume_handle:
                self._where[seq.resume_handle] = worker_id
                self._where.move_to_end(seq.resume_handle)
        while len(self._where) > self.limit:
            self._where.popitem(last=False)

    def consumed(self, handles: Iterable[str]) -> None:
        """A resume of ``handles`` succeeded: each resumes once, so they are gone."""
        for h in handles:
            self._where.pop(h, None)

    def keeper(self, handles: tuple[str, ...], live: set[str]) -> str | None:
        """The pool worker that keeps the partial rollouts of ``handles`` (None: none
        of them came from the pool). Handles kept on different pool workers cannot
        be resumed in one call (each worker consumes all of its handles or none):
        INVALID_ARGUMENT saying so; kept on a worker that is gone (``live``: the
        live pool workers): NOT_FOUND, the rollouts went with it."""
        keepers = {h: self._where[h] for h in handles if h in self._where}
        for h, worker_id in keepers.items():
            if worker_id not in live:
                raise NotFoundError(
                    f"resume handle {h[:48]!r} not found: its partial rollout was kept on "
                    f"sampler worker {worker_id}, which is gone; sample the sequence again"
                )
        workers = set(keepers.values())
        if len(workers) > 1:
            raise InvalidArgumentError(
                f"resume_handles: kept on {len(workers)} sampler workers of the pool "
                "(each sample call runs on one, chosen by load); resume the handles of "
                "each sample call in a call of their own"
            )
        return next(iter(workers), None)
