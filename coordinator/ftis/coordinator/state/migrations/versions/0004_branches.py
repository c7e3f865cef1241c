"""Issue 16, part 1, step 3 (MERIT branch training): branches in the coordinator's state.

* ``branches (name, families, tokens, defined_at_ms)``: named sub-mixes of the task mix
  (``ftis-admin branches plan PLAN.json --apply``).
* ``nodes.branch``: the branch a node is leased from; NULL (every existing node) is
  the whole mix, as before.
* ``leases.branch``: the branch a lease was issued under; NULL for every existing lease.
  Accepted bundles are counted per branch from it.

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
    op.create_table(
        "branches",
        sa.Column("name", sa.String(64), primary_key=True),
        sa.Column("families", sa.JSON(), nullable=False),
        sa.Column("tokens", sa.Float(), nullable=False),
        sa.Column("defined_at_ms", sa.BigInteger(), nullable=False),
    )
    op.add_column("nodes", sa.Column("branch", sa.String(64), nullable=True))
    op.add_column("leases", sa.Column("branch", sa.String(64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("leases") as batch:
        batch.drop_column("branch")
    with op.batch_alter_table("nodes") as batch:
        batch.drop_column("branch")
    op.drop_table("branches")
