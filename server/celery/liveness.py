"""The liveness watchdog of a distributed server.

A thread checks the ``workers`` table every ``check_s``: a live worker whose
heartbeat is older than ``worker_timeout_s`` is declared dead (one conditional
UPDATE, so one server wins), its active models become ``lost``, and every call
this server has in flight on it fails with UNAVAILABLE. A worker stopping
gracefully turns ``draining``: its models are named (``Placement.draining``) so
the server's lifecycle unloads each at its first idle moment; a model its worker
let go of this way is ``unloaded``, not lost.
"""

from __future__ import annotations

import datetime as dt
import logging
import threading

from sqlalchemy.orm import Session, sessionmaker

from treadle.common.db import workers as wq
from treadle.errors import UnavailableError
from treadle.server.celery.placement import LiveWorker, Placement
from treadle.server.celery.transport import CeleryTransport, Pending

log = logging.getLogger("treadle.server")


class Liveness:
    def __init__(
        self,
        sessions: sessionmaker[Session],
        placement: Placement,
        transport: CeleryTransport,
        *,
        worker_timeout_s: float,
        check_s: float,
    ) -> None:
        self.sessions = sessions
        self.placement = placement
        self.transport = transport
        self.worker_timeout_s = worker_timeout_s
        self.check_s = check_s
        self._stopping = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name="treadle-watchdog", daemon=True)

    def start(self) -> None:
        self.refresh()
        self._watcher.start()

    def stop(self) -> None:
        self._stopping.set()
        if self._watcher.is_alive():
            self._watcher.join(5)

    def refresh(self) -> None:
        """One liveness pass: declare stale workers dead, mark their models lost, fail
        the calls in flight on any gone worker, and refresh the live-worker list."""
        now = dt.datetime.now(dt.timezone.utc)
        p = self.placement
        with p.lock:
            in_use = set(p.placed.values())
        in_use |= self.transport.busy_workers()
        with self.sessions() as s:
            declared = wq.declare_dead(s, now - dt.timedelta(seconds=self.worker_timeout_s))
            lost_models = wq.mark_models_lost(s, wq.stopped_workers_with_models(s))
            gone = wq.gone_workers(s, in_use)
            live = self._live(s, now)
            draining = wq.active_models_on(s, wq.draining_workers(s))
            # Models a draining worker let go of before it stopped were checkpointed
            # and wait to be restored elsewhere: moved, not lost.
            with p.lock:
                leaving = [m for m, w in p.placed.items() if w in gone]
            moved = wq.unloaded_models(s, leaving)
            stopped = wq.stopped_cleanly(s, gone)
            s.commit()
        for worker_id in declared:
            log.warning(
                "worker %s declared dead (no heartbeat for %g s)", worker_id, self.worker_timeout_s
            )
        if lost_models:
            log.warning("models lost with their workers: %s", ", ".join(lost_models))
        with p.lock:
            p.live = live
            p.draining = draining
            for model_id, worker_id in list(p.placed.items()):
                if worker_id in gone:
                    del p.placed[model_id]
                    if model_id not in moved:
                        p.lost[model_id] = worker_id
                    p.status.pop(model_id, None)

        def why(call: Pending) -> UnavailableError:
            how = (
                "stopped"
                if call.worker_id in stopped
                else f"stopped answering (no heartbeat for {self.worker_timeout_s:g} s)"
            )
            kept = (
                f"; model {call.model_id} stays at its last applied step" if call.model_id else ""
            )
            return UnavailableError(f"worker {call.worker_id} {how}{kept}")

        self.transport.fail_gone(gone, why)

    def read_live(self) -> None:
        """Only the live-worker list, read now: for an answer that must not go by a
        list up to ``check_s`` old (a sampler worker that registered since the last
        pass; ``CeleryDispatcher.check_placement``). The next pass reads it again."""
        with self.sessions() as s:
            live = self._live(s, dt.datetime.now(dt.timezone.utc))
        with self.placement.lock:
            self.placement.live = live

    def _live(self, s: Session, now: dt.datetime) -> list[LiveWorker]:
        fresh_after = now - dt.timedelta(seconds=self.worker_timeout_s)
        return [
            LiveWorker(w.id, tuple(wq.base_models_of(w)), w.role)
            for w in wq.live_workers(s, fresh_after)
        ]

    def _watch(self) -> None:
        while not self._stopping.wait(self.check_s):
            try:
                self.refresh()
            except Exception:
                log.exception("worker liveness check failed")
