"""Sessions keep what the client said about itself (a display name, its
user_metadata) and, when it finished the session itself, why: the tinker API's
session search filters on them.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-03
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | Sequence[str] | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("sessions") as batch:
        batch.add_column(sa.Column("display_name", sa.String(length=255), nullable=True))
        batch.add_column(sa.Column("user_metadata", sa.JSON(), nullable=True))
        batch.add_column(sa.Column("finish_reason", sa.String(length=16), nullable=True))
        batch.add_column(sa.Column("finish_detail", sa.Text(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("sessions") as batch:
        batch.drop_column("finish_detail")
        batch.drop_column("finish_reason")
        batch.drop_column("user_metadata")
        batch.drop_column("display_name")
