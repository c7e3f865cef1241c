"""Issue 13, class 3 (sybils steer reputation through feedback): feedback counts only
for bundles the reporter was served, each bundle at most once per reporter.

* ``nodes.relay_served_seq``: the highest relay sequence served to the node
  (``PullBundles``), written in batches with the last-seen times; 0 for existing nodes,
  so their next pull sets it.
* ``feedback_bundles (reporter_node_id, bundle_id)``: the bundles a reporter's weighted
  feedback has counted, written in the same transaction as that feedback's evidence.

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
    op.add_column(
        "nodes",
        sa.Column("relay_served_seq", sa.BigInteger(), nullable=False, server_default="0"),
    )
    op.create_table(
        "feedback_bundles",
        sa.Column("reporter_node_id", sa.String(64), primary_key=True),
        sa.Column("bundle_id", sa.String(64), primary_key=True),
        sa.Column("at_ms", sa.BigInteger(), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("feedback_bundles")
    with op.batch_alter_table("nodes") as batch:
        batch.drop_column("relay_served_seq")
