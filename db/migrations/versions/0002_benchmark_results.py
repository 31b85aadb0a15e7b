"""Systems benchmark figures (``kvleague bench --store``): one row per figure of a benchmark run.

Revision ID: 0002
Revises: 0001
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "benchmark_results",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("row_key", sa.String(length=64), nullable=False),
        sa.Column("run_id", sa.String(length=64), nullable=False),
        sa.Column("benchmark", sa.String(length=64), nullable=False),
        sa.Column("environment_id", sa.Integer(), nullable=True),
        sa.Column("model", sa.Text(), nullable=False),
        sa.Column("method", sa.String(length=255), nullable=True),
        sa.Column("budget", sa.Integer(), nullable=True),
        sa.Column("metric", sa.String(length=64), nullable=False),
        sa.Column("value", sa.Float(), nullable=True),
        sa.Column("unit", sa.String(length=32), nullable=False),
        sa.Column("reference", sa.String(length=255), nullable=True),
        sa.Column("details", sa.JSON(), nullable=True),
        sa.Column("config", sa.JSON(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["environment_id"], ["environments.id"], name=op.f("fk_benchmark_results_environment_id_environments")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_benchmark_results")),
        sa.UniqueConstraint("row_key", name=op.f("uq_benchmark_results_row_key")),
    )
    with op.batch_alter_table("benchmark_results", schema=None) as batch_op:
        batch_op.create_index("ix_benchmark_results_benchmark_metric", ["benchmark", "metric"], unique=False)
        batch_op.create_index(batch_op.f("ix_benchmark_results_run_id"), ["run_id"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("benchmark_results", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_benchmark_results_run_id"))
        batch_op.drop_index("ix_benchmark_results_benchmark_metric")

    op.drop_table("benchmark_results")
