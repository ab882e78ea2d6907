"""Models record which modules a LoRA adapter trains (the tinker SDK's
``train_attn`` / ``train_mlp`` / ``train_unembed``).

Models created before this adapted every projection and not the output head:
existing rows get ``train_unembed = false``; new rows are written explicitly.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-02
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | Sequence[str] | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_COLUMNS = (("train_attn", sa.true()), ("train_mlp", sa.true()), ("train_unembed", sa.false()))


def upgrade() -> None:
    with op.batch_alter_table("models") as batch:
        for name, default in _COLUMNS:
            batch.add_column(sa.Column(name, sa.Boolean(), nullable=False, server_default=default))


def downgrade() -> None:
    with op.batch_alter_table("models") as batch:
        for name, _ in reversed(_COLUMNS):
            batch.drop_column(name)
