"""The engine's share of a sample's method time (``GenerationResult.selection_seconds``: protection,
top-k and moving the cache entries), stored with the other per-sample metrics (issue 17).

Rows written before it have none (NULL).

Revision ID: 0006
Revises: 0005
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("sample_results", schema=None) as batch_op:
        batch_op.add_column(sa.Column("selection_seconds", sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("sample_results", schema=None) as batch_op:
        batch_op.drop_column("selection_seconds")
