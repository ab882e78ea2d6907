"""Checkpoints gain an expiry (``expires_at``, deleted by the lifecycle sweep) and a
``public`` flag (readable by any tenant's key through its path); samplers record
the client session they were made in; ``tinker_names``
keeps the ids and sampler-weight names the tinker HTTP API gave out, so a server
restart still resolves them.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-02
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | Sequence[str] | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("checkpoints") as batch:
        batch.add_column(sa.Column("expires_at", sa.DateTime(timezone=True), nullable=True))
        batch.add_column(
            sa.Column("public", sa.Boolean(), server_default=sa.false(), nullable=False)
        )
    with op.batch_alter_table("samplers") as batch:
        batch.add_column(sa.Column("session_id", sa.String(length=64), nullable=True))
        batch.create_foreign_key(
            op.f("fk_samplers_session_id_sessions"), "sessions", ["session_id"], ["id"]
        )
    op.create_table(
        "tinker_names",
        sa.Column("tenant_id", sa.String(length=64), nullable=False),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("key", sa.String(length=512), nullable=False),
        sa.Column("model_id", sa.String(length=64), nullable=False),
        sa.Column("version", sa.Integer(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name=op.f("fk_tinker_names_tenant_id_tenants")
        ),
        sa.PrimaryKeyConstraint("tenant_id", "kind", "key", name=op.f("pk_tinker_names")),
    )


def downgrade() -> None:
    op.drop_table("tinker_names")
    with op.batch_alter_table("samplers") as batch:
        batch.drop_constraint(op.f("fk_samplers_session_id_sessions"), type_="foreignkey")
        batch.drop_column("session_id")
    with op.batch_alter_table("checkpoints") as batch:
        batch.drop_column("public")
        batch.drop_column("expires_at")
