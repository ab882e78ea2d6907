"""Usage accounting per tenant and model, and per-tenant quota overrides.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-29

``usage`` holds running totals (tokens sampled, trained, scored; calls; compute
seconds) keyed by tenant, model ("" for sampling a bare base model) and base
model. The quota columns on ``tenants`` are nullable: NULL = the server's default.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | Sequence[str] | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "usage",
        sa.Column("tenant_id", sa.String(length=64), nullable=False),
        sa.Column("model_id", sa.String(length=64), nullable=False),
        sa.Column("base_model", sa.String(length=255), nullable=False),
        sa.Column("tokens_sampled", sa.BigInteger(), server_default=sa.text("0"), nullable=False),
        sa.Column("tokens_trained", sa.BigInteger(), server_default=sa.text("0"), nullable=False),
        sa.Column("tokens_scored", sa.BigInteger(), server_default=sa.text("0"), nullable=False),
        sa.Column("calls", sa.BigInteger(), server_default=sa.text("0"), nullable=False),
        sa.Column("compute_s", sa.Double(), server_default=sa.text("0"), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name=op.f("fk_usage_tenant_id_tenants")
        ),
        sa.PrimaryKeyConstraint("tenant_id", "model_id", "base_model", name=op.f("pk_usage")),
    )
    with op.batch_alter_table("tenants") as batch:
        batch.add_column(sa.Column("max_models", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("max_calls_in_flight", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("max_tokens_per_request", sa.BigInteger(), nullable=True))
        batch.add_column(sa.Column("tokens_per_minute", sa.BigInteger(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("tenants") as batch:
        batch.drop_column("tokens_per_minute")
        batch.drop_column("max_tokens_per_request")
        batch.drop_column("max_calls_in_flight")
        batch.drop_column("max_models")
    op.drop_table("usage")
