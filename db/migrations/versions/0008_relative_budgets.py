"""The paper's regime (issue 30): budgets relative to the prompt and whether a method chose.

* ``protocols.budget_base``: ``prompt`` when a budget B is room on top of the prompt (NULL: absolute,
  as every protocol before it);
* ``sample_results.resolved_budget``: the cache budget the engine ran (prompt tokens + B under
  ``budget_base: prompt``; B otherwise);
* ``sample_results.ranked_evictions``: evictions in which the method's ranking decided what stayed
  (some candidate kept, some dropped), so a row where it never did is not read as the method's.

Rows written before it have NULL in each.

Revision ID: 0008
Revises: 0007
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("protocols", schema=None) as batch_op:
        batch_op.add_column(sa.Column("budget_base", sa.String(length=16), nullable=True))
    with op.batch_alter_table("sample_results", schema=None) as batch_op:
        batch_op.add_column(sa.Column("resolved_budget", sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column("ranked_evictions", sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("sample_results", schema=None) as batch_op:
        batch_op.drop_column("ranked_evictions")
        batch_op.drop_column("resolved_budget")
    with op.batch_alter_table("protocols", schema=None) as batch_op:
        batch_op.drop_column("budget_base")
