"""What a restarted server tells a client whose seq_ids were numbered before.

A server that restarts brings each model back at its last checkpoint
(``restore_models``, or a model unloaded by the graceful stop on its first call).
The calls a client numbered after that checkpoint and had answered by the old
server are gone, so the model's next expected seq_id may lie below the client's
lowest pending call: a gap no call will ever fill. Waiting out the gap timeout
would tell the client nothing; this module tells it at once.

The SDK sends, with every ordered call, the server instance its numbering was
made against and its lowest pending seq_id of the model (``treadle.wire.metadata``).
When that instance is not this one, the model was restored from a checkpoint
by this instance, and the client's lowest pending call lies beyond the model's
next expected seq_id, the call fails with ``ServerRestartedError`` (ABORTED),
which names the model, the step and seq_id it is at, its checkpoint, and
``resync()``. When the client's pending calls start right where the model is
(a graceful stop checkpointed everything the client had answered), they just
go on.

A model whose engine state survived the server (on a live worker of a
distributed server) has no restore point, and is never checked.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from treadle.common.engine.domain import ModelStatus
from treadle.errors import ServerRestartedError
from treadle.wire.metadata import FIRST_PENDING_KEY, INSTANCE_KEY


@dataclass(frozen=True)
class ClientNumbering:
    """How the client numbered its calls: the server instance its seq_ids were
    made against and its lowest pending seq_id of the model. Empty when the
    client does not say (it is then never told of a restart)."""

    instance: str = ""
    first_pending: int | None = None


@dataclass(frozen=True)
class RestorePoint:
    """Where this server instance loaded a model back from a checkpoint."""

    seq_id: int  # the last call the checkpoint includes (0: the creation state)
    step: int
    checkpoint: str  # treadle://<model_id>/state/<name>, "" for the creation state


def check_numbering(
    instance: str,
    restored: dict[str, RestorePoint],
    metadata: Sequence[tuple[str, Any]] | None,
    model_id: str,
    seq_id: int,
    status: Callable[[], ModelStatus],
) -> None:
    """Raise ``ServerRestartedError`` when the call comes from a client that
    numbered it against an earlier server instance, and the model (restored from
    a checkpoint here) expects a seq_id below the client's lowest pending call:
    every call below that one was answered, so the ones the model still expects
    were answered by the old server and are lost."""
    check_client_numbering(instance, restored, client_numbering(metadata), model_id, seq_id, status)


def client_numbering(metadata: Sequence[tuple[str, Any]] | None) -> ClientNumbering:
    """What the SDK's metadata says of its numbering (an unreadable lowest
    pending seq_id reads as none: the call's own seq_id stands for it)."""
    md = {str(k): str(v) for k, v in (metadata or ())}
    try:
        first: int | None = int(md.get(FIRST_PENDING_KEY) or "")
    except ValueError:
        first = None
    return ClientNumbering(md.get(INSTANCE_KEY, ""), first)


def check_client_numbering(
    instance: str,
    restored: dict[str, RestorePoint],
    numbering: ClientNumbering,
    model_id: str,
    seq_id: int,
    status: Callable[[], ModelStatus],
) -> None:
    """``check_numbering`` for a transport that has read the client's numbering."""
    seen = numbering.instance
    point = restored.get(model_id)
    if not seen or seen == instance or point is None:
        return
    first = seq_id if numbering.first_pending is None else numbering.first_pending
    now = status()
    if first <= now.next_seq_id:
        return  # the client's own pending calls continue where the model is
    at = now.next_seq_id - 1
    source = f"checkpoint {point.checkpoint}" if point.checkpoint else "its creation state"
    raise ServerRestartedError(
        f"the server restarted: model {model_id} is back at step {now.version}, seq_id {at} "
        f"(from {source}), but this client numbered its pending calls from seq_id {first} on "
        f"(this call: {seq_id}); seq_ids {at + 1}..{first - 1} were answered by the server "
        "before the restart and are lost with it, so this call can never be applied in "
        f"order. Call TrainingClient.resync() to continue from seq_id {at + 1} (redoing the "
        "lost steps), or create the ServiceClient with auto_resync=True to have the SDK "
        "replay them",
        details={
            "model_id": model_id,
            "step": str(now.version),
            "seq_id": str(at),
            "checkpoint": point.checkpoint,
            "instance": instance,
        },
    )
