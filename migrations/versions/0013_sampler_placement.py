"""A sampler may choose where it samples at creation: ``colocated``, ``pool`` or
``auto`` (NULL: the server's ``--sampler-placement``).

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-04
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0013"
down_revision: str | Sequence[str] | None = "0012"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("samplers") as batch:
        batch.add_column(sa.Column("placement", sa.String(16), nullable=True))
        batch.create_check_constraint(
            op.f("ck_samplers_placement"), "placement IN ('colocated', 'pool', 'auto')"
        )


def downgrade() -> None:
    with op.batch_alter_table("samplers") as batch:
        batch.drop_constraint(op.f("ck_samplers_placement"), type_="check")
        batch.drop_column("placement")
