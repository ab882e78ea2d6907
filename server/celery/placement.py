"""Where each model of a distributed server lives.

A new model goes to the least loaded live worker that serves its base model and
has room (fewest active models; ties broken at random), and ``models.worker_id``
records it. Every later call of that model goes to that worker; a sampler of a
base model sticks to one live worker (its ``seq_id`` de-duplication holds there).

The state here (placement, models lost with their worker, the last status each
worker reported, the live and draining workers) is read by the dispatcher,
written by it, by the transport's replies and by the liveness pass, under one lock.
"""

from __future__ import annotations

import datetime as dt
import random
import threading
import zlib
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass

from sqlalchemy.orm import Session, sessionmaker

from treadle.common.db import models as db
from treadle.common.db import workers as wq
from treadle.common.engine.domain import ModelStatus, SamplerTarget
from treadle.errors import (
    AbortedError,
    NotFoundError,
    ResourceExhaustedError,
    TreadleError,
    UnavailableError,
)


@dataclass(frozen=True)
class LiveWorker:
    worker_id: str
    base_models: tuple[str, ...]
    role: str = "both"  # ``treadle worker --role``: both, trainer or sampler


class Placement:
    def __init__(
        self,
        sessions: sessionmaker[Session],
        worker_timeout_s: float,
        is_gone: Callable[[str], bool],
    ) -> None:
        self.sessions = sessions
        self.worker_timeout_s = worker_timeout_s
        self._is_gone = is_gone
        self.lock = threading.Lock()
        self.placed: dict[str, str] = {}  # model_id -> worker_id
        self.lost: dict[str, str] = {}  # model_id -> the worker it was lost with
        self.status: dict[str, ModelStatus] = {}
        self.replaying: set[str] = set()  # models being replayed (their status is kept)
        self.live: list[LiveWorker] = []
        self.draining: set[str] = set()  # model ids on workers stopping gracefully
        self._placing: Counter[str] = Counter()  # creations in flight, per worker

    def is_gone(self, worker_id: str) -> bool:
        """Whether the transport knows ``worker_id`` gone (declared dead or stopped)."""
        return self._is_gone(worker_id)

    # ---- placing a model ---------------------------------------------------------------------

    async def place(
        self,
        base_model: str,
        candidates: Iterable[str],
        create: Callable[[str], Awaitable[ModelStatus]],
        *,
        none_left: TreadleError | None = None,
    ) -> tuple[str, ModelStatus]:
        """Create a model on the first candidate worker that has room (``create``:
        the call that does it there); a worker full since it was counted answers
        RESOURCE_EXHAUSTED and the next is tried. Raises the last such error, or
        ``none_left`` / UNAVAILABLE when there was no candidate."""
        last: TreadleError | None = None
        for worker_id in candidates:
            with self.lock:  # counted by candidates() until the DB row says where it went
                self._placing[worker_id] += 1
            try:
                return worker_id, await create(worker_id)
            except ResourceExhaustedError as err:  # full since we counted: try the next
                last = err
            finally:
                with self.lock:
                    self._placing[worker_id] -= 1
        raise (
            last
            or none_left
            or UnavailableError(f"no live worker serves base model {base_model!r}")
        )

    def settle(self, model_id: str, worker_id: str, status: ModelStatus) -> None:
        """Record that ``model_id`` lives on ``worker_id`` now, in the DB and here."""
        with self.sessions() as s:
            wq.place_model(s, model_id, worker_id)
            s.commit()
        with self.lock:
            self.placed[model_id] = worker_id
            self.lost.pop(model_id, None)
            self.status[model_id] = status

    def candidates(self, base_model: str, exclude: Iterable[str] = ()) -> list[str]:
        """Live workers serving ``base_model`` with room, least loaded first."""
        skip = set(exclude)
        with self.sessions() as s:
            live = wq.live_workers(s, _utcnow() - dt.timedelta(seconds=self.worker_timeout_s))
            loads = wq.worker_loads(s)
            rows = [
                (loads.get(w.id, 0), random.random(), w.id)
                for w in live
                if base_model in wq.base_models_of(w)
                and w.role != "sampler"  # a pool worker takes no training model
                and loads.get(w.id, 0) < w.capacity
                and w.id not in skip
            ]
        with self.lock:
            # Creations in flight count too: concurrent creates would otherwise all
            # read the same loads and pile onto one worker.
            rows = [(n + self._placing[w], r, w) for n, r, w in rows]
        rows = [row for row in rows if not self._is_gone(row[2])]
        if not rows:
            raise UnavailableError(
                f"no live worker serves base model {base_model!r} with room for another model "
                f"(start one: treadle worker --model {base_model}=DIR --broker ...)"
            )
        return [w for _, _, w in sorted(rows)]

    def adoptable(self, model_id: str) -> str | None:
        """A model whose live worker still hosts it (a restarted server adopts it)."""
        with self.sessions() as s:
            row = s.get(db.Model, model_id)
            if row is None or row.status != "active" or not row.worker_id:
                return None
            if wq.gone_workers(s, [row.worker_id]):
                return None
            return row.worker_id

    def dead_for(self, model_id: str) -> set[str]:
        """The workers a model was on before it was lost: never placed there again."""
        with self.lock:
            return {w for w in (self.lost.get(model_id), self.placed.get(model_id)) if w}

    # ---- routing ----------------------------------------------------------------------------------

    def worker_of(self, model_id: str) -> str:
        with self.lock:
            worker_id = self.placed.get(model_id)
            lost_with = self.lost.get(model_id) or worker_id
        if worker_id is not None and not self._is_gone(worker_id):
            return worker_id
        with self.sessions() as s:
            row = s.get(db.Model, model_id)
            if row is None or row.status == "deleted":
                raise NotFoundError(f"model {model_id} not found")
            if (
                lost_with is None
                and row.status == "active"
                and row.worker_id
                and row.worker_id not in wq.gone_workers(s, [row.worker_id])
            ):
                with self.lock:
                    self.placed[model_id] = row.worker_id
                return row.worker_id
            ckpt = row.last_checkpoint
            hint = f" (its last checkpoint: {ckpt.uri})" if ckpt is not None else ""
            raise AbortedError(
                f"model {model_id} was lost with its worker {lost_with or row.worker_id} "
                f"(no heartbeat for {self.worker_timeout_s:g} s); it stays at step {row.version}. "
                f"Restore it from a checkpoint with load_state{hint}, or create a new model from one"
            )

    def worker_for_target(self, target: SamplerTarget, sampler_id: str | None) -> str:
        if target.model_id is not None:
            return self.worker_of(target.model_id)
        with self.lock:
            serving = [w for w in self.live if target.base_model in w.base_models]
        # colocated samplers of a base stay off the pool while a worker of another role serves it
        live = [w.worker_id for w in serving if w.role != "sampler"] or [
            w.worker_id for w in serving
        ]
        live = [w for w in live if not self._is_gone(w)]
        if not live:
            raise UnavailableError(f"no live worker serves base model {target.base_model!r}")
        if sampler_id is None:
            return random.choice(live)
        # one sampler sticks to one worker, so its seq_id de-duplication holds
        return live[zlib.crc32(sampler_id.encode()) % len(live)]

    # ---- status -------------------------------------------------------------------------------------

    def model_status(self, model_id: str) -> ModelStatus:
        with self.lock:
            status = self.status.get(model_id)
        if status is None:
            raise NotFoundError(f"model {model_id} not found")
        return status

    def note_status(self, status: ModelStatus) -> None:
        """A worker's answer: the status of a model placed here (or being replayed)."""
        with self.lock:
            if status.model_id in self.placed or status.model_id in self.replaying:
                self.status[status.model_id] = status

    def forget(self, model_id: str) -> str | None:
        """The model left its worker (deleted, unloaded); the worker it was on."""
        with self.lock:
            worker_id = self.placed.pop(model_id, None)
            self.lost.pop(model_id, None)
            self.status.pop(model_id, None)
        return worker_id


def _utcnow() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)
