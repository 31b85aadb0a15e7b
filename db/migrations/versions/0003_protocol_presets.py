"""Protocol preset fields (issue 14): the recent-window cap and what a prompt longer than B does.

Revision ID: 0003
Revises: 0002
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("protocols", schema=None) as batch_op:
        batch_op.add_column(sa.Column("recent_max_fraction", sa.Float(), nullable=True))
        batch_op.add_column(sa.Column("prompt_over_budget", sa.String(length=16), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("protocols", schema=None) as batch_op:
        batch_op.drop_column("prompt_over_budget")
        batch_op.drop_column("recent_max_fraction")
