"""Ops keep the payload of each applied call since the model's last checkpoint,
so a model lost with its worker can be replayed to its last applied step on
another (``treadle.server.replay_log``). Released (set NULL) at the next checkpoint.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-02
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | Sequence[str] | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("ops") as batch:
        batch.add_column(sa.Column("payload", sa.LargeBinary(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("ops") as batch:
        batch.drop_column("payload")
