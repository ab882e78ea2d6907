"""Workers may be ``draining``: stopping gracefully, while servers move their
models off to checkpoints (``treadle worker`` on SIGTERM).

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0005"
down_revision: str | Sequence[str] | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_OLD = "status IN ('live', 'stopped', 'dead')"
_NEW = "status IN ('live', 'draining', 'stopped', 'dead')"


def upgrade() -> None:
    with op.batch_alter_table("workers") as batch:
        batch.drop_constraint(op.f("ck_workers_status"), type_="check")
        batch.create_check_constraint(op.f("ck_workers_status"), _NEW)


def downgrade() -> None:
    # A draining worker is on its way out: the older schema calls it stopped.
    op.execute("UPDATE workers SET status = 'stopped' WHERE status = 'draining'")
    with op.batch_alter_table("workers") as batch:
        batch.drop_constraint(op.f("ck_workers_status"), type_="check")
        batch.create_check_constraint(op.f("ck_workers_status"), _OLD)
