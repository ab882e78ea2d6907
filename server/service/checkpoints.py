"""A tenant's checkpoints: ``treadle://<model_id>/state/<name>`` paths resolved to
the store, recorded after a save, listed, deleted, given a lifetime, published,
copied.

Another tenant's path answers NOT_FOUND, exactly like a path that does not exist,
unless its owner published it: a public checkpoint is readable by any tenant
(load it, create a model from it, copy it) and writable by its owner only
(delete, TTL, publish, unpublish).
"""

from __future__ import annotations

import builtins
import datetime as dt
import logging

from sqlalchemy.orm import Session

from treadle.common.db import models as db
from treadle.common.store import copy_checkpoint, parse_state_uri, state_uri, storage_path_str
from treadle.errors import FailedPreconditionError, InvalidArgumentError, NotFoundError
from treadle.server.context import ServerContext
from treadle.server.db import queries, tenancy
from treadle.server.service.types import CheckpointRecord

log = logging.getLogger("treadle.server")

#: tinker's bounds on a checkpoint's lifetime: one hour to ten years
MIN_TTL_S, MAX_TTL_S = 3600, 10 * 365 * 24 * 3600


def _info(c: db.Checkpoint) -> CheckpointRecord:
    return CheckpointRecord(
        path=c.uri,
        name=c.name,
        seq_id=c.seq_id,
        step=c.step,
        created_at=c.created_at.timestamp(),
        size_bytes=c.size_bytes,
        model_id=c.model_id,
        public=c.public,
        expires_at=c.expires_at.timestamp() if c.expires_at is not None else None,
    )


class CheckpointService:
    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx

    def resolve(self, s: Session, tenant: str, uri: str, field: str) -> str:
        """The storage path (a directory, or s3://...) of the tenant's checkpoint;
        ``field`` names the request field in errors."""
        return storage_path_str(self.readable(s, tenant, uri, field).storage_path)

    def readable(self, s: Session, tenant: str, uri: str, field: str) -> db.Checkpoint:
        """The tenant's checkpoint at ``uri``, or another tenant's published one."""
        parse_state_uri(uri, field)
        row = queries.get_checkpoint_by_uri(s, tenant, uri) or queries.get_public_checkpoint(s, uri)
        if row is None:
            raise NotFoundError(f"{field}: checkpoint {uri!r} not found")
        return row

    def _owned(self, s: Session, tenant: str, uri: str, field: str = "path") -> db.Checkpoint:
        parse_state_uri(uri, field)
        row = queries.get_checkpoint_by_uri(s, tenant, uri)
        if row is None:
            raise NotFoundError(f"{field}: checkpoint {uri!r} not found")
        return row

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

    def list(self, tenant: str, model_id: str) -> list[CheckpointRecord]:
        """The model's checkpoints, oldest first."""
        with self.ctx.session() as s:
            self.ctx.model_row(s, tenant, model_id)
            return [_info(c) for c in queries.list_checkpoints(s, tenant, model_id)]

    def list_all(self, tenant: str) -> builtins.list[CheckpointRecord]:
        """Every checkpoint of the tenant, newest first."""
        with self.ctx.session() as s:
            return [_info(c) for c in queries.list_tenant_checkpoints(s, tenant)]

    def info(self, tenant: str, path: str) -> CheckpointRecord:
        """One checkpoint the tenant can read (its own or a published one)."""
        with self.ctx.session() as s:
            return _info(self.readable(s, tenant, path, "path"))

    def set_ttl(self, tenant: str, path: str, ttl_seconds: int | None) -> None:
        """Expire the checkpoint ``ttl_seconds`` from now (None: never); the lifecycle
        sweep deletes it then."""
        if ttl_seconds is not None and not MIN_TTL_S <= ttl_seconds <= MAX_TTL_S:
            raise InvalidArgumentError(
                f"ttl_seconds: must be between {MIN_TTL_S} (1 hour) and {MAX_TTL_S} "
                f"(10 years), or null for no expiry; got {ttl_seconds}"
            )
        with self.ctx.session() as s:
            expires_at = (
                None if ttl_seconds is None else db.utcnow() + dt.timedelta(seconds=ttl_seconds)
            )
            queries.set_checkpoint_expiry(s, self._owned(s, tenant, path), expires_at)

    def set_public(self, tenant: str, path: str, public: bool) -> None:
        """Publish (readable by every tenant through its path) or unpublish."""
        with self.ctx.session() as s:
            queries.set_checkpoint_public(s, self._owned(s, tenant, path), public)

    def usage(self, tenant: str) -> tuple[int, int]:
        """(number of checkpoints, stored bytes) of the tenant."""
        with self.ctx.session() as s:
            rows = queries.list_tenant_checkpoints(s, tenant)
            return len(rows), sum(c.size_bytes for c in rows)

    def copy(self, tenant: str, path: str, ttl_seconds: int | None = None) -> str:
        """Copy a readable checkpoint into a new model of the tenant; the copy's
        treadle:// path. The new model only holds the copy (as tinker's copies, it
        cannot be trained on): load the copy into a training client. Blocking I/O."""
        with self.ctx.session() as s:
            self.ctx.quotas.check_new_model(tenant, tenancy.count_live_models(s, tenant))
            src = self.readable(s, tenant, path, "source_path")
            source = s.get(db.Model, src.model_id)
            assert source is not None
            model = queries.create_model(
                s,
                tenant_id=tenant,
                base_model=source.base_model,
                lora_rank=source.lora_rank,
                lora_alpha=source.lora_alpha,
                seed=source.seed,
                dtype=source.dtype,
                modules=(source.train_attn, source.train_mlp, source.train_unembed),
            )
            model_id, src_path = model.id, storage_path_str(src.storage_path)
            name, step = src.name, src.step
        dst = self.ctx.store.state_path(tenant, model_id, name)
        size = copy_checkpoint(self.ctx.store, src_path, dst)
        with self.ctx.session() as s:
            row = self.record(s, tenant, model_id, name, dst, 0, step, "state", size)
            # with no last checkpoint: never loaded itself
            queries.set_model_status(s, model_id, "unloaded", version=step)
            uri = row.uri
        if ttl_seconds is not None:
            self.set_ttl(tenant, uri, ttl_seconds)
        return uri

    def expire(self, now: dt.datetime | None = None) -> builtins.list[str]:
        """Delete every checkpoint past its expiry (the lifecycle sweep calls this);
        the paths deleted. One an unloaded model is kept in waits for the model."""
        with self.ctx.session() as s:
            due = [(c.tenant_id, c.uri) for c in queries.expired_checkpoints(s, now or db.utcnow())]
        deleted = []
        for tenant, uri in due:
            try:
                self.delete(tenant, uri)
            except (FailedPreconditionError, NotFoundError) as err:
                log.info("expired checkpoint %s kept: %s", uri, err)
                continue
            deleted.append(uri)
        return deleted

    def delete(self, tenant: str, path: str) -> None:
        """Delete a checkpoint; the model it belongs to comes back after a restart
        at its newest remaining one. FAILED_PRECONDITION for the checkpoint an
        unloaded model is kept in."""
        with self.ctx.session() as s:
            row = self._owned(s, tenant, path)
            model = s.get(db.Model, row.model_id)
            if (
                model is not None
                and model.last_checkpoint_id == row.id
                and model.status == "unloaded"
            ):
                raise FailedPreconditionError(
                    f"path: {path!r} is what brings unloaded model {model.id} "
                    "back; restore the model first (any call on it does), or delete the model"
                )
            storage_path = row.storage_path
            queries.delete_checkpoint(s, row)
        self.ctx.store.delete(storage_path)
