"""The ends of ordered calls on an in-process engine, written to the ops log behind
their answers, many in one transaction (group commit).

An ordered call writes its ops row twice: when it is admitted (before the engine
sees it: a repeat is then known and neither admitted nor counted again) and when
it ends. Where the engine runs in the server's own process, nothing reads the end
before the server stops: a crash takes the engine's state with it and the models
come back at their last checkpoints, so the end need not be committed before the
caller has its answer. The ends are queued here, in the order the calls ended,
and written ``flush_s`` later, each batch in one transaction; the call that ended
its row is counted (usage) then, once, exactly as when the end was written first.
A crash loses at most the last ``flush_s`` of ends (their rows stay ``pending``,
their usage uncounted), never a call's result; a stop writes them all
(``close``). A flush that fails keeps its ends for the next one.

A distributed server writes each end before answering (``OrderedPipeline``): its
workers outlive it, and the replay log recovers a lost model from the ended rows.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass

from sqlalchemy import Connection

from treadle.server.db import ops_log

log = logging.getLogger("treadle.server")

#: how long an end waits for others to share its transaction
FLUSH_S = 0.05
#: how long after a failed flush the next one is tried
RETRY_S = 1.0


@dataclass(frozen=True)
class Ending:
    model_id: str
    seq_id: int
    status: str
    error_code: str | None
    digest: str
    #: called once the row is written, if this call was the one that ended it
    on_ended: Callable[[], None] | None = None


class OpEndings:
    """Queued ends of ops rows; ``end`` and ``flush`` run on the server's event loop."""

    def __init__(
        self,
        connection: Callable[[], contextlib.AbstractContextManager[Connection]],
        flush_s: float = FLUSH_S,
    ) -> None:
        self.connection = connection
        self.flush_s = flush_s
        self._queued: list[Ending] = []
        self._timer: asyncio.TimerHandle | None = None

    def end(self, ending: Ending) -> None:
        """Queue a call's end; written within ``flush_s``."""
        self._queued.append(ending)
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self.flush_s, self.flush)

    def queued(self) -> int:
        return len(self._queued)

    def flush(self) -> int:
        """Write every queued end in one transaction, in order; how many were written."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        batch, self._queued = self._queued, []
        if not batch:
            return 0
        try:
            with self.connection() as conn:
                ended = [
                    ops_log.finish_pending_op(
                        conn, e.model_id, e.seq_id, e.status, e.error_code, e.digest
                    )
                    for e in batch
                ]
        except Exception as err:  # the database is away: keep them, try again
            log.warning("writing %d ends of calls to the ops log failed: %s", len(batch), err)
            self._queued = batch + self._queued
            with contextlib.suppress(RuntimeError):  # no loop: the next end or close
                loop = asyncio.get_running_loop()
                self._timer = loop.call_later(RETRY_S, self.flush)
            return 0
        for ending, was_ended in zip(batch, ended, strict=True):
            if was_ended and ending.on_ended is not None:
                ending.on_ended()
        return len(batch)

    async def close(self) -> None:
        """Write what is queued (the server stops)."""
        self.flush()
