"""The schema as the coordinator created it before migrations (frozen in ``schema_v1``).

Revision ID: 0001
Revises:
"""

from __future__ import annotations

from alembic import op

from ftis.coordinator.state.migrations import schema_v1

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    schema_v1.metadata.create_all(op.get_bind(), checkfirst=False)


def downgrade() -> None:
    schema_v1.metadata.drop_all(op.get_bind(), checkfirst=False)
