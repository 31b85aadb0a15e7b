"""Signal studies (issue 21): each correlation's rank partial correlation with a control (the token's
position) held fixed, with its bootstrap interval.

Rows written before it have none (NULL).

Revision ID: 0007
Revises: 0006
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

COLUMNS = ("partial_rho", "partial_lo", "partial_hi", "partial_p_value")


def upgrade() -> None:
    with op.batch_alter_table("signal_correlations", schema=None) as batch_op:
        batch_op.add_column(sa.Column("control", sa.String(length=32), nullable=True))
        for name in COLUMNS:
            batch_op.add_column(sa.Column(name, sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("signal_correlations", schema=None) as batch_op:
        for name in ("control", *COLUMNS):
            batch_op.drop_column(name)
