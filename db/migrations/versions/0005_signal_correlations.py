"""Signal studies (issue 21): Spearman's rho of per-token signals against occlusion importance labels.

Revision ID: 0005
Revises: 0004
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "signal_correlations",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("row_key", sa.String(length=64), nullable=False),
        sa.Column("run_id", sa.String(length=64), nullable=False),
        sa.Column("environment_id", sa.Integer(), nullable=True),
        sa.Column("model", sa.Text(), nullable=False),
        sa.Column("task", sa.String(length=255), nullable=False),
        sa.Column("domain", sa.String(length=32), nullable=False),
        sa.Column("label", sa.String(length=32), nullable=False),
        sa.Column("signal", sa.String(length=255), nullable=False),
        sa.Column("family", sa.String(length=64), nullable=False),
        sa.Column("layer", sa.Integer(), nullable=True),
        sa.Column("n_layers", sa.Integer(), nullable=False),
        sa.Column("rho", sa.Float(), nullable=True),
        sa.Column("rho_lo", sa.Float(), nullable=True),
        sa.Column("rho_hi", sa.Float(), nullable=True),
        sa.Column("p_value", sa.Float(), nullable=True),
        sa.Column("n_samples", sa.Integer(), nullable=False),
        sa.Column("n_pairs", sa.Integer(), nullable=False),
        sa.Column("config", sa.JSON(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["environment_id"], ["environments.id"]),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("row_key"),
    )
    op.create_index("ix_signal_correlations_run_id", "signal_correlations", ["run_id"], unique=False)
    op.create_index("ix_signal_correlations_task_label", "signal_correlations", ["task", "label"], unique=False)


def downgrade() -> None:
    op.drop_index("ix_signal_correlations_task_label", table_name="signal_correlations")
    op.drop_index("ix_signal_correlations_run_id", table_name="signal_correlations")
    op.drop_table("signal_correlations")
