"""Audit-based probation (issue 13, class 1; docs/reputation.md "Audit-based probation").

* ``nodes.audit_status``: 0 pending (every existing node), 1 passed, -1 failed.
  Only read while the reputation policy's ``audit_reporters`` is above 0.
* ``audit_reports (sender_node_id, reporter_node_id, plausible, at_ms)``: the latest
  audit verdict of each established reporter on each sender on probation.

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
    op.add_column("nodes", sa.Column("audit_status", sa.Integer(), nullable=False,
                                     server_default="0"))
    op.create_table(
        "audit_reports",
        sa.Column("sender_node_id", sa.String(64), primary_key=True),
        sa.Column("reporter_node_id", sa.String(64), primary_key=True),
        sa.Column("plausible", sa.Boolean(), nullable=False),
        sa.Column("at_ms", sa.BigInteger(), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("audit_reports")
    with op.batch_alter_table("nodes") as batch:
        batch.drop_column("audit_status")
