"""The schema of revision 0001, frozen: the tables exactly as ``Base.metadata.create_all``
made them before migrations existed (including ``bundles.text_verified`` and
``bundles.stored_quarantined``, which older releases added with ``ALTER TABLE``).

Never edit this to follow the ORM models: schema changes are new revisions. It is used
by revision 0001 and to bring a database made before migrations to revision 0001 before
it is stamped (:func:`ftis.coordinator.state.migrate.upgrade`).
"""

from __future__ import annotations

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Column,
    Connection,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Table,
    Text,
    inspect,
    text,
)

_Id = BigInteger().with_variant(Integer, "sqlite")

metadata = MetaData()

nodes = Table(
    "nodes",
    metadata,
    Column("node_id", String(64), primary_key=True),
    Column("public_key", LargeBinary, nullable=False),
    Column("display_name", String(256), nullable=False),
    Column("model_card", LargeBinary, nullable=False),
    Column("fingerprint", String(64), nullable=False, index=True),
    Column("vocab_size", BigInteger, nullable=False),
    Column("client_version", String(128), nullable=False),
    Column("registered_at_ms", BigInteger, nullable=False),
    Column("last_seen_ms", BigInteger, nullable=False),
    Column("policy_version", BigInteger, nullable=False),
    Column("banned", Boolean, nullable=False),
    Column("ban_reason", Text, nullable=False),
    Column("bundles_accepted", BigInteger, nullable=False),
    Column("reward_mismatches", BigInteger, nullable=False),
    Column("completions", BigInteger, nullable=False),
    Column("completion_tokens", BigInteger, nullable=False),
    Column("latest_metrics", JSON, nullable=False),
    Column("latest_metrics_step", BigInteger, nullable=False),
)

reputation = Table(
    "reputation",
    metadata,
    Column("node_id", String(64), ForeignKey("nodes.node_id"), primary_key=True),
    Column("good", Float, nullable=False),
    Column("bad", Float, nullable=False),
    Column("updated_ms", BigInteger, nullable=False),
    Column("quarantined", Boolean, nullable=False, index=True),
)

leases = Table(
    "leases",
    metadata,
    Column("lease_id", String(64), primary_key=True),
    Column("task_id", String(64), nullable=False, unique=True),
    Column("node_id", String(64), ForeignKey("nodes.node_id"), nullable=False),
    Column("dataset", String(128), nullable=False),
    Column("spec_index", Integer, nullable=False),
    Column("entry_json", Text, nullable=False),
    Column("group_size", Integer, nullable=False),
    Column("max_new_tokens", Integer, nullable=False),
    Column("issued_at_ms", BigInteger, nullable=False),
    Column("deadline_ms", BigInteger, nullable=False),
    Column("bundle_id", String(64), nullable=True),
    Index("ix_leases_outstanding", "node_id", "bundle_id", "deadline_ms"),
)

bundles = Table(
    "bundles",
    metadata,
    Column("sequence", _Id, primary_key=True, autoincrement=True),
    Column("bundle_id", String(64), nullable=False, unique=True),
    Column("node_id", String(64), ForeignKey("nodes.node_id"), nullable=False, index=True),
    Column("task_id", String(64), nullable=False),
    Column("lease_id", String(64), ForeignKey("leases.lease_id"), nullable=False, unique=True),
    Column("fingerprint", String(64), nullable=False, index=True),
    Column("envelope", LargeBinary, nullable=False),
    Column("verified_rewards", JSON, nullable=False),
    Column("mean_reward", Float, nullable=False),
    Column("zero_variance", Boolean, nullable=False),
    Column("completions", Integer, nullable=False),
    Column("completion_tokens", BigInteger, nullable=False),
    Column("size_bytes", BigInteger, nullable=False),
    Column("reward_mismatches", Integer, nullable=False),
    Column("policy_version", BigInteger, nullable=False),
    Column("stored_at_ms", BigInteger, nullable=False),
    Column("text_verified", Boolean, nullable=False),
    Column("stored_quarantined", Boolean, nullable=False),
    sqlite_autoincrement=True,
)

verdicts = Table(
    "verdicts",
    metadata,
    Column("id", _Id, primary_key=True, autoincrement=True),
    Column("node_id", String(64), nullable=True, index=True),
    Column("bundle_id", String(64), nullable=True),
    Column("code", Integer, nullable=False, index=True),
    Column("reason", Text, nullable=False),
    Column("at_ms", BigInteger, nullable=False),
)

metrics = Table(
    "metrics",
    metadata,
    Column("id", _Id, primary_key=True, autoincrement=True),
    Column("node_id", String(64), ForeignKey("nodes.node_id"), nullable=False, index=True),
    Column("step", BigInteger, nullable=False),
    Column("values", JSON, nullable=False),
    Column("at_ms", BigInteger, nullable=False),
)

tokenizers = Table(
    "tokenizers",
    metadata,
    Column("fingerprint", String(64), primary_key=True),
    Column("tokenizer_json_gz", LargeBinary, nullable=False),
    Column("vocab_size", BigInteger, nullable=False),
    Column("uploaded_by", String(64), nullable=False),
    Column("at_ms", BigInteger, nullable=False),
)

evidence = Table(
    "evidence",
    metadata,
    Column("id", _Id, primary_key=True, autoincrement=True),
    Column("node_id", String(64), ForeignKey("nodes.node_id"), nullable=False, index=True),
    Column("at_ms", BigInteger, nullable=False),
    Column("kind", String(64), nullable=False),
    Column("weight", Float, nullable=False),
    Column("detail", Text, nullable=False),
    Column("reporter_node_id", String(64), nullable=False),
    Column("bundle_id", String(64), nullable=False),
    Index("ix_evidence_feedback", "reporter_node_id", "node_id", "at_ms"),
)

proofs = Table(
    "proofs",
    metadata,
    Column("id", _Id, primary_key=True, autoincrement=True),
    Column("node_id", String(64), ForeignKey("nodes.node_id"), nullable=False, index=True),
    Column("bundle_id", String(64), nullable=False),
    Column("code", Integer, nullable=False),
    Column("envelope", LargeBinary, nullable=False),
    Column("at_ms", BigInteger, nullable=False),
)

settings = Table(
    "settings",
    metadata,
    Column("key", String(64), primary_key=True),
    Column("value", Text, nullable=False),
    Column("at_ms", BigInteger, nullable=False),
)

#: Columns that releases before migrations added to existing databases on open
#: (``ALTER TABLE ... ADD COLUMN ... NOT NULL DEFAULT ...``).
LEGACY_ADDED_COLUMNS = [
    ("bundles", "text_verified", "BOOLEAN", "FALSE"),
    ("bundles", "stored_quarantined", "BOOLEAN", "FALSE"),
]


def complete_legacy(connection: Connection) -> None:
    """Bring a database made by a release before migrations to exactly revision 0001:
    create the tables it lacks (older releases had fewer) and add the columns that were
    added on open. Its rows are kept."""
    metadata.create_all(connection, checkfirst=True)
    inspector = inspect(connection)
    for table, column, sql_type, default in LEGACY_ADDED_COLUMNS:
        present = {c["name"] for c in inspector.get_columns(table)}
        if column not in present:
            connection.execute(
                text(
                    f"ALTER TABLE {table} ADD COLUMN {column} {sql_type} "
                    f"NOT NULL DEFAULT {default}"
                )
            )
