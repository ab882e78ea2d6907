"""The replay log: the calls applied to each model since its last checkpoint, kept
in the database so that a model lost with its worker comes back at its last
applied step, not at its checkpoint.

Each ordered call the worker answered as applied (a result, or an error the
engine answers in the call's turn, which takes its seq_id too) has its payload
(the engine's op, ``treadle.common.engine.codec`` bytes) written on its row of the
``ops`` log. To recover, the distributed dispatcher restores the model's last
checkpoint (or its creation state) on a live worker and submits these calls
again with their own seq_ids, in order: on CPU, a step computes the same
numbers from the same state and data, so the weights and optimizer state end
bit-identical to the lost ones (``tests/integration/distributed/test_worker_kill.py``).

Cost: one payload per call, about the size of its request (a
``forward_backward`` keeps ~20 bytes per token: ids and targets int64, weights
float32; ~28 with the advantages and logprobs of the policy losses); an
``optim_step`` is under 200 bytes; a ``forward_logprobs`` changes nothing and is kept as a marker of
its seq_id (about 200 bytes), not recomputed. Bound: ``replay_log_bytes`` per model. A model past its bound has
its log dropped until its next checkpoint, and is lost as without the log. The
payloads up to a model's last checkpoint are released (set NULL) at its next
optimizer step or ``save_state`` after that checkpoint was recorded.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

from sqlalchemy import and_, func, select, update
from sqlalchemy.orm import Session, sessionmaker

from treadle.common.db import models as db
from treadle.common.engine import codec
from treadle.common.engine.domain import (
    ForwardLogprobsOp,
    OptimStepOp,
    OrderedOp,
    RejectedOp,
    SaveStateOp,
)
from treadle.errors import FailedPreconditionError
from treadle.server.db.ops_log import APPLIED_ERROR_CODES

log = logging.getLogger("treadle.server")

#: engine answers that took the call's seq_id (its turn came, the op was refused)
APPLIED_ERRORS = APPLIED_ERROR_CODES


@dataclass(frozen=True)
class Logged:
    seq_id: int
    op: OrderedOp
    digest: str


class ReplayLog:
    def __init__(self, sessions: sessionmaker[Session], max_bytes: int) -> None:
        self.sessions = sessions
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._bytes: dict[str, int] = {}  # model_id -> bytes kept (read from the DB once)
        self._over: set[str] = set()  # models past the bound, until their next checkpoint

    def record(self, model_id: str, seq_id: int, op: OrderedOp) -> None:
        """Keep the payload of a call the engine applied (in its turn)."""
        if self.max_bytes <= 0:
            return
        if isinstance(op, OptimStepOp | SaveStateOp):
            self.release(model_id)  # a checkpoint may have been recorded since
        with self._lock:
            if model_id in self._over:
                return
        if isinstance(op, ForwardLogprobsOp):
            # It changes nothing: replayed, it only has to take its seq_id (a repeat
            # of it on the recovered model answers this, its logprobs are not kept).
            op = RejectedOp(
                FailedPreconditionError(
                    f"seq_id {seq_id}: a forward_logprobs answered before model {model_id} "
                    "was recovered on another worker; its answer was not kept"
                )
            )
        payload = codec.encode(op)
        with self.sessions() as s:
            kept = self._kept(s, model_id)
            if kept + len(payload) > self.max_bytes:
                self._drop(s, model_id)
                s.commit()
                log.warning(
                    "model %s: its replay log is over %d bytes: dropped until its next "
                    "checkpoint (a lost worker brings it back at that checkpoint)",
                    model_id,
                    self.max_bytes,
                )
                return
            s.execute(
                update(db.Op)
                .where(db.Op.model_id == model_id, db.Op.seq_id == seq_id)
                .values(payload=payload)
            )
            s.commit()
        with self._lock:
            self._bytes[model_id] = kept + len(payload)

    def release(self, model_id: str) -> None:
        """Drop the payloads the model's last checkpoint includes."""
        with self.sessions() as s:
            ckpt = _checkpoint_seq(s, model_id)
            if ckpt is None:
                return
            result = s.execute(
                update(db.Op)
                .where(
                    db.Op.model_id == model_id,
                    db.Op.seq_id <= ckpt,
                    db.Op.payload.is_not(None),
                )
                .values(payload=None)
            )
            released = getattr(result, "rowcount", 0)
            with self._lock:
                over = model_id in self._over
            if not released and not over:
                return
            s.commit()
            kept = _payload_bytes(s, model_id)
        with self._lock:
            self._bytes[model_id] = kept
            self._over.discard(model_id)

    def forget(self, model_id: str) -> None:
        with self._lock:
            self._bytes.pop(model_id, None)
            self._over.discard(model_id)

    def calls_since(self, model_id: str, seq_id: int) -> list[Logged] | None:
        """The calls applied after ``seq_id``, in order, or None when the log does
        not hold every one of them (off, over its bound, or written by no one)."""
        with self._lock:
            if model_id in self._over:
                return None
        with self.sessions() as s:
            rows = s.execute(
                select(db.Op.seq_id, db.Op.status, db.Op.error_code, db.Op.payload_digest)
                .add_columns(db.Op.payload)
                .where(db.Op.model_id == model_id, db.Op.seq_id > seq_id)
                .order_by(db.Op.seq_id)
            ).all()
        applied = [
            r
            for r in rows
            if r.status == "done" or (r.status == "failed" and r.error_code in APPLIED_ERRORS)
        ]
        if not applied:
            return []
        last = applied[-1].seq_id
        kept = [r for r in rows if r.seq_id <= last]
        expected = list(range(seq_id + 1, last + 1))
        if [r.seq_id for r in kept] != expected or any(r.payload is None for r in kept):
            return None
        return [Logged(r.seq_id, codec.decode(r.payload), r.payload_digest) for r in kept]

    # ---- internals ---------------------------------------------------------------------

    def _kept(self, s: Session, model_id: str) -> int:
        with self._lock:
            kept = self._bytes.get(model_id)
        return _payload_bytes(s, model_id) if kept is None else kept

    def _drop(self, s: Session, model_id: str) -> None:
        s.execute(
            update(db.Op)
            .where(db.Op.model_id == model_id, db.Op.payload.is_not(None))
            .values(payload=None)
        )
        with self._lock:
            self._over.add(model_id)
            self._bytes[model_id] = 0


def _payload_bytes(s: Session, model_id: str) -> int:
    total = s.scalar(
        select(func.coalesce(func.sum(func.length(db.Op.payload)), 0)).where(
            db.Op.model_id == model_id
        )
    )
    return int(total or 0)


def _checkpoint_seq(s: Session, model_id: str) -> int | None:
    return s.scalar(
        select(db.Checkpoint.seq_id).join(
            db.Model,
            and_(db.Model.last_checkpoint_id == db.Checkpoint.id, db.Model.id == model_id),
        )
    )
