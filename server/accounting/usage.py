"""Usage accounting: counters added up in memory on the hot path and written to
the ``usage`` table every ``flush_s`` seconds (and when the server stops).

Writes are ``x = x + delta``, so several servers on one database add up; a flush
that fails keeps its counts for the next one. A crash loses at most the last
``flush_s`` seconds of counts, never a call's result.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from treadle.common.db import models as db
from treadle.server.db.tenancy import UsageDelta, add_usage

log = logging.getLogger("treadle.server")

#: (tenant_id, model_id or "" for a bare base model, base model or "" = look it up)
UsageKey = tuple[str, str, str]


class UsageMeter:
    def __init__(self, sessions: sessionmaker[Session], flush_s: float = 2.0) -> None:
        self.sessions = sessions
        self.flush_s = flush_s
        self._pending: dict[UsageKey, UsageDelta] = {}
        self._lock = threading.Lock()
        self._task: asyncio.Task[None] | None = None

    def add(
        self, tenant_id: str, delta: UsageDelta, *, model_id: str = "", base_model: str = ""
    ) -> None:
        """Count usage of a model (its base is looked up at flush) or, with no
        ``model_id``, of a bare ``base_model``."""
        key = (tenant_id, model_id, "" if model_id else base_model)
        with self._lock:
            prior = self._pending.get(key)
            self._pending[key] = delta if prior is None else prior + delta

    def pending(self) -> dict[UsageKey, UsageDelta]:
        with self._lock:
            return dict(self._pending)

    def flush(self) -> int:
        """Write what was counted since the last flush; the number of rows touched."""
        with self._lock:
            batch, self._pending = self._pending, {}
        if not batch:
            return 0
        try:
            with self.sessions() as s:
                model_ids = {m for _, m, b in batch if m and not b}
                bases: dict[str, str] = (
                    dict(
                        s.execute(
                            select(db.Model.id, db.Model.base_model).where(
                                db.Model.id.in_(model_ids)
                            )
                        ).all()
                    )
                    if model_ids
                    else {}
                )
                for (tenant_id, model_id, base), delta in batch.items():
                    add_usage(s, tenant_id, model_id, base or bases.get(model_id, ""), delta)
                s.commit()
        except Exception as err:  # keep the counts; the next flush tries again
            log.error("usage: could not write %d counters: %s", len(batch), err)
            with self._lock:
                for key, delta in batch.items():
                    prior = self._pending.get(key)
                    self._pending[key] = delta if prior is None else delta + prior
            return 0
        return len(batch)

    def start(self) -> None:
        """Flush every ``flush_s`` seconds on the running event loop."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def close(self) -> None:
        """Stop the periodic flush and write what is left."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        self.flush()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.flush_s)
            self.flush()
