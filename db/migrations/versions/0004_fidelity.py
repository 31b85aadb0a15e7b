"""Teacher-forced fidelity results (issue 16): what a row measures, and its per-sample fidelity means.

Existing rows are generations (the server default).

Revision ID: 0004
Revises: 0003
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("sample_results", schema=None) as batch_op:
        batch_op.add_column(sa.Column("measure", sa.String(length=16), server_default="generation", nullable=False))
        batch_op.add_column(sa.Column("kl_mean", sa.Float(), nullable=True))
        batch_op.add_column(sa.Column("delta_nll_mean", sa.Float(), nullable=True))
        batch_op.add_column(sa.Column("top1_agreement", sa.Float(), nullable=True))
        batch_op.add_column(sa.Column("scored_tokens", sa.Integer(), nullable=True))
        batch_op.create_index("ix_sample_results_measure", ["measure"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("sample_results", schema=None) as batch_op:
        batch_op.drop_index("ix_sample_results_measure")
        batch_op.drop_column("scored_tokens")
        batch_op.drop_column("top1_agreement")
        batch_op.drop_column("delta_nll_mean")
        batch_op.drop_column("kl_mean")
        batch_op.drop_column("measure")
