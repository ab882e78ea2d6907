"""Initial schema: tenants, api keys, models, checkpoints, weight versions, samplers, ops.

Revision ID: 0001
Revises:
Create Date: 2026-11-29

models.last_checkpoint_id -> checkpoints and checkpoints.model_id -> models form
a cycle, so that one foreign key is added after both tables exist (and dropped
before them). Batch mode makes the same code run on SQLite, which rebuilds the
table instead of altering it.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | Sequence[str] | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "tenants",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("name", sa.String(length=255), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_tenants")),
        sa.UniqueConstraint("name", name=op.f("uq_tenants_name")),
    )
    op.create_table(
        "api_keys",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("tenant_id", sa.String(length=64), nullable=False),
        sa.Column("key_hash", sa.String(length=64), nullable=False),
        sa.Column("prefix", sa.String(length=16), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name=op.f("fk_api_keys_tenant_id_tenants")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_api_keys")),
        sa.UniqueConstraint("key_hash", name=op.f("uq_api_keys_key_hash")),
    )
    op.create_index(op.f("ix_api_keys_tenant_id"), "api_keys", ["tenant_id"], unique=False)
    op.create_table(
        "models",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("tenant_id", sa.String(length=64), nullable=False),
        sa.Column("base_model", sa.Text(), nullable=False),
        sa.Column("lora_rank", sa.Integer(), nullable=False),
        sa.Column("lora_alpha", sa.Double(), nullable=False),
        sa.Column("seed", sa.Integer(), nullable=False),
        sa.Column("dtype", sa.String(length=16), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("version", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column("last_checkpoint_id", sa.String(length=64), nullable=True),
        sa.Column(
            "last_checkpoint_seq_id", sa.Integer(), server_default=sa.text("0"), nullable=False
        ),
        sa.Column("worker_id", sa.String(length=255), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.CheckConstraint(
            "status IN ('active', 'deleted', 'lost', 'unloaded')", name=op.f("ck_models_status")
        ),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name=op.f("fk_models_tenant_id_tenants")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_models")),
    )
    op.create_index(op.f("ix_models_tenant_id"), "models", ["tenant_id"], unique=False)
    op.create_table(
        "checkpoints",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("tenant_id", sa.String(length=64), nullable=False),
        sa.Column("model_id", sa.String(length=64), nullable=False),
        sa.Column("name", sa.String(length=255), nullable=False),
        sa.Column("uri", sa.String(length=1024), nullable=False),
        sa.Column("storage_path", sa.Text(), nullable=False),
        sa.Column("seq_id", sa.Integer(), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("size_bytes", sa.BigInteger(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.CheckConstraint("kind IN ('state', 'auto')", name=op.f("ck_checkpoints_kind")),
        sa.ForeignKeyConstraint(
            ["model_id"], ["models.id"], name=op.f("fk_checkpoints_model_id_models")
        ),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name=op.f("fk_checkpoints_tenant_id_tenants")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_checkpoints")),
        sa.UniqueConstraint("model_id", "name", name=op.f("uq_checkpoints_model_id_name")),
        sa.UniqueConstraint("uri", name=op.f("uq_checkpoints_uri")),
    )
    with op.batch_alter_table("models") as batch:
        batch.create_foreign_key(
            op.f("fk_models_last_checkpoint_id_checkpoints"),
            "checkpoints",
            ["last_checkpoint_id"],
            ["id"],
        )
    op.create_table(
        "weight_versions",
        sa.Column("model_id", sa.String(length=64), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("uri", sa.String(length=1024), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("released", sa.Boolean(), server_default=sa.false(), nullable=False),
        sa.ForeignKeyConstraint(
            ["model_id"], ["models.id"], name=op.f("fk_weight_versions_model_id_models")
        ),
        sa.PrimaryKeyConstraint("model_id", "version", name=op.f("pk_weight_versions")),
    )
    op.create_table(
        "samplers",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("tenant_id", sa.String(length=64), nullable=False),
        sa.Column("model_id", sa.String(length=64), nullable=True),
        sa.Column("base_model", sa.Text(), nullable=False),
        sa.Column("mode", sa.String(length=16), nullable=False),
        sa.Column("pinned_version", sa.Integer(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.CheckConstraint("mode IN ('base', 'version', 'latest')", name=op.f("ck_samplers_mode")),
        sa.ForeignKeyConstraint(
            ["model_id"], ["models.id"], name=op.f("fk_samplers_model_id_models")
        ),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name=op.f("fk_samplers_tenant_id_tenants")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_samplers")),
    )
    op.create_index(op.f("ix_samplers_model_id"), "samplers", ["model_id"], unique=False)
    op.create_table(
        "ops",
        sa.Column("model_id", sa.String(length=64), nullable=False),
        sa.Column("seq_id", sa.Integer(), nullable=False),
        sa.Column("kind", sa.String(length=64), nullable=False),
        sa.Column("payload_digest", sa.String(length=128), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("error_code", sa.String(length=64), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.CheckConstraint("status IN ('pending', 'done', 'failed')", name=op.f("ck_ops_status")),
        sa.ForeignKeyConstraint(["model_id"], ["models.id"], name=op.f("fk_ops_model_id_models")),
        sa.PrimaryKeyConstraint("model_id", "seq_id", name=op.f("pk_ops")),
    )


def downgrade() -> None:
    op.drop_table("ops")
    op.drop_index(op.f("ix_samplers_model_id"), table_name="samplers")
    op.drop_table("samplers")
    op.drop_table("weight_versions")
    with op.batch_alter_table("models") as batch:
        batch.drop_constraint(op.f("fk_models_last_checkpoint_id_checkpoints"), type_="foreignkey")
    op.drop_table("checkpoints")
    op.drop_index(op.f("ix_models_tenant_id"), table_name="models")
    op.drop_table("models")
    op.drop_index(op.f("ix_api_keys_tenant_id"), table_name="api_keys")
    op.drop_table("api_keys")
    op.drop_table("tenants")
