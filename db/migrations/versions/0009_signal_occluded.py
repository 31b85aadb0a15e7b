"""Signal studies (issue 30): where a run's occlusion windows slid, ``signal_correlations.occluded``:
``context`` (the context before the answer, prompt included: every run before this one) or ``trace``
(the answer's trace only, each window scored on the trace tokens after it, as the EpiKV authors do).

Rows written before it are ``context``: that was the only setting.

Revision ID: 0009
Revises: 0008
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("signal_correlations", schema=None) as batch_op:
        batch_op.add_column(sa.Column("occluded", sa.String(length=16), nullable=False, server_default="context"))


def downgrade() -> None:
    with op.batch_alter_table("signal_correlations", schema=None) as batch_op:
        batch_op.drop_column("occluded")
