"""What this server serves: its base models and the limits a caller works within."""

from __future__ import annotations

import sys
from pathlib import Path

from treadle.errors import NotFoundError
from treadle.server.context import ServerContext
from treadle.server.db import tenancy
from treadle.server.service.types import BaseModelRecord, WorkerRecord

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


class InfoService:
    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx

    def base_models(self) -> list[BaseModelRecord]:
        """The served base models; ``max_context`` is the model's, or the
        sampler's sequence limit if that is lower."""
        d, config = self.ctx.catalog, self.ctx.config
        out = []
        for name in d.base_model_names():
            cfg = d.base_model_config(name)
            out.append(
                BaseModelRecord(
                    name=name,
                    arch=cfg.arch,
                    vocab_size=cfg.vocab_size,
                    max_context=min(cfg.max_position_embeddings, config.sampler_max_len),
                    num_params=cfg.num_params(),
                    dtype=config.default_dtype,
                )
            )
        return out

    def workers(self) -> list[WorkerRecord]:
        """The serving workers (none when the engine runs in this process), by id."""
        from sqlalchemy import select

        from treadle.common.db import models as db
        from treadle.common.db import workers as wq

        if self.ctx.dispatcher.engine_in_process:
            return []
        with self.ctx.session() as s:
            rows = s.scalars(
                select(db.Worker).where(db.Worker.status.in_(wq.SERVING)).order_by(db.Worker.id)
            )
            return [WorkerRecord(w.id, w.role, w.status, tuple(wq.base_models_of(w))) for w in rows]

    def max_tokens_per_request(self, tenant: str) -> int:
        """What one request of the tenant may hold: the engine's limit, or the
        tenant's quota if lower."""
        quota = self.ctx.quotas.limits(tenant).max_tokens_per_request
        return min(self.ctx.config.max_tokens_per_call, quota or sys.maxsize)

    def model_quota(self, tenant: str) -> tuple[int, int]:
        """The tenant's ``max_models`` quota (0 = none) and its models that count
        against it now."""
        with self.ctx.session() as s:
            live = tenancy.count_live_models(s, tenant)
        return self.ctx.quotas.limits(tenant).max_models, live

    def tokenizer_files(self, base_model: str) -> list[Path]:
        """The tokenizer files of a served base model, for tokenizing on the client."""
        base_model = self.ctx.base_model_name(base_model)
        if base_model not in self.ctx.catalog.base_model_names():
            raise NotFoundError(f"base_model {base_model!r} is not served here")
        directory = self.ctx.catalog.base_model_path(base_model)
        files = [directory / name for name in TOKENIZER_FILES if (directory / name).exists()]
        if not files:
            raise NotFoundError(f"base_model {base_model!r} has no tokenizer files")
        return files
