"""Client sessions: a table of SDK sessions and heartbeats, and the session a model
was created in (its heartbeats keep the model loaded).

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-29
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | Sequence[str] | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "sessions",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("tenant_id", sa.String(length=64), nullable=False),
        sa.Column("client", sa.String(length=255), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("last_heartbeat_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("ended_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name=op.f("fk_sessions_tenant_id_tenants")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_sessions")),
    )
    op.create_index(op.f("ix_sessions_tenant_id"), "sessions", ["tenant_id"], unique=False)
    with op.batch_alter_table("models") as batch:
        batch.add_column(sa.Column("session_id", sa.String(length=64), nullable=True))
        batch.create_index(op.f("ix_models_session_id"), ["session_id"], unique=False)
        batch.create_foreign_key(
            op.f("fk_models_session_id_sessions"), "sessions", ["session_id"], ["id"]
        )


def downgrade() -> None:
    with op.batch_alter_table("models") as batch:
        batch.drop_constraint(op.f("fk_models_session_id_sessions"), type_="foreignkey")
        batch.drop_index(op.f("ix_models_session_id"))
        batch.drop_column("session_id")
    op.drop_index(op.f("ix_sessions_tenant_id"), table_name="sessions")
    op.drop_table("sessions")
