"""Issue 12 (coordinator at volunteer scale): a rejection counter per node, the shared
task-draw counter, and indexes for the per-submission reads.

* ``reputation.bundles_rejected``: rejections per node as a counter (``get_node`` no
  longer counts the verdict log), backfilled from ``verdicts`` (code != 0). It lives in
  ``reputation``, not ``nodes``, so that a rejection still leaves ``nodes`` unchanged.
  Nodes that have no reputation row (registered before that table existed) get one.
* ``counters``: named shared counters; ``task_draws`` (task numbers reserved by
  ``lease_block``) starts at the number of leases issued so far.
* ``verdicts (node_id, at_ms)``, ``bundles (node_id, stored_at_ms)`` and
  ``evidence (node_id, kind, at_ms)`` replace the single-column ``node_id`` indexes
  (the per-minute quota reads and the dispute check are index range scans).

Revision ID: 0002
Revises: 0001
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

_INDEXES = [
    # (new index, columns, replaced single-column index)
    ("ix_verdicts_node_at", "verdicts", ["node_id", "at_ms"], "ix_verdicts_node_id"),
    ("ix_bundles_node_stored", "bundles", ["node_id", "stored_at_ms"], "ix_bundles_node_id"),
    ("ix_evidence_node_kind_at", "evidence", ["node_id", "kind", "at_ms"], "ix_evidence_node_id"),
]


def upgrade() -> None:
    op.add_column(
        "reputation",
        sa.Column("bundles_rejected", sa.BigInteger(), nullable=False, server_default="0"),
    )
    nodes = sa.table(
        "nodes", sa.column("node_id", sa.String), sa.column("registered_at_ms", sa.BigInteger)
    )
    reputation = sa.table(
        "reputation",
        sa.column("node_id", sa.String),
        sa.column("good", sa.Float),
        sa.column("bad", sa.Float),
        sa.column("updated_ms", sa.BigInteger),
        sa.column("quarantined", sa.Boolean),
        sa.column("bundles_rejected", sa.BigInteger),
    )
    verdicts = sa.table(
        "verdicts", sa.column("node_id", sa.String), sa.column("code", sa.Integer)
    )
    leases = sa.table("leases", sa.column("lease_id", sa.String))
    missing = sa.select(
        nodes.c.node_id,
        sa.literal(0.0, sa.Float),
        sa.literal(0.0, sa.Float),
        nodes.c.registered_at_ms,
        sa.false(),
        sa.literal(0, sa.BigInteger),
    ).where(~sa.exists().where(reputation.c.node_id == nodes.c.node_id))
    op.execute(
        reputation.insert().from_select(
            ["node_id", "good", "bad", "updated_ms", "quarantined", "bundles_rejected"], missing
        )
    )
    rejected = (
        sa.select(sa.func.count())
        .select_from(verdicts)
        .where(verdicts.c.node_id == reputation.c.node_id, verdicts.c.code != 0)
        .scalar_subquery()
    )
    op.execute(reputation.update().values(bundles_rejected=rejected))

    counters = op.create_table(
        "counters",
        sa.Column("name", sa.String(64), primary_key=True),
        sa.Column("value", sa.BigInteger(), nullable=False),
    )
    issued = sa.select(sa.func.count()).select_from(leases).scalar_subquery()
    op.execute(
        counters.insert().from_select(
            ["name", "value"], sa.select(sa.literal("task_draws", sa.String(64)), issued)
        )
    )

    for name, table, columns, replaced in _INDEXES:
        op.create_index(name, table, columns)
        op.drop_index(replaced, table_name=table)


def downgrade() -> None:
    for name, table, columns, replaced in _INDEXES:
        op.create_index(replaced, table, columns[:1])
        op.drop_index(name, table_name=table)
    op.drop_table("counters")
    with op.batch_alter_table("reputation") as batch:
        batch.drop_column("bundles_rejected")
