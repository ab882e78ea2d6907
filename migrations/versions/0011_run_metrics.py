"""A run's curves: the metrics each applied training call returned
(``step_metrics``, keyed by the call's seq_id) and those its client logged for a
step (``logged_metrics``, ``TrainingClient.log_metrics``). The console draws them.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-04
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0011"
down_revision: str | Sequence[str] | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "step_metrics",
        sa.Column("model_id", sa.String(length=64), nullable=False),
        sa.Column("seq_id", sa.BigInteger(), nullable=False),
        sa.Column("name", sa.String(length=128), nullable=False),
        sa.Column("kind", sa.String(length=32), nullable=False),
        sa.Column("step", sa.BigInteger(), nullable=True),
        sa.Column("value", sa.Double(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("model_id", "seq_id", "name", name=op.f("pk_step_metrics")),
    )
    op.create_table(
        "logged_metrics",
        sa.Column("model_id", sa.String(length=64), nullable=False),
        sa.Column("step", sa.BigInteger(), nullable=False),
        sa.Column("name", sa.String(length=128), nullable=False),
        sa.Column("value", sa.Double(), nullable=False),
        sa.Column("logged_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("model_id", "step", "name", name=op.f("pk_logged_metrics")),
    )


def downgrade() -> None:
    op.drop_table("logged_metrics")
    op.drop_table("step_metrics")
