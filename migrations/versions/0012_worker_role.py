"""A worker has a role: ``both`` (trains and samples, the default), ``trainer``
or ``sampler`` (a pool worker: serves samplers only; ``treadle worker --role``).

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-04
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0012"
down_revision: str | Sequence[str] | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("workers") as batch:
        batch.add_column(
            sa.Column("role", sa.String(16), nullable=False, server_default=sa.text("'both'"))
        )
        batch.create_check_constraint(
            op.f("ck_workers_role"), "role IN ('both', 'trainer', 'sampler')"
        )


def downgrade() -> None:
    with op.batch_alter_table("workers") as batch:
        batch.drop_constraint(op.f("ck_workers_role"), type_="check")
        batch.drop_column("role")
