"""A tenant's checkpoints: ``treadle://<model_id>/state/<name>`` paths resolved to
the store, recorded after a save, listed and deleted.

Another tenant's path answers NOT_FOUND, exactly like a path that does not exist.
"""

from __future__ import annotations

from sqlalchemy.orm import Session

from treadle.common.db import models as db
from treadle.common.store import parse_state_uri, state_uri, storage_path_str
from treadle.errors import FailedPreconditionError, NotFoundError
from treadle.server.context import ServerContext
from treadle.server.db import queries
from treadle.server.service.types import CheckpointInfo


class CheckpointService:
    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx

    def resolve(self, s: Session, tenant: str, uri: str, field: str) -> str:
        """The storage path (a directory, or s3://...) of the tenant's checkpoint;
        ``field`` names the request field in errors."""
        parse_state_uri(uri, field)
        row = queries.get_checkpoint_by_uri(s, tenant, uri)
        if row is None:
            raise NotFoundError(f"{field}: checkpoint {uri!r} not found")
        return storage_path_str(row.storage_path)

    def record(
        self,
        s: Session,
        tenant: str,
        model_id: str,
        name: str,
        directory: str,
        seq_id: int,
        step: int,
        kind: str,
        size: int,
    ) -> db.Checkpoint:
        """The DB row of a checkpoint just written (``queries.put_checkpoint``)."""
        return queries.put_checkpoint(
            s,
            tenant_id=tenant,
            model_id=model_id,
            name=name,
            uri=state_uri(model_id, name),
            storage_path=directory,
            seq_id=seq_id,
            step=step,
            kind=kind,
            size_bytes=size,
        )

    def list(self, tenant: str, model_id: str) -> list[CheckpointInfo]:
        """The model's checkpoints, oldest first."""
        with self.ctx.session() as s:
            self.ctx.model_row(s, tenant, model_id)
            return [
                CheckpointInfo(
                    path=c.uri,
                    name=c.name,
                    seq_id=c.seq_id,
                    step=c.step,
                    created_at=c.created_at.timestamp(),
                    size_bytes=c.size_bytes,
                )
                for c in queries.list_checkpoints(s, tenant, model_id)
            ]

    def delete(self, tenant: str, path: str) -> None:
        """Delete a checkpoint; the model it belongs to comes back after a restart
        at its newest remaining one. FAILED_PRECONDITION for the checkpoint an
        unloaded model is kept in."""
        parse_state_uri(path, "path")
        with self.ctx.session() as s:
            row = queries.get_checkpoint_by_uri(s, tenant, path)
            if row is None:
                raise NotFoundError(f"path: checkpoint {path!r} not found")
            model = s.get(db.Model, row.model_id)
            if model is not None and model.last_checkpoint_id == row.id:
                if model.status == "unloaded":
                    raise FailedPreconditionError(
                        f"path: {path!r} is what brings unloaded model {model.id} "
                        "back; restore the model first (any call on it does), or delete the model"
                    )
                # A restart brings the model back at its newest remaining checkpoint.
                newer = [c for c in queries.list_checkpoints(s, tenant, model.id) if c.id != row.id]
                model.last_checkpoint = newer[-1] if newer else None
                model.last_checkpoint_seq_id = newer[-1].seq_id if newer else 0
                s.flush()
            storage_path = row.storage_path
            s.delete(row)
        self.ctx.store.delete(storage_path)
