"""The ORM models verbatim as they were before migrations (``create_all`` made these
tables), for the migration tests: a database created by that code must open, keep its
rows and reach the newest revision."""

# ruff: noqa: E501
from __future__ import annotations

from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    String,
    Text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

_Id = BigInteger().with_variant(Integer, "sqlite")  # SQLite autoincrement needs INTEGER


class LegacyBase(DeclarativeBase):
    """The tables as releases before migrations created them."""


class NodeRow(LegacyBase):
    __tablename__ = "nodes"

    node_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    public_key: Mapped[bytes] = mapped_column(LargeBinary)
    display_name: Mapped[str] = mapped_column(String(256), default="")
    model_card: Mapped[bytes] = mapped_column(LargeBinary)  # serialized ftis.v1.ModelCard
    fingerprint: Mapped[str] = mapped_column(String(64), index=True)
    vocab_size: Mapped[int] = mapped_column(BigInteger)
    client_version: Mapped[str] = mapped_column(String(128), default="")
    registered_at_ms: Mapped[int] = mapped_column(BigInteger)
    last_seen_ms: Mapped[int] = mapped_column(BigInteger)
    policy_version: Mapped[int] = mapped_column(BigInteger, default=0)
    banned: Mapped[bool] = mapped_column(Boolean, default=False)
    ban_reason: Mapped[str] = mapped_column(Text, default="")
    bundles_accepted: Mapped[int] = mapped_column(BigInteger, default=0)
    reward_mismatches: Mapped[int] = mapped_column(BigInteger, default=0)
    completions: Mapped[int] = mapped_column(BigInteger, default=0)
    completion_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    latest_metrics: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    latest_metrics_step: Mapped[int] = mapped_column(BigInteger, default=0)


class ReputationRow(LegacyBase):
    """A node's reputation (reputation.py): evidence decayed to ``updated_ms`` and the
    quarantine flag, kept current on every evidence event so that relay filtering is
    one query. A separate table so that a rejected submission leaves ``nodes`` as is."""

    __tablename__ = "reputation"

    node_id: Mapped[str] = mapped_column(ForeignKey("nodes.node_id"), primary_key=True)
    good: Mapped[float] = mapped_column(Float, default=0.0)
    bad: Mapped[float] = mapped_column(Float, default=0.0)
    updated_ms: Mapped[int] = mapped_column(BigInteger, default=0)
    quarantined: Mapped[bool] = mapped_column(Boolean, default=False, index=True)


class LeaseRow(LegacyBase):
    __tablename__ = "leases"
    __table_args__ = (Index("ix_leases_outstanding", "node_id", "bundle_id", "deadline_ms"),)

    lease_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    task_id: Mapped[str] = mapped_column(String(64), unique=True)
    node_id: Mapped[str] = mapped_column(ForeignKey("nodes.node_id"))
    dataset: Mapped[str] = mapped_column(String(128))
    spec_index: Mapped[int] = mapped_column(Integer, default=0)
    entry_json: Mapped[str] = mapped_column(Text)  # TaskEntry.to_json()
    group_size: Mapped[int] = mapped_column(Integer)
    max_new_tokens: Mapped[int] = mapped_column(Integer)
    issued_at_ms: Mapped[int] = mapped_column(BigInteger)
    deadline_ms: Mapped[int] = mapped_column(BigInteger)
    bundle_id: Mapped[str | None] = mapped_column(String(64), nullable=True, default=None)


class BundleRow(LegacyBase):
    __tablename__ = "bundles"
    __table_args__ = {"sqlite_autoincrement": True}  # sequences are never reused

    sequence: Mapped[int] = mapped_column(_Id, primary_key=True, autoincrement=True)
    bundle_id: Mapped[str] = mapped_column(String(64), unique=True)
    node_id: Mapped[str] = mapped_column(ForeignKey("nodes.node_id"), index=True)
    task_id: Mapped[str] = mapped_column(String(64))
    # UNIQUE: the database-level replay guard (one bundle per lease).
    lease_id: Mapped[str] = mapped_column(ForeignKey("leases.lease_id"), unique=True)
    fingerprint: Mapped[str] = mapped_column(String(64), index=True)
    envelope: Mapped[bytes] = mapped_column(LargeBinary)  # serialized SignedEnvelope
    verified_rewards: Mapped[list[float]] = mapped_column(JSON)
    mean_reward: Mapped[float] = mapped_column(Float)
    zero_variance: Mapped[bool] = mapped_column(Boolean)
    completions: Mapped[int] = mapped_column(Integer)
    completion_tokens: Mapped[int] = mapped_column(BigInteger)
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    reward_mismatches: Mapped[int] = mapped_column(Integer)
    policy_version: Mapped[int] = mapped_column(BigInteger)
    stored_at_ms: Mapped[int] = mapped_column(BigInteger)
    # text == decode(token_ids) was checked with the sender's uploaded tokenizer.
    text_verified: Mapped[bool] = mapped_column(Boolean, default=False)
    #: the sender was quarantined when this bundle was stored: never relayed, even if
    #: the sender is released before receivers pull
    stored_quarantined: Mapped[bool] = mapped_column(Boolean, default=False)


class VerdictRow(LegacyBase):
    """Audit log: one row per accepted (code 0) or rejected bundle submission."""

    __tablename__ = "verdicts"

    id: Mapped[int] = mapped_column(_Id, primary_key=True, autoincrement=True)
    # Not a foreign key: rejections of unregistered senders are logged too.
    node_id: Mapped[str | None] = mapped_column(String(64), nullable=True, index=True)
    bundle_id: Mapped[str | None] = mapped_column(String(64), nullable=True)
    code: Mapped[int] = mapped_column(Integer, index=True)
    reason: Mapped[str] = mapped_column(Text, default="")
    at_ms: Mapped[int] = mapped_column(BigInteger)


class MetricRow(LegacyBase):
    __tablename__ = "metrics"

    id: Mapped[int] = mapped_column(_Id, primary_key=True, autoincrement=True)
    node_id: Mapped[str] = mapped_column(ForeignKey("nodes.node_id"), index=True)
    step: Mapped[int] = mapped_column(BigInteger)
    values: Mapped[dict[str, Any]] = mapped_column(JSON)
    at_ms: Mapped[int] = mapped_column(BigInteger)


class TokenizerRow(LegacyBase):
    """Uploaded tokenizers (gzip'd tokenizer.json), one per fingerprint."""

    __tablename__ = "tokenizers"

    fingerprint: Mapped[str] = mapped_column(String(64), primary_key=True)
    tokenizer_json_gz: Mapped[bytes] = mapped_column(LargeBinary)
    vocab_size: Mapped[int] = mapped_column(BigInteger)
    uploaded_by: Mapped[str] = mapped_column(String(64))
    at_ms: Mapped[int] = mapped_column(BigInteger)


class EvidenceRow(LegacyBase):
    """Every reputation observation (weight as applied, before decay)."""

    __tablename__ = "evidence"
    __table_args__ = (Index("ix_evidence_feedback", "reporter_node_id", "node_id", "at_ms"),)

    id: Mapped[int] = mapped_column(_Id, primary_key=True, autoincrement=True)
    node_id: Mapped[str] = mapped_column(ForeignKey("nodes.node_id"), index=True)
    at_ms: Mapped[int] = mapped_column(BigInteger)
    kind: Mapped[str] = mapped_column(String(64))
    weight: Mapped[float] = mapped_column(Float)
    detail: Mapped[str] = mapped_column(Text, default="")
    reporter_node_id: Mapped[str] = mapped_column(String(64), default="")
    bundle_id: Mapped[str] = mapped_column(String(64), default="")


class ProofRow(LegacyBase):
    """Signed inconsistent envelopes (TEXT_MISMATCH, PROMPT_MISMATCH): proof of misbehaviour."""

    __tablename__ = "proofs"

    id: Mapped[int] = mapped_column(_Id, primary_key=True, autoincrement=True)
    node_id: Mapped[str] = mapped_column(ForeignKey("nodes.node_id"), index=True)
    bundle_id: Mapped[str] = mapped_column(String(64), default="")
    code: Mapped[int] = mapped_column(Integer)
    envelope: Mapped[bytes] = mapped_column(LargeBinary)  # serialized SignedEnvelope
    at_ms: Mapped[int] = mapped_column(BigInteger)


class SettingRow(LegacyBase):
    """Operator settings changed at run time (JSON values), e.g. the reputation policy."""

    __tablename__ = "settings"

    key: Mapped[str] = mapped_column(String(64), primary_key=True)
    value: Mapped[str] = mapped_column(Text)
    at_ms: Mapped[int] = mapped_column(BigInteger)
