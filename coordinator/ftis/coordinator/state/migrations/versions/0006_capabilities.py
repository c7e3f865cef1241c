"""Client capabilities (issue 13; ``ftis.protocol.capabilities``).

* ``nodes.capabilities``: the known capabilities a node registered with, comma-separated;
  empty for every existing node (an older client) until it registers again.

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
    op.add_column("nodes", sa.Column("capabilities", sa.String(512), nullable=False,
                                     server_default=""))


def downgrade() -> None:
    with op.batch_alter_table("nodes") as batch:
        batch.drop_column("capabilities")
