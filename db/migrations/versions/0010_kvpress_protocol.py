"""kvpress's evaluation protocol (issue 48): what a protocol compresses, and ratio budgets.

* ``protocols.scope``: ``context`` when only the context is compressed, once, and the question and
  generated tokens are added uncompressed over it (kvpress's pipeline); NULL: ``all``, as every
  protocol before it;
* ``protocols.query_aware``: with ``scope: context``, whether the question was compressed with the
  context (NULL: false);
* ``protocols.budget_base`` (from 0008) may now be ``ratio``: a budget B is a compression ratio of
  B / 1000 (the width of the column is unchanged).

Revision ID: 0010
Revises: 0009
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("protocols", schema=None) as batch_op:
        batch_op.add_column(sa.Column("scope", sa.String(length=16), nullable=True))
        batch_op.add_column(sa.Column("query_aware", sa.Boolean(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("protocols", schema=None) as batch_op:
        batch_op.drop_column("query_aware")
        batch_op.drop_column("scope")
