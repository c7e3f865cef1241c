"""SQLAlchemy 2 implementation of :class:`State` (SQLite file, ``sqlite://`` in memory,
PostgreSQL through psycopg 3).

The schema is managed by Alembic (:mod:`ftis.coordinator.state.migrate`): opening a
database runs ``upgrade head`` (a database made before migrations is stamped at the
first revision first). The ORM models below must match the newest revision;
``tests/state/test_migrations.py`` compares them.

Transactions:

* PostgreSQL: READ COMMITTED; every read-modify-write locks the rows it changes
  (``SELECT ... FOR UPDATE``), always a node's ``nodes`` row before its ``reputation``
  row, several nodes in ``node_id`` order, so worker processes never lose updates and
  never deadlock. The one-statement reads (:meth:`SqlState.submission_snapshot`, the
  relay page) run in autocommit: a single statement sees one consistent snapshot. An
  accepted bundle's optimistic commit (:meth:`SqlState._commit_expected`) is one
  statement in autocommit too; it locks ``nodes``, ``reputation`` and ``leases`` rows in
  that order and re-checks the expected values on their newest versions.
* SQLite: ``journal_mode=WAL``, ``synchronous=FULL`` (an acknowledged bundle survives a
  crash), foreign keys on; the submit and lease writes of concurrent requests share one
  transaction and one fsync (:mod:`.group_commit`), each in its own savepoint. Write
  transactions start with ``BEGIN IMMEDIATE`` (SQLAlchemy's pysqlite recipe: the
  driver's own BEGIN is switched off), so two processes on one file queue on the write
  lock (``busy_timeout`` 30 s) instead of deadlocking, and writers of one process also
  take a process-wide lock (no busy-wait between threads). Read-only transactions on a
  file skip that lock and use their own pooled connection: in WAL mode readers see a
  consistent snapshot and do not wait for the writer. The in-memory database
  (``sqlite://``) has one shared connection, so reads take the lock too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import threading
import types
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar, cast

from alembic.util import CommandError
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
    Table,
    Text,
    bindparam,
    case,
    create_engine,
    event,
    exists,
    func,
    insert,
    literal,
    or_,
    select,
    text,
    update,
)
from sqlalchemy.engine import Connection, CursorResult
from sqlalchemy.exc import IntegrityError, SQLAlchemyError
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, sessionmaker
from sqlalchemy.pool import StaticPool

from ftis.coordinator import reputation, waiting
from ftis.coordinator.reputation import Evidence, Standing
from ftis.coordinator.state.base import (
    AuditRelay,
    BranchRecord,
    BundleRecord,
    CommittedVerdict,
    DatabaseError,
    EvidenceRecord,
    LeaseRecord,
    NewBundle,
    NodeRecord,
    StandingUpdate,
    State,
    StatsRecord,
    SubmissionSnapshot,
    Verdict,
    check_branches,
)
from ftis.coordinator.state.envelope_cache import ENVELOPE_CACHE_BYTES, EnvelopeCache
from ftis.coordinator.state.group_commit import GroupCommit, dbapi_savepoint
from ftis.coordinator.state.write_lock import WriteLock
from ftis.protocol.errors import ErrorCode, FtisError
from ftis.tasks.source import TaskEntry

_Id = BigInteger().with_variant(Integer, "sqlite")  # SQLite autoincrement needs INTEGER

#: The ``counters`` row of task numbers reserved by :meth:`SqlState.lease_block`.
TASK_DRAWS = "task_draws"
#: Task numbers a process reserves from the shared draw counter at once: one update of
#: that (hot, on PostgreSQL with several workers) row per block instead of per lease.
TASK_BLOCK = 64
#: Pooled connections per process on a server database (the gRPC server runs 16 threads).
POOL_SIZE = 16
#: Seconds after which a pooled server connection is replaced.
POOL_RECYCLE_S = 300
#: ``pg_advisory_xact_lock`` key serialising branch definitions on PostgreSQL.
_PG_BRANCHES_LOCK = 0x46544942  # "FTIB"

T = TypeVar("T")


class Base(DeclarativeBase):
    """Declarative base of the coordinator tables."""

    if TYPE_CHECKING:  # every table here is declared by __tablename__: a Table
        __table__: ClassVar[Table]


class NodeRow(Base):
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
    #: Highest relay sequence served to this node (revision 0003; flushed in batches).
    relay_served_seq: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    #: The MERIT branch the node is leased from, or NULL: the whole mix (revision 0004).
    #: Not a foreign key: :meth:`SqlState.define_branches` unassigns the nodes of a
    #: branch it drops in the same transaction.
    branch: Mapped[str | None] = mapped_column(String(64), nullable=True, default=None)
    #: Audit-based probation (revision 0005): reputation.AUDIT_PENDING / _PASSED /
    #: _FAILED_STATUS; read only while the policy's ``audit_reporters`` > 0.
    audit_status: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    #: The known capabilities the node registered with, comma-separated (revision 0006;
    #: ``ftis.protocol.capabilities``).
    capabilities: Mapped[str] = mapped_column(String(512), default="", server_default="")


class AuditReportRow(Base):
    """The latest audit verdict of one established reporter on one sender on probation
    (revision 0005; docs/reputation.md "Audit-based probation")."""

    __tablename__ = "audit_reports"

    sender_node_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    reporter_node_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    plausible: Mapped[bool] = mapped_column(Boolean)
    at_ms: Mapped[int] = mapped_column(BigInteger)


class BranchRow(Base):
    """A MERIT branch: a named sub-mix of the task mix (revision 0004)."""

    __tablename__ = "branches"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    families: Mapped[list[str]] = mapped_column(JSON)
    tokens: Mapped[float] = mapped_column(Float, default=0.0)
    defined_at_ms: Mapped[int] = mapped_column(BigInteger)


class FeedbackBundleRow(Base):
    """A bundle a reporter's weighted feedback has counted (revision 0003): each bundle
    counts at most once per reporter."""

    __tablename__ = "feedback_bundles"

    reporter_node_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    bundle_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    at_ms: Mapped[int] = mapped_column(BigInteger)


class ReputationRow(Base):
    """A node's reputation (reputation.py): evidence decayed to ``updated_ms`` and the
    quarantine flag, kept current on every evidence event so that relay filtering is
    one query; and the node's rejection counter. A separate table so that a rejected
    submission leaves ``nodes`` as is."""

    __tablename__ = "reputation"

    node_id: Mapped[str] = mapped_column(ForeignKey("nodes.node_id"), primary_key=True)
    good: Mapped[float] = mapped_column(Float, default=0.0)
    bad: Mapped[float] = mapped_column(Float, default=0.0)
    updated_ms: Mapped[int] = mapped_column(BigInteger, default=0)
    quarantined: Mapped[bool] = mapped_column(Boolean, default=False, index=True)
    #: Rejected submissions of this node (revision 0002; backfilled from ``verdicts``).
    bundles_rejected: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")


class LeaseRow(Base):
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
    #: The MERIT branch the lease was issued under, or NULL (revision 0004).
    branch: Mapped[str | None] = mapped_column(String(64), nullable=True, default=None)


class BundleRow(Base):
    __tablename__ = "bundles"
    __table_args__ = (
        # the per-minute byte quota of one node (submission_snapshot), read from the
        # index alone (size_bytes lies after the envelope's overflow pages; 0007)
        Index("ix_bundles_node_stored_size", "node_id", "stored_at_ms", "size_bytes"),
        {"sqlite_autoincrement": True},  # sequences are never reused
    )

    sequence: Mapped[int] = mapped_column(_Id, primary_key=True, autoincrement=True)
    bundle_id: Mapped[str] = mapped_column(String(64), unique=True)
    node_id: Mapped[str] = mapped_column(ForeignKey("nodes.node_id"))
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


class VerdictRow(Base):
    """Audit log: one row per accepted (code 0) or rejected bundle submission."""

    __tablename__ = "verdicts"
    # the per-minute submission quota of one node (submission_snapshot)
    __table_args__ = (Index("ix_verdicts_node_at", "node_id", "at_ms"),)

    id: Mapped[int] = mapped_column(_Id, primary_key=True, autoincrement=True)
    # Not a foreign key: rejections of unregistered senders are logged too.
    node_id: Mapped[str | None] = mapped_column(String(64), nullable=True)
    bundle_id: Mapped[str | None] = mapped_column(String(64), nullable=True)
    code: Mapped[int] = mapped_column(Integer, index=True)
    reason: Mapped[str] = mapped_column(Text, default="")
    at_ms: Mapped[int] = mapped_column(BigInteger)


class MetricRow(Base):
    __tablename__ = "metrics"

    id: Mapped[int] = mapped_column(_Id, primary_key=True, autoincrement=True)
    node_id: Mapped[str] = mapped_column(ForeignKey("nodes.node_id"), index=True)
    step: Mapped[int] = mapped_column(BigInteger)
    values: Mapped[dict[str, Any]] = mapped_column(JSON)
    at_ms: Mapped[int] = mapped_column(BigInteger)


class TokenizerRow(Base):
    """Uploaded tokenizers (gzip'd tokenizer.json), one per fingerprint."""

    __tablename__ = "tokenizers"

    fingerprint: Mapped[str] = mapped_column(String(64), primary_key=True)
    tokenizer_json_gz: Mapped[bytes] = mapped_column(LargeBinary)
    vocab_size: Mapped[int] = mapped_column(BigInteger)
    uploaded_by: Mapped[str] = mapped_column(String(64))
    at_ms: Mapped[int] = mapped_column(BigInteger)


class EvidenceRow(Base):
    """Every reputation observation (weight as applied, before decay)."""

    __tablename__ = "evidence"
    __table_args__ = (
        Index("ix_evidence_feedback", "reporter_node_id", "node_id", "at_ms"),
        # a node's evidence (list_evidence) and its negative reporters (dispute check)
        Index("ix_evidence_node_kind_at", "node_id", "kind", "at_ms"),
    )

    id: Mapped[int] = mapped_column(_Id, primary_key=True, autoincrement=True)
    node_id: Mapped[str] = mapped_column(ForeignKey("nodes.node_id"))
    at_ms: Mapped[int] = mapped_column(BigInteger)
    kind: Mapped[str] = mapped_column(String(64))
    weight: Mapped[float] = mapped_column(Float)
    detail: Mapped[str] = mapped_column(Text, default="")
    reporter_node_id: Mapped[str] = mapped_column(String(64), default="")
    bundle_id: Mapped[str] = mapped_column(String(64), default="")


class ProofRow(Base):
    """Signed inconsistent envelopes (TEXT_MISMATCH, PROMPT_MISMATCH): proof of misbehaviour."""

    __tablename__ = "proofs"

    id: Mapped[int] = mapped_column(_Id, primary_key=True, autoincrement=True)
    node_id: Mapped[str] = mapped_column(ForeignKey("nodes.node_id"), index=True)
    bundle_id: Mapped[str] = mapped_column(String(64), default="")
    code: Mapped[int] = mapped_column(Integer)
    envelope: Mapped[bytes] = mapped_column(LargeBinary)  # serialized SignedEnvelope
    at_ms: Mapped[int] = mapped_column(BigInteger)


class SettingRow(Base):
    """Operator settings changed at run time (JSON values), e.g. the reputation policy."""

    __tablename__ = "settings"

    key: Mapped[str] = mapped_column(String(64), primary_key=True)
    value: Mapped[str] = mapped_column(Text)
    at_ms: Mapped[int] = mapped_column(BigInteger)


class CounterRow(Base):
    """Named counters shared by every worker process (``task_draws``: task numbers
    reserved so far), advanced with ``UPDATE ... RETURNING``."""

    __tablename__ = "counters"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    value: Mapped[int] = mapped_column(BigInteger)


def _encode_metrics(values: dict[str, float]) -> dict[str, float | str]:
    """JSON-safe metrics: non-finite floats become the strings "nan", "inf", "-inf"."""
    return {k: (float(v) if math.isfinite(v) else str(float(v))) for k, v in values.items()}


def _decode_metrics(values: dict[str, Any] | None) -> dict[str, float]:
    return {k: float(v) for k, v in (values or {}).items()}


def _sqlite_connect(dbapi_connection: Any, _record: Any) -> None:
    # The driver must not emit BEGIN itself: _sqlite_begin does (IMMEDIATE for writes).
    dbapi_connection.isolation_level = None
    cursor = dbapi_connection.cursor()
    try:
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA synchronous=FULL")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.execute("PRAGMA busy_timeout=30000")
    finally:
        cursor.close()


def _sqlite_begin(conn: Any) -> None:
    options = conn.get_execution_options()
    if options.get("ftis_write"):
        conn.exec_driver_sql("BEGIN IMMEDIATE")
    elif not options.get("ftis_single"):  # a lone statement needs no transaction
        conn.exec_driver_sql("BEGIN")


def normalize_url(url: str) -> str:
    """``postgresql://`` / ``postgres://`` URLs use psycopg 3 (the driver we ship)."""
    for prefix in ("postgresql://", "postgres://"):
        if url.startswith(prefix):
            return "postgresql+psycopg://" + url[len(prefix):]
    return url


def _clean(value: str | None) -> str | None:
    """Text for a column: NUL characters (which PostgreSQL refuses in text columns, and
    which signed payloads may carry) become U+FFFD."""
    if value and "\x00" in value:
        return value.replace("\x00", "\ufffd")
    return value


def _storable(*keys: str | None) -> bool:
    """False if a lookup key holds NUL: no stored id does (ids are hex or uuids), and
    PostgreSQL would refuse the query instead of finding nothing."""
    return not any(k and "\x00" in k for k in keys)


def _escape_like(prefix: str) -> str:
    return prefix.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")


class _Stale(Exception):
    """An optimistic write found its rows changed since they were read: nothing was
    written (the savepoint rolled back), the caller retries with the rows locked."""


class _Hot:
    """Statements of the hot paths, built once with bind parameters: SQLAlchemy then
    reuses their compiled form and memoized cache keys instead of rebuilding them on
    every call (see ``bench/results`` for the effect)."""

    nodes, reps, leases = NodeRow.__table__, ReputationRow.__table__, LeaseRow.__table__
    bundles, verdicts, evidence = BundleRow.__table__, VerdictRow.__table__, EvidenceRow.__table__
    counters = CounterRow.__table__

    lease_by_task = select(leases).where(leases.c.task_id == bindparam("task_id"))
    _stored = exists().where(bundles.c.bundle_id == bindparam("bundle_id"))
    _recent = (select(func.count(verdicts.c.id))
               .where(verdicts.c.node_id == bindparam("node_id"),
                      verdicts.c.at_ms >= bindparam("window_start"),
                      # refusals by the quota itself do not count against it
                      verdicts.c.code != int(ErrorCode.RATE_LIMITED))
               .scalar_subquery())
    _recent_bytes = (select(func.coalesce(func.sum(bundles.c.size_bytes), 0))
                     .where(bundles.c.node_id == bindparam("node_id"),
                            bundles.c.stored_at_ms >= bindparam("window_start"))
                     .scalar_subquery())
    _one = select(literal(1).label("one")).subquery()
    _reporters = (select(evidence.c.reporter_node_id).distinct().where(
        evidence.c.node_id == bindparam("node_id"),
        evidence.c.kind == reputation.FEEDBACK,
        evidence.c.at_ms >= bindparam("since"),
        evidence.c.weight < 0,
        evidence.c.reporter_node_id != "",
    ).subquery())
    #: The whole submission snapshot in one statement (one round trip, one consistent
    #: snapshot without a multi-statement transaction): the node and its reputation, the
    #: lease (columns prefixed ``lease_``), the counts, and the negative reporters
    #: joined with commas (node ids are hex).
    snapshot = select(
        *nodes.c,
        reps.c.good.label("rep_good"), reps.c.bad.label("rep_bad"),
        reps.c.updated_ms.label("rep_updated_ms"),
        reps.c.quarantined.label("rep_quarantined"),
        reps.c.bundles_rejected.label("rep_rejected"), reps.c.node_id.label("rep_node_id"),
        *[c.label(f"lease_{c.name}") for c in leases.c],
        _stored.label("stored"), _recent.label("n_recent"),
        _recent_bytes.label("n_bytes"),
        select(func.aggregate_strings(_reporters.c.reporter_node_id, ","))
        .scalar_subquery().label("reporters"),
    ).select_from(
        _one.outerjoin(nodes, nodes.c.node_id == bindparam("node_id"))
        .outerjoin(reps, reps.c.node_id == nodes.c.node_id)
        .outerjoin(leases, leases.c.task_id == bindparam("task_id"))
    )
    negative_reporters = select(_reporters.c.reporter_node_id)
    answer_lease = (
        update(leases)
        .where(leases.c.lease_id == bindparam("b_lease_id"), leases.c.bundle_id.is_(None))
        .values(bundle_id=bindparam("b_bundle_id"))
        .returning(leases.c.dataset)
    )
    insert_bundle = insert(bundles).returning(bundles.c.sequence)
    insert_verdict = insert(verdicts)
    insert_evidence = insert(evidence)
    update_standing = update(reps).where(reps.c.node_id == bindparam("b_node_id")).values(
        good=bindparam("b_good"), bad=bindparam("b_bad"), updated_ms=bindparam("b_updated"),
        quarantined=bindparam("b_quarantined"), bundles_rejected=bindparam("b_rejected"))
    lock_node_id = (select(nodes.c.node_id).where(nodes.c.node_id == bindparam("node_id"))
                    .with_for_update())
    outstanding = select(func.count(leases.c.lease_id)).where(
        leases.c.node_id == bindparam("node_id"), leases.c.bundle_id.is_(None),
        leases.c.deadline_ms >= bindparam("now"))
    reserve = (update(counters).where(counters.c.name == bindparam("b_name"))
               .values(value=counters.c.value + bindparam("b_n")).returning(counters.c.value))
    insert_leases = insert(leases)
    max_sequence = select(func.max(bundles.c.sequence))
    envelopes = select(bundles.c.sequence, bundles.c.envelope).where(
        bundles.c.sequence.in_(bindparam("sequences", expanding=True)))
    #: filled below: the relay page statements (:meth:`_relay_page`)
    relay_pages: ClassVar[dict[tuple[bool, bool, bool, int, bool], Any]] = {}

    @staticmethod
    def _relay_page(fingerprint: bool, skip_zero_variance: bool, branch: bool,
                    audit: int = 0, envelope: bool = True) -> Any:
        """A relay page (:meth:`SqlState.pull_bundles`) in one statement: the bundles
        after ``cursor`` in sequence order (without their envelopes unless
        ``envelope``, see :mod:`.envelope_cache`) with their lease's dataset and question and
        the sender's standing, each row carrying the largest sequence of the same
        snapshot (the next cursor of a page that is not full). With ``branch``, only
        bundles whose lease was issued under the bound ``branch`` (MERIT, issue 16).

        ``audit`` (audit-based probation): 0 off; 1 the requester is not established,
        senders on probation (fewer than ``probation_bundles`` verified bundles or an
        audit not passed) are left out; 2 it is established, their bundles are included
        only with the requester's own fingerprint ``audit_fp`` and marked
        ``audit_only``, zero-variance ones too (``skip_zero_variance`` spares only
        trainable groups: an audit compares log-probs, whatever the rewards)."""
        b, lz, rp, nd = _Hot.bundles, _Hot.leases, _Hot.reps, _Hot.nodes
        probation = or_(nd.c.bundles_accepted < bindparam("probation_bundles"),
                        nd.c.audit_status != reputation.AUDIT_PASSED)
        audit_only = (case((probation, True), else_=False) if audit == 2
                      else literal(False)).label("audit_only")
        query = (
            select(*[c for c in b.c if envelope or c is not b.c.envelope], lz.c.dataset,
                   lz.c.entry_json, rp.c.good, rp.c.bad,
                   rp.c.updated_ms, _Hot.max_sequence.scalar_subquery().label("max_seq"),
                   audit_only)
            .select_from(b.join(nd, nd.c.node_id == b.c.node_id)
                         .join(lz, lz.c.lease_id == b.c.lease_id)
                         .outerjoin(rp, rp.c.node_id == b.c.node_id))
            .where(
                b.c.sequence > bindparam("cursor"),
                b.c.node_id != bindparam("requester"),
                nd.c.banned.is_(False),
                or_(rp.c.quarantined.is_(None), rp.c.quarantined.is_(False)),
                b.c.stored_quarantined.is_(False),
            )
            .order_by(b.c.sequence)
            .limit(bindparam("limit"))
        )
        if fingerprint:
            query = query.where(b.c.fingerprint == bindparam("fingerprint"))
        if skip_zero_variance:  # an audit compares log-probs: rewards do not matter
            query = query.where(or_(b.c.zero_variance.is_(False), probation) if audit == 2
                                else b.c.zero_variance.is_(False))
        if branch:
            query = query.where(lz.c.branch == bindparam("branch"))
        if audit == 1:
            query = query.where(~probation)
        elif audit == 2:
            query = query.where(or_(~probation, b.c.fingerprint == bindparam("audit_fp")))
        return query

    #: The optimistic accept (:meth:`SqlState._commit_expected`), SQLite form: each
    #: update holds only if the row is as the submission snapshot read it.
    bump_node = (
        update(nodes)
        .where(nodes.c.node_id == bindparam("b_node_id"),
               nodes.c.bundles_accepted == bindparam("b_old_accepted"))
        .values(bundles_accepted=nodes.c.bundles_accepted + 1,
                reward_mismatches=nodes.c.reward_mismatches + bindparam("b_mismatches"),
                completions=nodes.c.completions + bindparam("b_completions"),
                completion_tokens=nodes.c.completion_tokens + bindparam("b_tokens"),
                last_seen_ms=case((nodes.c.last_seen_ms > bindparam("b_now"),
                                   nodes.c.last_seen_ms), else_=bindparam("b_now")),
                policy_version=bindparam("b_policy"))
        .returning(*nodes.c)
    )
    swap_standing = (
        update(reps)
        .where(reps.c.node_id == bindparam("b_node_id"),
               reps.c.good == bindparam("b_old_good"), reps.c.bad == bindparam("b_old_bad"),
               reps.c.updated_ms == bindparam("b_old_updated"),
               reps.c.quarantined == bindparam("b_old_quarantined"))
        .values(good=bindparam("b_good"), bad=bindparam("b_bad"),
                updated_ms=bindparam("b_updated"), quarantined=bindparam("b_quarantined"))
        .returning(reps.c.bundles_rejected)
    )
    #: The same on PostgreSQL as ONE statement (one round trip, no BEGIN/COMMIT: a single
    #: statement is atomic): ``g`` locks the node, reputation and lease rows and
    #: re-checks the expected values on their newest versions (READ COMMITTED re-reads
    #: locked rows); every write depends on ``g``, so either all happen or none (an
    #: empty result: the caller falls back to the locked path); a failing insert aborts
    #: the whole statement.
    pg_accept = text("""
WITH g AS (
  SELECT nodes.node_id FROM nodes
  JOIN reputation ON reputation.node_id = nodes.node_id
  JOIN leases ON leases.lease_id = :lease_id
  WHERE nodes.node_id = :node_id AND nodes.bundles_accepted = :old_accepted
    AND reputation.good = :old_good AND reputation.bad = :old_bad
    AND reputation.updated_ms = :old_updated AND reputation.quarantined = :old_quarantined
    AND leases.bundle_id IS NULL
  FOR UPDATE OF nodes, reputation, leases
), l AS (
  UPDATE leases SET bundle_id = :bundle_id FROM g
  WHERE leases.lease_id = :lease_id RETURNING leases.dataset
), n AS (
  UPDATE nodes SET bundles_accepted = nodes.bundles_accepted + 1,
    reward_mismatches = nodes.reward_mismatches + :mismatches,
    completions = nodes.completions + :completions,
    completion_tokens = nodes.completion_tokens + :tokens,
    last_seen_ms = GREATEST(nodes.last_seen_ms, :now), policy_version = :policy
  FROM g WHERE nodes.node_id = g.node_id RETURNING nodes.*
), r AS (
  UPDATE reputation SET good = :good, bad = :bad, updated_ms = :updated,
    quarantined = :quarantined
  FROM g WHERE reputation.node_id = g.node_id RETURNING reputation.bundles_rejected
), b AS (
  INSERT INTO bundles (bundle_id, node_id, task_id, lease_id, fingerprint, envelope,
    verified_rewards, mean_reward, zero_variance, completions, completion_tokens,
    size_bytes, reward_mismatches, policy_version, stored_at_ms, text_verified,
    stored_quarantined)
  SELECT :bundle_id, :node_id, :task_id, :lease_id, :fingerprint, :envelope,
    CAST(:rewards AS json), :mean_reward, :zero_variance, :completions, :tokens,
    :size_bytes, :mismatches, :policy, :now, :text_verified, :old_quarantined
  FROM g RETURNING bundles.sequence
), v AS (
  INSERT INTO verdicts (node_id, bundle_id, code, reason, at_ms)
  SELECT :node_id, :bundle_id, 0, :reason, :now FROM g
), e AS (
  INSERT INTO evidence (node_id, at_ms, kind, weight, detail, reporter_node_id, bundle_id)
  SELECT :node_id, :now, x.kind, x.weight, x.detail, x.reporter_node_id, x.bundle_id
  FROM g, jsonb_to_recordset(CAST(:events AS jsonb)) AS x(kind text, weight float8,
    detail text, reporter_node_id text, bundle_id text)
)
SELECT n.*, r.bundles_rejected AS rep_rejected, l.dataset AS dataset,
  b.sequence AS sequence FROM n, r, l, b""")


#: The relay page statements, by ``(fingerprint given, skip_zero_variance, branch given,
#: audit mode, envelopes selected)``.
_Hot.relay_pages.update({(f, z, br, au, env): _Hot._relay_page(f, z, br, au, env)
                         for f in (False, True) for z in (False, True)
                         for br in (False, True) for au in (0, 1, 2)
                         for env in (False, True)})


class SqlState(State):
    """:class:`State` on any SQLAlchemy URL.

    Args:
        url: e.g. ``sqlite:///var/ftis.db``, ``sqlite://`` (in memory, one shared
            connection; for tests) or ``postgresql+psycopg://user@host/db``
            (``postgresql://`` means the same).
        task_block: task numbers reserved per update of the draw counter.
        envelope_cache_bytes: bound of the relayed envelopes kept in memory (bytes;
            :mod:`.envelope_cache`; 0: the relay page reads them with the rest of the
            row). Default: :data:`.ENVELOPE_CACHE_BYTES` on PostgreSQL (a page's
            envelopes otherwise cross its socket every time), 0 on SQLite (the row's
            pages are read from the local file anyway; docs/benchmarks.md).

    Raises:
        ValueError: ``task_block < 1`` or ``envelope_cache_bytes < 0``.
        DatabaseError: if the database cannot be reached or migrated.
    """

    def __init__(self, url: str, *, task_block: int = TASK_BLOCK,
                 envelope_cache_bytes: int | None = None) -> None:
        from ftis.coordinator.state import migrate

        if task_block < 1:
            raise ValueError(f"task_block {task_block} < 1")
        #: Task numbers reserved per update of the draw counter (:meth:`lease_block`).
        self.task_block = task_block
        #: ``[next, end)``: numbers of this process's committed block not handed out yet.
        self._block = (0, 0)
        self._block_lock = threading.Lock()

        url = normalize_url(url)
        self.url = url
        self.is_sqlite = url.startswith("sqlite")
        self.is_postgres = url.startswith("postgresql")
        if envelope_cache_bytes is None:
            envelope_cache_bytes = ENVELOPE_CACHE_BYTES if self.is_postgres else 0
        if envelope_cache_bytes < 0:
            raise ValueError(f"envelope_cache_bytes {envelope_cache_bytes} < 0")
        #: Envelopes of bundles this process relayed (:mod:`.envelope_cache`); ``None``:
        #: the relay page selects them with the rest of the row.
        self._envelopes = (EnvelopeCache(envelope_cache_bytes) if envelope_cache_bytes > 0
                           else None)
        memory = False
        kwargs: dict[str, Any] = {}
        if self.is_sqlite:
            kwargs["connect_args"] = {"check_same_thread": False, "timeout": 30}
            if url in ("sqlite://", "sqlite:///:memory:") or "mode=memory" in url:
                kwargs["poolclass"] = StaticPool
                memory = True
        else:
            # One pooled connection per server thread, so requests never queue for one;
            # no ping on every checkout (a round trip per request): connections are
            # recycled after POOL_RECYCLE_S instead, and one dropped by a server restart
            # fails a single call, which the client retries.
            kwargs.update(pool_size=POOL_SIZE, max_overflow=POOL_SIZE,
                          pool_recycle=POOL_RECYCLE_S)
        try:
            self.engine = create_engine(url, **kwargs)
            if self.is_sqlite:
                event.listen(self.engine, "connect", _sqlite_connect)
                event.listen(self.engine, "begin", _sqlite_begin)
            self._write_engine = self.engine.execution_options(ftis_write=True)
            #: SQLite connections for one read statement: no BEGIN (the driver runs a
            #: lone statement atomically, as its own implicit transaction)
            self._single_engine = self.engine.execution_options(ftis_single=True)
            self._autocommit = self.engine.execution_options(isolation_level="AUTOCOMMIT")
            migrate.upgrade(self._write_engine)
        except (SQLAlchemyError, CommandError, ImportError, ValueError, OSError) as exc:
            with contextlib.suppress(Exception):
                self.engine.dispose()
            raise DatabaseError(f"cannot open database {url!r}: {exc}") from exc
        self._writes = sessionmaker(self._write_engine, expire_on_commit=False)
        self._reads = sessionmaker(self.engine, expire_on_commit=False)
        #: SQLite: one writer at a time across threads and the processes of
        #: ``serve --workers`` (:mod:`.write_lock`); PostgreSQL locks rows itself.
        self._sqlite_lock: WriteLock | None = None
        if self.is_sqlite:
            database = self.engine.url.database
            try:
                self._sqlite_lock = WriteLock(
                    None if memory or not database else f"{database}-ftis-write.lock")
            except OSError as exc:
                self.engine.dispose()
                raise DatabaseError(f"cannot open the write lock of {url!r}: {exc}") from exc
        lock: contextlib.AbstractContextManager[Any] = (
            self._sqlite_lock if self._sqlite_lock is not None else contextlib.nullcontext())
        self._write_lock = lock
        self._read_lock = lock if memory else contextlib.nullcontext()
        #: SQLite: the submit and lease writes share transactions and fsyncs
        #: (:mod:`.group_commit`); PostgreSQL commits concurrently from many connections.
        self._group: GroupCommit | None = (
            GroupCommit(self._write_engine.begin, dbapi_savepoint, self._sqlite_lock)
            if self._sqlite_lock is not None else None)
        #: PostgreSQL: threads that run the hot writes of handlers inline on the event
        #: loop (:meth:`_off_loop`; the executor starts a thread only when one is needed)
        self._writers: ThreadPoolExecutor | None = (
            None if self._group is not None
            else ThreadPoolExecutor(POOL_SIZE, thread_name_prefix="ftis-db-write"))

    @contextlib.contextmanager
    def _write(self) -> Iterator[Session]:
        """A read-write transaction, committed on success, rolled back on error."""
        with self._write_lock, self._writes() as session, session.begin():
            yield session

    @contextlib.contextmanager
    def _read(self) -> Iterator[Session]:
        """A read-only transaction (nothing may be written in it)."""
        with self._read_lock, self._reads() as session, session.begin():
            yield session

    @contextlib.contextmanager
    def _write_conn(self) -> Iterator[Connection]:
        """:meth:`_write` without an ORM session, for the hot paths (Core statements)."""
        with self._write_lock, self._write_engine.begin() as conn:
            yield conn

    def _hot_write(self, work: Callable[[Connection], T]) -> T:
        """``work(connection)`` in a write transaction, committed before this returns: a
        savepoint of a shared group commit on SQLite, its own transaction otherwise."""
        if self._group is not None:
            return self._group.run(work)

        def own_transaction() -> T:
            with self._write_conn() as conn:
                return work(conn)

        return self._off_loop(own_transaction)

    def _off_loop(self, call: Callable[[], T]) -> T:
        """``call()``; from a handler inline on the event loop, in a writer thread while
        the loop serves other requests (:mod:`ftis.coordinator.waiting`), so that a
        PostgreSQL transaction's round trips and its commit's fsync do not hold the loop.
        SQLite's writes need not come here: its group commit has a leader thread."""
        if self._writers is None or not waiting.inline():
            return call()
        return waiting.wait_future(self._writers.submit(call))

    @contextlib.contextmanager
    def _snapshot_conn(self) -> Iterator[Connection]:
        """A connection for ONE read statement, without a transaction around it (no
        BEGIN/COMMIT round trips; a single statement reads one consistent snapshot)."""
        if self.is_sqlite:  # pysqlite: a lone SELECT outside a transaction is atomic too
            with self._read_lock, self._single_engine.connect() as conn:
                yield conn
            return
        with self._read_lock, self._autocommit.connect() as conn:
            yield conn

    @contextlib.contextmanager
    def _read_conn(self) -> Iterator[Connection]:
        """:meth:`_read` without an ORM session, for the hot paths (Core statements)."""
        with self._read_lock, self.engine.begin() as conn:
            yield conn

    # -- conversions -------------------------------------------------------------
    @classmethod
    def _node_record(cls, row: NodeRow, rep: ReputationRow | None) -> NodeRecord:
        """A NodeRecord from ORM rows (the same mapping as :meth:`_node_from_row`)."""
        values = {c.key: getattr(row, c.key) for c in NodeRow.__table__.c}
        values.update(
            rep_node_id=rep.node_id if rep is not None else None,
            rep_good=rep.good if rep is not None else None,
            rep_bad=rep.bad if rep is not None else None,
            rep_updated_ms=rep.updated_ms if rep is not None else None,
            rep_quarantined=rep.quarantined if rep is not None else None,
            rep_rejected=rep.bundles_rejected if rep is not None else None,
        )
        return cls._node_from_row(types.SimpleNamespace(**values))

    @staticmethod
    def _nodes_query() -> Any:
        """``(NodeRow, ReputationRow | None)`` pairs: one query per NodeRecord read."""
        return select(NodeRow, ReputationRow).outerjoin(
            ReputationRow, ReputationRow.node_id == NodeRow.node_id
        )

    #: Core form of :meth:`_nodes_query` for the hot paths (no ORM objects are built).
    _NODE_COLUMNS = select(
        *NodeRow.__table__.c,
        ReputationRow.__table__.c.good.label("rep_good"),
        ReputationRow.__table__.c.bad.label("rep_bad"),
        ReputationRow.__table__.c.updated_ms.label("rep_updated_ms"),
        ReputationRow.__table__.c.quarantined.label("rep_quarantined"),
        ReputationRow.__table__.c.bundles_rejected.label("rep_rejected"),
        ReputationRow.__table__.c.node_id.label("rep_node_id"),
    ).select_from(NodeRow.__table__.outerjoin(
        ReputationRow.__table__,
        ReputationRow.__table__.c.node_id == NodeRow.__table__.c.node_id))

    _NODE_BY_ID = _NODE_COLUMNS.where(NodeRow.__table__.c.node_id == bindparam("node_id"))

    @staticmethod
    def _node_from_row(m: Any) -> NodeRecord:
        """A NodeRecord from a :data:`_NODE_COLUMNS` row."""
        has_rep = m.rep_node_id is not None
        return NodeRecord(
            node_id=m.node_id,
            public_key=m.public_key,
            display_name=m.display_name,
            model_card=m.model_card,
            fingerprint=m.fingerprint,
            vocab_size=m.vocab_size,
            client_version=m.client_version,
            registered_at_ms=m.registered_at_ms,
            last_seen_ms=m.last_seen_ms,
            policy_version=m.policy_version,
            banned=bool(m.banned),
            ban_reason=m.ban_reason,
            bundles_accepted=m.bundles_accepted,
            bundles_rejected=int(m.rep_rejected or 0) if has_rep else 0,
            reward_mismatches=m.reward_mismatches,
            completions=m.completions,
            completion_tokens=m.completion_tokens,
            latest_metrics=_decode_metrics(m.latest_metrics),
            latest_metrics_step=m.latest_metrics_step,
            relay_served_seq=int(m.relay_served_seq or 0),
            rep_good=m.rep_good if has_rep else 0.0,
            rep_bad=m.rep_bad if has_rep else 0.0,
            rep_updated_ms=m.rep_updated_ms if has_rep else m.registered_at_ms,
            quarantined=bool(m.rep_quarantined) if has_rep else False,
            branch=m.branch,
            audit_status=int(m.audit_status or 0),
            capabilities=tuple(c for c in (m.capabilities or "").split(",") if c),
        )

    def _read_node(self, session: Session | Connection, node_id: str) -> NodeRecord | None:
        if not _storable(node_id):
            return None
        row = session.execute(self._NODE_BY_ID, {"node_id": node_id}).first()
        return None if row is None else self._node_from_row(row)

    @staticmethod
    def _lease_record(row: Any) -> LeaseRecord:  # a LeaseRow or a row of its columns
        return LeaseRecord(
            lease_id=row.lease_id,
            task_id=row.task_id,
            node_id=row.node_id,
            dataset=row.dataset,
            spec_index=row.spec_index,
            entry=TaskEntry.from_json(row.entry_json),
            group_size=row.group_size,
            max_new_tokens=row.max_new_tokens,
            issued_at_ms=row.issued_at_ms,
            deadline_ms=row.deadline_ms,
            bundle_id=row.bundle_id,
            branch=row.branch,
        )

    @staticmethod
    def _lease_values(lease: LeaseRecord) -> dict[str, Any]:
        """The ``leases`` row of a new (unanswered) lease."""
        return {"lease_id": lease.lease_id, "task_id": lease.task_id,
                "node_id": lease.node_id, "dataset": lease.dataset,
                "spec_index": lease.spec_index, "entry_json": lease.entry.to_json(),
                "group_size": lease.group_size, "max_new_tokens": lease.max_new_tokens,
                "issued_at_ms": lease.issued_at_ms, "deadline_ms": lease.deadline_ms,
                "bundle_id": None, "branch": lease.branch}

    @staticmethod
    def _bundle_record(row: Any, dataset: str) -> BundleRecord:
        """A BundleRecord from anything with the ``bundles`` columns as attributes (an ORM
        row, a Core row, or the values just inserted)."""
        return BundleRecord(
            sequence=row.sequence,
            bundle_id=row.bundle_id,
            node_id=row.node_id,
            task_id=row.task_id,
            lease_id=row.lease_id,
            dataset=dataset,
            fingerprint=row.fingerprint,
            envelope=row.envelope,
            verified_rewards=[float(r) for r in row.verified_rewards],
            mean_reward=row.mean_reward,
            zero_variance=row.zero_variance,
            completions=row.completions,
            completion_tokens=row.completion_tokens,
            size_bytes=row.size_bytes,
            reward_mismatches=row.reward_mismatches,
            policy_version=row.policy_version,
            stored_at_ms=row.stored_at_ms,
            text_verified=bool(row.text_verified),
        )

    # -- the submit path -----------------------------------------------------------
    def submission_snapshot(
        self, node_id: str, task_id: str, bundle_id: str, since_ms: int, window_start_ms: int
    ) -> SubmissionSnapshot:
        if not _storable(node_id, bundle_id):  # no such node or bundle
            return SubmissionSnapshot(node=None, lease=None, already_stored=False)
        with self._snapshot_conn() as conn:
            m = conn.execute(_Hot.snapshot, {
                "node_id": node_id, "task_id": task_id if _storable(task_id) else "",
                "bundle_id": bundle_id, "window_start": window_start_ms,
                "since": since_ms}).one()
        lease = None
        if m.lease_lease_id is not None:
            lease = self._lease_record(types.SimpleNamespace(
                **{c.name: getattr(m, f"lease_{c.name}") for c in LeaseRow.__table__.c}))
        return SubmissionSnapshot(
            node=self._node_from_row(m) if m.node_id is not None else None,
            lease=lease,
            already_stored=bool(m.stored),
            negative_reporters=frozenset(r for r in (m.reporters or "").split(",") if r),
            recent_submissions=int(m.n_recent or 0),
            recent_bytes=int(m.n_bytes or 0),
        )

    def _answer_lease_and_insert(
        self, session: Session | Connection, bundle: NewBundle, now_ms: int,
        stored_quarantined: bool,
    ) -> BundleRecord:
        """Mark the lease answered (conditional UPDATE: the replay guard) and insert the
        bundle (Core statements). Raises BUNDLE_REPLAYED (the caller rolls back)."""
        dataset = session.execute(_Hot.answer_lease, {
            "b_lease_id": bundle.lease_id, "b_bundle_id": bundle.bundle_id}).scalar()
        if dataset is None:
            raise FtisError(ErrorCode.BUNDLE_REPLAYED, f"lease {bundle.lease_id} already answered")
        values = self._bundle_values(bundle, now_ms, stored_quarantined)
        sequence = session.execute(_Hot.insert_bundle, values).scalar_one()
        return self._bundle_record(types.SimpleNamespace(**values, sequence=sequence), dataset)

    @staticmethod
    def _bundle_values(bundle: NewBundle, now_ms: int, stored_quarantined: bool
                       ) -> dict[str, Any]:
        """The ``bundles`` row of ``bundle`` (without its sequence)."""
        return {
            "bundle_id": bundle.bundle_id, "node_id": bundle.node_id,
            "task_id": bundle.task_id, "lease_id": bundle.lease_id,
            "fingerprint": bundle.fingerprint, "envelope": bundle.envelope,
            "verified_rewards": list(bundle.verified_rewards),
            "mean_reward": bundle.mean_reward, "zero_variance": bundle.zero_variance,
            "completions": bundle.completions, "completion_tokens": bundle.completion_tokens,
            "size_bytes": bundle.size_bytes, "reward_mismatches": bundle.reward_mismatches,
            "policy_version": bundle.policy_version, "stored_at_ms": now_ms,
            "text_verified": bundle.text_verified, "stored_quarantined": stored_quarantined,
        }

    def _locked_node_row(self, session: Session | Connection, node_id: str) -> Any:
        """The node's :data:`_NODE_COLUMNS` row with its node row locked (FOR UPDATE OF
        nodes on PostgreSQL; SQLite's BEGIN IMMEDIATE serialises writers), or
        ``None``. A missing reputation row is made (revision 0002 makes them for older
        nodes; this is only a guard)."""
        nodes, reps = NodeRow.__table__, ReputationRow.__table__
        # the node row's lock also guards its reputation row: every writer of a
        # reputation row locks the node row first
        locked = self._NODE_COLUMNS.where(nodes.c.node_id == node_id).with_for_update(of=nodes)
        m = session.execute(locked).first()
        if m is not None and m.rep_node_id is None:
            session.execute(insert(reps).values(
                node_id=node_id, good=0.0, bad=0.0, updated_ms=m.registered_at_ms,
                quarantined=False, bundles_rejected=0))
            m = session.execute(locked).first()
        return m

    def _write_standing(self, session: Session | Connection, node_id: str, standing: Standing,
                        events: list[Evidence], now_ms: int, rejected: int) -> None:
        """Store ``standing`` and the rejection counter ``rejected`` (one UPDATE) and one
        evidence row per event (one INSERT of them all; Core statements)."""
        session.execute(_Hot.update_standing, {
            "b_node_id": node_id, "b_good": float(standing.good), "b_bad": float(standing.bad),
            "b_updated": int(standing.updated_at_ms),
            "b_quarantined": bool(standing.quarantined), "b_rejected": rejected})
        if events:
            session.execute(_Hot.insert_evidence, [
                {"node_id": node_id, "at_ms": now_ms, "kind": _clean(e.kind),
                 "weight": float(e.weight), "detail": _clean(e.detail[:2000]),
                 "reporter_node_id": _clean(e.reporter_node_id),
                 "bundle_id": _clean(e.bundle_id)} for e in events])

    def commit_submission(
        self, verdict: Verdict, now_ms: int, update: StandingUpdate | None = None,
        expected: NodeRecord | None = None,
    ) -> CommittedVerdict:
        if verdict.evidence and update is None:
            raise ValueError("commit_submission: evidence needs an update function")
        if (verdict.code == 0) != (verdict.bundle is not None):
            raise ValueError("commit_submission: a bundle iff code == 0")
        if verdict.bundle is not None and verdict.bundle.node_id != verdict.node_id:
            raise ValueError("commit_submission: the bundle's node is not the verdict's")
        if (expected is not None and verdict.bundle is not None
                and expected.node_id == verdict.node_id and _storable(expected.node_id)):
            try:
                done = self._commit_expected(verdict, verdict.bundle, now_ms, update, expected)
            except IntegrityError as exc:
                raise FtisError(
                    ErrorCode.BUNDLE_REPLAYED,
                    f"lease {verdict.bundle.lease_id} or bundle already stored",
                ) from exc
            except _Stale:
                done = None
            if done is not None:
                return done
        return self._commit_locked(verdict, now_ms, update)

    def _commit_expected(
        self, verdict: Verdict, bundle: NewBundle, now_ms: int,
        update: StandingUpdate | None, expected: NodeRecord,
    ) -> CommittedVerdict | None:
        """An accepted bundle's commit without reading the node first: the standing is
        computed from ``expected`` (the snapshot's record), and every write holds only
        if the node's ``bundles_accepted`` and standing are still those (compare and
        swap). One statement on PostgreSQL; on SQLite six statements in the group
        commit's savepoint. Returns ``None`` (nothing written) when the rows changed
        since the snapshot or the lease was answered; the caller then takes the locked
        path, which also tells the cases apart."""
        old = expected.standing
        standing = old
        if verdict.evidence:
            assert update is not None
            standing = update(old, expected.bundles_accepted + 1)
        events = [{"kind": _clean(e.kind), "weight": float(e.weight),
                   "detail": _clean(e.detail[:2000]),
                   "reporter_node_id": _clean(e.reporter_node_id),
                   "bundle_id": _clean(e.bundle_id)} for e in verdict.evidence]
        reason = _clean(verdict.reason)
        if self.is_postgres:
            return self._off_loop(lambda: self._pg_accept(
                bundle, now_ms, expected, old, standing, events, reason))

        def work(conn: Connection) -> CommittedVerdict:
            node = conn.execute(_Hot.bump_node, {
                "b_node_id": bundle.node_id, "b_old_accepted": expected.bundles_accepted,
                "b_mismatches": bundle.reward_mismatches, "b_completions": bundle.completions,
                "b_tokens": bundle.completion_tokens, "b_now": now_ms,
                "b_policy": bundle.policy_version}).first()
            if node is None:
                raise _Stale
            rejected = conn.execute(_Hot.swap_standing, {
                "b_node_id": bundle.node_id, "b_old_good": float(old.good),
                "b_old_bad": float(old.bad), "b_old_updated": int(old.updated_at_ms),
                "b_old_quarantined": bool(old.quarantined),
                "b_good": float(standing.good), "b_bad": float(standing.bad),
                "b_updated": int(standing.updated_at_ms),
                "b_quarantined": bool(standing.quarantined)}).scalar()
            if rejected is None:
                raise _Stale
            stored = self._answer_lease_and_insert(conn, bundle, now_ms, bool(old.quarantined))
            conn.execute(_Hot.insert_verdict, {
                "node_id": bundle.node_id, "bundle_id": bundle.bundle_id, "code": 0,
                "reason": reason, "at_ms": now_ms})
            if events:
                conn.execute(_Hot.insert_evidence, [
                    {"node_id": bundle.node_id, "at_ms": now_ms, **e} for e in events])
            row = types.SimpleNamespace(
                **dict(node._mapping), rep_good=float(standing.good),
                rep_bad=float(standing.bad), rep_updated_ms=int(standing.updated_at_ms),
                rep_quarantined=bool(standing.quarantined), rep_rejected=rejected,
                rep_node_id=bundle.node_id)
            return CommittedVerdict(bundle=stored, node=self._node_from_row(row))

        return self._hot_write(work)

    def _pg_accept(self, bundle: NewBundle, now_ms: int, expected: NodeRecord,
                   old: Standing, standing: Standing, events: list[dict[str, Any]],
                   reason: str | None) -> CommittedVerdict | None:
        """:meth:`_commit_expected` on PostgreSQL: one statement (``_Hot.pg_accept``) in
        autocommit; ``None`` when the rows changed since the snapshot."""
        with self._autocommit.connect() as conn:
            m = conn.execute(_Hot.pg_accept, {
                "node_id": bundle.node_id, "lease_id": bundle.lease_id,
                "old_accepted": expected.bundles_accepted,
                "old_good": float(old.good), "old_bad": float(old.bad),
                "old_updated": int(old.updated_at_ms),
                "old_quarantined": bool(old.quarantined),
                "bundle_id": bundle.bundle_id, "mismatches": bundle.reward_mismatches,
                "completions": bundle.completions, "tokens": bundle.completion_tokens,
                "now": now_ms, "policy": bundle.policy_version,
                "good": float(standing.good), "bad": float(standing.bad),
                "updated": int(standing.updated_at_ms),
                "quarantined": bool(standing.quarantined),
                "task_id": bundle.task_id, "fingerprint": bundle.fingerprint,
                "envelope": bundle.envelope,
                "rewards": json.dumps([float(r) for r in bundle.verified_rewards]),
                "mean_reward": bundle.mean_reward, "zero_variance": bundle.zero_variance,
                "size_bytes": bundle.size_bytes, "text_verified": bundle.text_verified,
                "reason": reason, "events": json.dumps(events),
            }).first()
        if m is None:
            return None
        rep_values = {"rep_good": float(standing.good), "rep_bad": float(standing.bad),
                      "rep_updated_ms": int(standing.updated_at_ms),
                      "rep_quarantined": bool(standing.quarantined),
                      "rep_node_id": bundle.node_id}
        row = types.SimpleNamespace(**dict(m._mapping), **rep_values)
        stored = self._bundle_record(types.SimpleNamespace(
            **self._bundle_values(bundle, now_ms, bool(old.quarantined)),
            sequence=int(m.sequence)), m.dataset)
        return CommittedVerdict(bundle=stored, node=self._node_from_row(row))

    def _commit_locked(
        self, verdict: Verdict, now_ms: int, update: StandingUpdate | None
    ) -> CommittedVerdict:
        """:meth:`commit_submission` with the node's rows locked and read first."""
        nodes, reps = NodeRow.__table__, ReputationRow.__table__

        def work(session: Connection) -> CommittedVerdict:
            m = (self._locked_node_row(session, verdict.node_id)
                 if verdict.node_id is not None and _storable(verdict.node_id) else None)
            stored: BundleRecord | None = None
            bundle = verdict.bundle
            changes: dict[str, Any] = {}
            rejected = int(m.rep_rejected or 0) if m is not None else 0
            if bundle is not None:
                if m is None:
                    raise FtisError(
                        ErrorCode.NODE_UNKNOWN, f"no node {bundle.node_id[:64]!r}"
                    )
                # quarantine as it was before this submission's evidence
                stored = self._answer_lease_and_insert(
                    session, bundle, now_ms, bool(m.rep_quarantined)
                )
                changes = {
                    "bundles_accepted": m.bundles_accepted + 1,
                    "reward_mismatches": m.reward_mismatches + bundle.reward_mismatches,
                    "completions": m.completions + bundle.completions,
                    "completion_tokens": m.completion_tokens + bundle.completion_tokens,
                    "last_seen_ms": max(now_ms, m.last_seen_ms),
                    "policy_version": bundle.policy_version,
                }
            elif m is not None:
                rejected += 1  # written below, with the standing when there is one
            session.execute(_Hot.insert_verdict, {
                "node_id": _clean(verdict.node_id), "bundle_id": _clean(verdict.bundle_id),
                "code": int(verdict.code), "reason": _clean(verdict.reason),
                "at_ms": now_ms})
            proof_id: int | None = None
            standing = None
            if m is not None:
                if verdict.proof_envelope is not None:
                    proofs = ProofRow.__table__
                    proof_id = int(session.execute(insert(proofs).values(
                        node_id=m.node_id, bundle_id=_clean(verdict.bundle_id) or "",
                        code=int(verdict.code), envelope=verdict.proof_envelope,
                        at_ms=now_ms).returning(proofs.c.id)).scalar_one())
                if verdict.evidence:
                    assert update is not None
                    standing = update(
                        Standing(m.rep_good, m.rep_bad, m.rep_updated_ms,
                                 bool(m.rep_quarantined)),
                        changes.get("bundles_accepted", m.bundles_accepted))
                    self._write_standing(session, m.node_id, standing,
                                         list(verdict.evidence), now_ms, rejected)
                elif bundle is None:
                    session.execute(reps.update().where(reps.c.node_id == m.node_id)
                                    .values(bundles_rejected=rejected))
                if verdict.ban_reason is not None:
                    changes.update(banned=True, ban_reason=verdict.ban_reason)
                if changes:
                    session.execute(nodes.update().where(nodes.c.node_id == m.node_id)
                                    .values(**changes))
            record = None
            if m is not None:
                standing_fields: dict[str, Any] = {} if standing is None else {
                    "rep_good": standing.good, "rep_bad": standing.bad,
                    "rep_updated_ms": standing.updated_at_ms,
                    "quarantined": standing.quarantined}
                record = dataclasses.replace(
                    self._node_from_row(m), bundles_rejected=rejected, **changes,
                    **standing_fields)
            return CommittedVerdict(bundle=stored, node=record, proof_id=proof_id)

        try:
            return self._hot_write(work)
        except IntegrityError as exc:
            if verdict.bundle is None:
                raise
            raise FtisError(
                ErrorCode.BUNDLE_REPLAYED,
                f"lease {verdict.bundle.lease_id} or bundle already stored",
            ) from exc

    def record_seen(self, seen: Mapping[str, tuple[int, int | None]]) -> None:
        if not seen:
            return
        nodes = NodeRow.__table__
        statement = (
            update(nodes)
            .where(nodes.c.node_id == bindparam("b_node"),
                   nodes.c.last_seen_ms <= bindparam("b_seen"))
            .values(
                last_seen_ms=bindparam("b_seen"),
                policy_version=func.coalesce(
                    bindparam("b_policy", type_=BigInteger), nodes.c.policy_version
                ),
            )
        )
        # node_id order: rows are locked in the same order as in apply_evidence_many
        params = [
            {"b_node": node_id, "b_seen": int(at), "b_policy": policy}
            for node_id, (at, policy) in sorted(seen.items())
            if _storable(node_id)
        ]
        if not params:
            return
        with self._write() as session:
            session.connection().execute(statement, params)

    def record_relay_served(self, served: Mapping[str, int]) -> None:
        nodes = NodeRow.__table__
        params = [{"b_node": node_id, "b_seq": int(seq)}
                  for node_id, seq in sorted(served.items()) if _storable(node_id)]
        if not params:
            return
        statement = (
            update(nodes)
            .where(nodes.c.node_id == bindparam("b_node"),
                   nodes.c.relay_served_seq < bindparam("b_seq"))
            .values(relay_served_seq=bindparam("b_seq"))
        )
        with self._write() as session:
            session.connection().execute(statement, params)

    def apply_evidence_many(
        self, events: list[tuple[str, Evidence]], now_ms: int,
        update: Callable[[list[Evidence]], StandingUpdate],
        counted: tuple[str, Sequence[str]] | None = None,
    ) -> dict[str, NodeRecord]:
        by_node: dict[str, list[Evidence]] = {}
        for node_id, evidence in events:
            by_node.setdefault(node_id, []).append(evidence)
        counted_rows = [] if counted is None else [
            {"reporter_node_id": counted[0], "bundle_id": b, "at_ms": now_ms}
            for b in dict.fromkeys(counted[1]) if _storable(counted[0], b)]
        if not by_node and not counted_rows:
            return {}
        try:
            return self._apply_evidence_many(by_node, now_ms, update, counted_rows)
        except IntegrityError as exc:
            if not counted_rows:
                raise
            raise FtisError(ErrorCode.FEEDBACK_INVALID,
                            "feedback on bundles this reporter already reported") from exc

    def _apply_evidence_many(
        self, by_node: dict[str, list[Evidence]], now_ms: int,
        update: Callable[[list[Evidence]], StandingUpdate], counted_rows: list[dict[str, Any]],
    ) -> dict[str, NodeRecord]:
        ids = sorted(by_node)
        unknown = [n for n in ids if not _storable(n)]
        if unknown:
            raise FtisError(ErrorCode.NODE_UNKNOWN, f"no node {_clean(unknown[0][:64])!r}")
        with self._write() as session:
            if counted_rows:
                session.execute(insert(FeedbackBundleRow.__table__), counted_rows)
            nodes = {
                row.node_id: row
                for row in session.scalars(
                    select(NodeRow)
                    .where(NodeRow.node_id.in_(ids))
                    .order_by(NodeRow.node_id)
                    .with_for_update()
                )
            }
            missing = [n for n in ids if n not in nodes]
            if missing:
                raise FtisError(ErrorCode.NODE_UNKNOWN, f"no node {missing[0][:64]!r}")
            reps = {
                row.node_id: row
                for row in session.scalars(
                    select(ReputationRow)
                    .where(ReputationRow.node_id.in_(ids))
                    .order_by(ReputationRow.node_id)
                    .with_for_update()
                )
            }
            out: dict[str, NodeRecord] = {}
            for node_id, node_events in by_node.items():
                node = nodes[node_id]
                rep = reps.get(node_id) or self._reputation_row(session, node)
                self._apply_update(
                    session, node, rep, node_events, now_ms, update(node_events)
                )
            session.flush()
            for node_id in by_node:
                out[node_id] = self._node_record(nodes[node_id], reps.get(node_id)
                                                 or session.get(ReputationRow, node_id))
            return out

    def lease_block(
        self, node_id: str, count: int, now_ms: int, max_outstanding: int,
        make: Callable[[int], list[LeaseRecord]],
    ) -> list[LeaseRecord]:
        """See :meth:`State.lease_block`. Task numbers come from a block of
        :attr:`task_block` numbers this process reserved from the shared counter (one
        counter update per block, not per lease); see :meth:`_take_numbers`."""
        if count < 0:
            raise ValueError(f"lease_block: count {count} < 0")

        def work(session: Connection) -> tuple[list[LeaseRecord], tuple[int, int] | None]:
            # The node's row lock serialises lease_block calls for one node across
            # workers (on SQLite, BEGIN IMMEDIATE serialises every writer).
            locked = (session.execute(_Hot.lock_node_id, {"node_id": node_id}).first()
                      if _storable(node_id) else None)
            if locked is None:
                raise FtisError(ErrorCode.NODE_UNKNOWN, f"no node {_clean(node_id[:64])!r}")
            outstanding = int(session.scalar(
                _Hot.outstanding, {"node_id": node_id, "now": now_ms}) or 0)
            if outstanding + count > max_outstanding:
                raise FtisError(
                    ErrorCode.LEASE_LIMIT,
                    f"{outstanding} leases outstanding + {count} requested > "
                    f"limit {max_outstanding}; submit or let them expire",
                )
            if count == 0:
                return [], None
            start, pending = self._take_numbers(session, count)
            leases = list(make(start))
            if leases:
                session.execute(_Hot.insert_leases, [self._lease_values(x) for x in leases])
            return leases, pending

        leases, pending = self._hot_write(work)
        if pending is not None:  # committed: its remaining numbers are ours to hand out
            with self._block_lock:  # the longer rest is kept (the newer on a tie)
                if pending[1] - pending[0] >= self._block[1] - self._block[0]:
                    self._block = pending
        return leases

    def _take_numbers(self, conn: Connection, count: int) -> tuple[int, tuple[int, int] | None]:
        """``count`` consecutive task numbers: ``(start, pending)``.

        From this process's block when it has ``count`` left (no statement at all).
        Otherwise a new block of ``max(task_block, count)`` numbers is reserved from the
        shared counter in the caller's transaction; its rest comes back as ``pending``
        (``[next, end)``), which the caller keeps only once that transaction committed,
        so a block whose reservation rolled back is never handed out. Numbers are never
        handed out twice: every block is a committed counter range of its own process,
        and numbers are taken from it under a lock. Numbers can be skipped (a gap):
        the rest of a block too short for a request, numbers taken by a transaction
        that then rolled back, and the unused rest of a block when the process dies
        (:meth:`close` gives the rest back when no other process reserved after it).
        A gap skips tasks of the mix, nothing else: task number ``n`` is still
        ``TaskSource.at(n)`` everywhere."""
        with self._block_lock:
            start, end = self._block
            if end - start >= count:
                self._block = (start + count, end)
                return start, None
        size = max(self.task_block, count)
        start = self._reserve(conn, TASK_DRAWS, size)
        return start, (start + count, start + size)

    @staticmethod
    def _reserve(session: Session | Connection, name: str, n: int) -> int:
        """Advance counter ``name`` by ``n``; returns its value before."""
        counters = CounterRow.__table__
        after = session.execute(_Hot.reserve, {"b_name": name, "b_n": n}).scalar()
        if after is None:  # the row is made by revision 0002; only if someone removed it
            issued = int(session.scalar(select(func.count(LeaseRow.lease_id))) or 0)
            session.execute(insert(counters).values(name=name, value=issued + n))
            return issued
        return int(after) - n

    def task_numbers_reserved(self) -> int:
        with self._read() as session:
            value = session.scalar(select(CounterRow.value).where(CounterRow.name == TASK_DRAWS))
            return int(value or 0)

    # -- nodes -------------------------------------------------------------------
    def upsert_node(
        self,
        *,
        node_id: str,
        public_key: bytes,
        display_name: str,
        model_card: bytes,
        fingerprint: str,
        vocab_size: int,
        client_version: str,
        now_ms: int,
        capabilities: Sequence[str] = (),
    ) -> NodeRecord:
        for attempt in range(2):
            try:
                return self._upsert_node(
                    node_id, public_key, display_name, model_card, fingerprint, vocab_size,
                    client_version, now_ms, capabilities,
                )
            except IntegrityError:  # a concurrent registration of the same node
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def _upsert_node(
        self, node_id: str, public_key: bytes, display_name: str, model_card: bytes,
        fingerprint: str, vocab_size: int, client_version: str, now_ms: int,
        capabilities: Sequence[str] = (),
    ) -> NodeRecord:
        with self._write() as session:
            row = session.get(NodeRow, node_id, with_for_update=True)
            if row is None:
                row = NodeRow(
                    node_id=node_id,
                    public_key=public_key,
                    registered_at_ms=now_ms,
                    policy_version=0,
                    banned=False,
                    ban_reason="",
                    bundles_accepted=0,
                    reward_mismatches=0,
                    completions=0,
                    completion_tokens=0,
                    latest_metrics={},
                    latest_metrics_step=0,
                )
                session.add(row)
                rep: ReputationRow | None = ReputationRow(
                    node_id=node_id, good=0.0, bad=0.0, updated_ms=now_ms, quarantined=False,
                    bundles_rejected=0,
                )
                session.add(rep)
            else:
                rep = session.get(ReputationRow, node_id)
            row.display_name = display_name
            row.model_card = model_card
            row.fingerprint = fingerprint
            row.vocab_size = vocab_size
            row.client_version = client_version
            row.capabilities = ",".join(capabilities)
            row.last_seen_ms = now_ms
            session.flush()
            return self._node_record(row, rep)

    def get_node(self, node_id: str) -> NodeRecord | None:
        with self._snapshot_conn() as conn:
            return self._read_node(conn, node_id)

    def resolve_node(self, id_or_prefix: str) -> NodeRecord:
        if not id_or_prefix:
            raise FtisError(ErrorCode.NODE_UNKNOWN, "empty node id")
        if not _storable(id_or_prefix):
            raise FtisError(ErrorCode.NODE_UNKNOWN, f"no node matching {id_or_prefix[:64]!r}")
        with self._read() as session:
            record = self._read_node(session, id_or_prefix)
            if record is not None:
                return record
            pairs = session.execute(
                self._nodes_query()
                .where(NodeRow.node_id.like(_escape_like(id_or_prefix) + "%", escape="\\"))
                .limit(2)
            ).all()
            if len(pairs) != 1:
                what = "no node" if not pairs else "several nodes"
                raise FtisError(ErrorCode.NODE_UNKNOWN, f"{what} matching {id_or_prefix[:64]!r}")
            return self._node_record(*pairs[0])

    def list_nodes(self) -> list[NodeRecord]:
        with self._read() as session:
            pairs = session.execute(
                self._nodes_query().order_by(NodeRow.registered_at_ms, NodeRow.node_id)
            ).all()
            return [self._node_record(row, rep) for row, rep in pairs]

    def set_ban(self, node_id: str, banned: bool, reason: str = "") -> NodeRecord:
        with self._write() as session:
            row = session.get(NodeRow, node_id, with_for_update=True)
            if row is None:
                raise FtisError(ErrorCode.NODE_UNKNOWN, f"no node {node_id[:64]!r}")
            row.banned = banned
            row.ban_reason = reason if banned else ""
            session.flush()
            return self._node_record(row, session.get(ReputationRow, node_id))

    # -- leases ------------------------------------------------------------------
    def count_outstanding_leases(self, node_id: str | None, now_ms: int) -> int:
        query = select(func.count(LeaseRow.lease_id)).where(
            LeaseRow.bundle_id.is_(None), LeaseRow.deadline_ms >= now_ms
        )
        if node_id is not None:
            query = query.where(LeaseRow.node_id == node_id)
        with self._read() as session:
            return int(session.scalar(query) or 0)

    def insert_leases(self, leases: list[LeaseRecord]) -> None:
        with self._write() as session:
            if leases:
                session.execute(_Hot.insert_leases, [self._lease_values(x) for x in leases])

    def get_lease_by_task(self, task_id: str) -> LeaseRecord | None:
        if not _storable(task_id):
            return None
        with self._read() as session:
            row = session.scalar(select(LeaseRow).where(LeaseRow.task_id == task_id))
            return None if row is None else self._lease_record(row)

    # -- bundles -----------------------------------------------------------------
    def store_bundle(self, bundle: NewBundle, now_ms: int) -> BundleRecord:
        try:
            with self._write() as session:
                quarantined = bool(
                    session.scalar(
                        select(ReputationRow.quarantined).where(
                            ReputationRow.node_id == bundle.node_id
                        )
                    )
                )
                record = self._answer_lease_and_insert(session, bundle, now_ms, quarantined)
                session.execute(
                    update(NodeRow)
                    .where(NodeRow.node_id == bundle.node_id)
                    .values(
                        bundles_accepted=NodeRow.bundles_accepted + 1,
                        reward_mismatches=NodeRow.reward_mismatches + bundle.reward_mismatches,
                        completions=NodeRow.completions + bundle.completions,
                        completion_tokens=NodeRow.completion_tokens + bundle.completion_tokens,
                        last_seen_ms=now_ms,
                        policy_version=bundle.policy_version,
                    )
                )
                reason = (
                    f"accepted; {bundle.reward_mismatches} reward mismatches"
                    if bundle.reward_mismatches
                    else "accepted"
                )
                session.add(
                    VerdictRow(
                        node_id=bundle.node_id,
                        bundle_id=bundle.bundle_id,
                        code=0,
                        reason=reason,
                        at_ms=now_ms,
                    )
                )
                session.flush()
                return record
        except IntegrityError as exc:
            raise FtisError(
                ErrorCode.BUNDLE_REPLAYED, f"lease {bundle.lease_id} or bundle already stored"
            ) from exc

    def record_rejection(
        self, node_id: str | None, bundle_id: str | None, code: int, reason: str, now_ms: int
    ) -> None:
        with self._write() as session:
            session.add(
                VerdictRow(
                    node_id=_clean(node_id),
                    bundle_id=_clean(bundle_id),
                    code=int(code),
                    reason=_clean(reason),
                    at_ms=now_ms,
                )
            )
            if node_id is not None and int(code) != 0:
                self._bump_rejected(session, node_id)

    def _bump_rejected(self, session: Session, node_id: str) -> None:
        """``bundles_rejected + 1`` of a known node (unknown ones are skipped)."""
        reps = ReputationRow.__table__
        bumped = cast("CursorResult[Any]", session.execute(  # an UPDATE's result
            update(reps)
            .where(reps.c.node_id == node_id)
            .values(bundles_rejected=reps.c.bundles_rejected + 1)
        ))
        if bumped.rowcount == 0:  # a node without a reputation row (never after 0002)
            node = session.get(NodeRow, node_id, with_for_update=True)
            if node is not None:
                self._reputation_row(session, node).bundles_rejected = 1

    def pull_bundles(
        self,
        *,
        requester_id: str,
        cursor: int,
        limit: int,
        max_bytes: int,
        fingerprint: str = "",
        skip_zero_variance: bool = False,
        branch: str | None = None,
        audit: AuditRelay | None = None,
    ) -> tuple[list[BundleRecord], int]:
        mode = 0 if audit is None else 2 if audit.established else 1
        cache = self._envelopes
        query = _Hot.relay_pages[(bool(fingerprint), bool(skip_zero_variance),
                                  branch is not None, mode, cache is None)]
        params = {"cursor": int(cursor), "requester": requester_id, "limit": int(limit),
                  "fingerprint": fingerprint, "branch": branch,
                  "probation_bundles": audit.probation_bundles if audit else 0,
                  "audit_fp": audit.fingerprint if audit else ""}
        rows: list[Any] = []
        used = 0
        full = False
        max_seq = None
        with self._snapshot_conn() as conn:
            with conn.execute(query, params) as result:  # one consistent snapshot
                for m in result:  # (closed when the page is full: no statement left open)
                    max_seq = m.max_seq
                    if rows and used + m.size_bytes > max_bytes:
                        full = True
                        break
                    rows.append(m)
                    used += m.size_bytes
            if max_seq is None:  # an empty page: the cursor moves to the newest bundle
                max_seq = conn.scalar(_Hot.max_sequence)
            if cache is None:
                envelopes = {m.sequence: m.envelope for m in rows}
            else:
                envelopes, missing = cache.take([m.sequence for m in rows])
                if missing:  # envelopes never change: a later statement reads the same bytes
                    for seq, envelope in conn.execute(_Hot.envelopes, {"sequences": missing}):
                        envelope = bytes(envelope)
                        envelopes[seq] = envelope
                        cache.put(seq, envelope)
        page = [BundleRecord(
            sequence=m.sequence, bundle_id=m.bundle_id, node_id=m.node_id,
            task_id=m.task_id, lease_id=m.lease_id, dataset=m.dataset,
            fingerprint=m.fingerprint, envelope=envelopes[m.sequence],
            verified_rewards=[float(r) for r in m.verified_rewards],
            mean_reward=m.mean_reward, zero_variance=m.zero_variance,
            completions=m.completions, completion_tokens=m.completion_tokens,
            size_bytes=m.size_bytes, reward_mismatches=m.reward_mismatches,
            policy_version=m.policy_version, stored_at_ms=m.stored_at_ms,
            text_verified=bool(m.text_verified),
            sender_standing=Standing(float(m.good or 0), float(m.bad or 0),
                                     int(m.updated_ms or 0)),
            question=TaskEntry.from_json(m.entry_json).question,
            audit_only=bool(m.audit_only)) for m in rows]
        if len(page) >= limit:
            full = True
        next_cursor = page[-1].sequence if full and page else int(max_seq or 0)
        return page, next_cursor

    def list_bundles(self, node_prefix: str = "", limit: int = 50) -> list[BundleRecord]:
        query = (
            select(BundleRow, LeaseRow.dataset)
            .join(LeaseRow, LeaseRow.lease_id == BundleRow.lease_id)
            .order_by(BundleRow.sequence.desc())
            .limit(limit)
        )
        if not _storable(node_prefix):
            return []
        if node_prefix:
            query = query.where(BundleRow.node_id.like(_escape_like(node_prefix) + "%",
                                                       escape="\\"))
        with self._read() as session:
            return [self._bundle_record(row, ds) for row, ds in session.execute(query)]

    def bundle_owners(self, bundle_ids: list[str]) -> dict[str, tuple[str, bool, int]]:
        wanted = sorted({b for b in bundle_ids if _storable(b)})
        if not wanted:
            return {}
        with self._read() as session:
            rows = session.execute(
                select(BundleRow.bundle_id, BundleRow.node_id, BundleRow.text_verified,
                       BundleRow.sequence).where(BundleRow.bundle_id.in_(wanted))
            ).all()
            return {b: (n, bool(t), int(q)) for b, n, t, q in rows}

    def get_bundle(self, bundle_id: str) -> BundleRecord | None:
        if not _storable(bundle_id):
            return None
        query = (select(BundleRow, LeaseRow.dataset)
                 .join(LeaseRow, LeaseRow.lease_id == BundleRow.lease_id)
                 .where(BundleRow.bundle_id == bundle_id))
        with self._read() as session:
            found = session.execute(query).first()
            return None if found is None else self._bundle_record(found[0], found[1])

    def reported_bundles(self, reporter_id: str, bundle_ids: list[str]) -> set[str]:
        wanted = sorted({b for b in bundle_ids if _storable(b)})
        if not wanted or not _storable(reporter_id):
            return set()
        with self._read() as session:
            return set(session.scalars(
                select(FeedbackBundleRow.bundle_id).where(
                    FeedbackBundleRow.reporter_node_id == reporter_id,
                    FeedbackBundleRow.bundle_id.in_(wanted))))

    def count_text_unverified(self, node_id: str) -> tuple[int, int]:
        with self._read() as session:
            total, unverified = session.execute(
                select(
                    func.count(BundleRow.sequence),
                    func.coalesce(
                        func.sum(case((BundleRow.text_verified.is_(False), 1), else_=0)), 0
                    ),
                ).where(BundleRow.node_id == node_id)
            ).one()
            return int(total), int(unverified)

    # -- tokenizers ----------------------------------------------------------------
    def store_tokenizer(
        self,
        fingerprint: str,
        tokenizer_json_gz: bytes,
        vocab_size: int,
        uploaded_by: str,
        now_ms: int,
    ) -> bool:
        try:
            with self._write() as session:
                if session.get(TokenizerRow, fingerprint) is not None:
                    return False
                session.add(
                    TokenizerRow(
                        fingerprint=fingerprint,
                        tokenizer_json_gz=tokenizer_json_gz,
                        vocab_size=vocab_size,
                        uploaded_by=uploaded_by,
                        at_ms=now_ms,
                    )
                )
                return True
        except IntegrityError:  # a concurrent upload of the same tokenizer
            return False

    def get_tokenizer(self, fingerprint: str) -> bytes | None:
        if not _storable(fingerprint):
            return None
        with self._read() as session:
            return session.scalar(
                select(TokenizerRow.tokenizer_json_gz).where(
                    TokenizerRow.fingerprint == fingerprint
                )
            )

    def has_tokenizer(self, fingerprint: str) -> bool:
        if not _storable(fingerprint):
            return False
        with self._read() as session:
            found = session.scalar(
                select(TokenizerRow.fingerprint).where(TokenizerRow.fingerprint == fingerprint)
            )
            return found is not None

    # -- reputation ------------------------------------------------------------------
    @staticmethod
    def _reputation_row(session: Session, node: NodeRow) -> ReputationRow:
        """The node's reputation row, locked (made if missing: only for nodes registered
        before the reputation table existed, and revision 0002 makes those)."""
        rep = session.get(ReputationRow, node.node_id, with_for_update=True)
        if rep is None:
            rep = ReputationRow(
                node_id=node.node_id,
                good=0.0,
                bad=0.0,
                updated_ms=node.registered_at_ms,
                quarantined=False,
                bundles_rejected=0,
            )
            session.add(rep)
        return rep

    def _locked_node(self, session: Session, node_id: str) -> NodeRow:
        node = session.get(NodeRow, node_id, with_for_update=True)
        if node is None:
            raise FtisError(ErrorCode.NODE_UNKNOWN, f"no node {node_id[:64]!r}")
        return node

    @staticmethod
    def _apply_update(
        session: Session, node: NodeRow, rep: ReputationRow, events: list[Evidence],
        now_ms: int, update: StandingUpdate,
    ) -> None:
        """``rep := update(rep, node.bundles_accepted)`` (both rows locked) and one
        evidence row per event."""
        new = update(
            Standing(rep.good, rep.bad, rep.updated_ms, bool(rep.quarantined)),
            node.bundles_accepted,
        )
        rep.good, rep.bad = float(new.good), float(new.bad)
        rep.updated_ms, rep.quarantined = int(new.updated_at_ms), bool(new.quarantined)
        session.add_all(
            EvidenceRow(
                node_id=node.node_id,
                at_ms=now_ms,
                kind=_clean(e.kind),
                weight=float(e.weight),
                detail=_clean(e.detail[:2000]),
                reporter_node_id=_clean(e.reporter_node_id),
                bundle_id=_clean(e.bundle_id),
            )
            for e in events
        )

    def apply_evidence(
        self, node_id: str, events: list[Evidence], now_ms: int, update: StandingUpdate
    ) -> NodeRecord:
        with self._write() as session:
            node = self._locked_node(session, node_id)
            rep = self._reputation_row(session, node)
            self._apply_update(session, node, rep, events, now_ms, update)
            session.flush()
            return self._node_record(node, rep)

    def list_evidence(self, node_id: str, limit: int = 50) -> list[EvidenceRecord]:
        with self._read() as session:
            rows = session.scalars(
                select(EvidenceRow)
                .where(EvidenceRow.node_id == node_id)
                .order_by(EvidenceRow.id.desc())
                .limit(limit)
            ).all()
            return [
                EvidenceRecord(
                    id=r.id,
                    node_id=r.node_id,
                    at_ms=r.at_ms,
                    kind=r.kind,
                    weight=r.weight,
                    detail=r.detail,
                    reporter_node_id=r.reporter_node_id,
                    bundle_id=r.bundle_id,
                )
                for r in rows
            ]

    @staticmethod
    def _negative_reporters(session: Session | Connection, sender_id: str,
                            since_ms: int) -> set[str]:
        rows = session.scalars(_Hot.negative_reporters, {"node_id": sender_id,
                                                          "since": since_ms})
        return {r for r in rows if r}

    def record_audits(self, reporter_id: str, verdicts: Mapping[str, bool], now_ms: int,
                      decide: Callable[[int, int], int]) -> dict[str, tuple[int, int, int]]:
        senders = sorted(s for s in verdicts if _storable(s) and s != reporter_id)
        if not senders or not _storable(reporter_id):
            return {}
        out: dict[str, tuple[int, int, int]] = {}
        with self._write() as session:
            # lock the senders' node rows in node_id order, as everywhere
            old = {n: int(a or 0) for n, a in session.execute(
                select(NodeRow.node_id, NodeRow.audit_status)
                .where(NodeRow.node_id.in_(senders)).with_for_update())}
            for sender in senders:
                if sender not in old:
                    continue
                plausible = bool(verdicts[sender])
                changed = cast("CursorResult[Any]", session.execute(  # an UPDATE's result
                    update(AuditReportRow)
                    .where(AuditReportRow.sender_node_id == sender,
                           AuditReportRow.reporter_node_id == reporter_id)
                    .values(plausible=plausible, at_ms=int(now_ms)))).rowcount
                if not changed:
                    session.add(AuditReportRow(sender_node_id=sender,
                                               reporter_node_id=reporter_id,
                                               plausible=plausible, at_ms=int(now_ms)))
                    session.flush()
                counts = dict(session.execute(
                    select(AuditReportRow.plausible, func.count())
                    .where(AuditReportRow.sender_node_id == sender)
                    .group_by(AuditReportRow.plausible)).all())
                good = int(counts.get(True, 0))
                bad = int(counts.get(False, 0))
                status = int(decide(good, bad))
                if status != old[sender]:
                    session.execute(update(NodeRow).where(NodeRow.node_id == sender)
                                    .values(audit_status=status))
                out[sender] = (old[sender], status, bad)
        return out

    def set_audit_status(self, node_id: str, status: int) -> bool:
        if not _storable(node_id):
            return False
        nodes = NodeRow.__table__

        def work(conn: Connection) -> bool:  # on the submit path: through the group commit
            done = cast("CursorResult[Any]", conn.execute(  # an UPDATE's result
                update(nodes).where(nodes.c.node_id == node_id)
                .values(audit_status=int(status))))
            return bool(done.rowcount)

        return self._hot_write(work)

    def audit_reports(self, sender_id: str) -> dict[str, bool]:
        if not _storable(sender_id):
            return {}
        with self._read() as session:
            return {r: bool(p) for r, p in session.execute(
                select(AuditReportRow.reporter_node_id, AuditReportRow.plausible)
                .where(AuditReportRow.sender_node_id == sender_id))}

    def negative_reporters(self, sender_id: str, since_ms: int) -> set[str]:
        if not _storable(sender_id):
            return set()
        with self._read() as session:
            return self._negative_reporters(session, sender_id, since_ms)

    def feedback_used(self, reporter_id: str, sender_id: str, since_ms: int) -> tuple[float, float]:
        positive = case((EvidenceRow.weight > 0, EvidenceRow.weight), else_=0.0)
        negative = case((EvidenceRow.weight < 0, -EvidenceRow.weight), else_=0.0)
        if not _storable(reporter_id, sender_id):
            return 0.0, 0.0
        with self._read() as session:
            pos, neg = session.execute(
                select(
                    func.coalesce(func.sum(positive), 0.0), func.coalesce(func.sum(negative), 0.0)
                ).where(
                    EvidenceRow.reporter_node_id == reporter_id,
                    EvidenceRow.node_id == sender_id,
                    EvidenceRow.kind == reputation.FEEDBACK,
                    EvidenceRow.at_ms >= since_ms,
                )
            ).one()
            return float(pos), float(neg)

    def reset_bad_evidence(self, node_id: str, now_ms: int) -> NodeRecord:
        with self._write() as session:
            node = self._locked_node(session, node_id)
            rep = self._reputation_row(session, node)
            removed = rep.bad
            rep.bad = 0.0
            rep.quarantined = False
            session.add(
                EvidenceRow(
                    node_id=node_id,
                    at_ms=now_ms,
                    kind=reputation.OPERATOR_RESET,
                    weight=0.0,
                    detail=f"operator unban: bad evidence {removed:.3g} reset to 0",
                    reporter_node_id="",
                    bundle_id="",
                )
            )
            session.flush()
            return self._node_record(node, rep)

    # -- MERIT branches ------------------------------------------------------------------
    def _lock_branches(self, session: Session) -> None:
        """Serialise branch changes: PostgreSQL takes a transaction-level advisory lock
        (rows that do not exist yet cannot be locked); SQLite's BEGIN IMMEDIATE already
        serialises every writer."""
        if self.is_postgres:
            session.execute(text("SELECT pg_advisory_xact_lock(:key)"),
                            {"key": _PG_BRANCHES_LOCK})

    def define_branches(self, branches: Sequence[BranchRecord], now_ms: int,
                        replace: bool = False) -> list[BranchRecord]:
        check_branches(branches)  # before any I/O: the call's own consistency
        for b in branches:
            if not _storable(b.name, *b.families):
                raise FtisError(ErrorCode.BRANCH_INVALID, f"branch {b.name!r}: NUL in a name")
        new = {b.name for b in branches}
        with self._write() as session:
            self._lock_branches(session)
            # branch rows before node rows (assign_branches' order: no deadlock)
            rows = {r.name: r for r in session.scalars(select(BranchRow).with_for_update())}
            kept = [] if replace else [self._branch_record(r) for name, r in rows.items()
                                       if name not in new]
            check_branches(branches, kept)
            dropped = [name for name in rows if replace and name not in new]
            if dropped:
                session.execute(update(NodeRow).where(NodeRow.branch.in_(dropped))
                                .values(branch=None))
                for name in dropped:
                    session.delete(rows[name])
            for b in branches:
                row = rows.get(b.name)
                if row is None:
                    session.add(BranchRow(name=b.name, families=list(b.families),
                                          tokens=float(b.tokens), defined_at_ms=now_ms))
                else:
                    row.families, row.tokens = list(b.families), float(b.tokens)
                    row.defined_at_ms = now_ms
            session.flush()
            return self._list_branches(session)

    @staticmethod
    def _branch_record(row: BranchRow, node_ids: tuple[str, ...] = (),
                       bundles: int = 0) -> BranchRecord:
        return BranchRecord(name=row.name, families=tuple(row.families or ()),
                            tokens=float(row.tokens or 0.0),
                            defined_at_ms=int(row.defined_at_ms), node_ids=node_ids,
                            bundles_accepted=bundles)

    def _list_branches(self, session: Session, detail: bool = True) -> list[BranchRecord]:
        rows = list(session.scalars(select(BranchRow).order_by(BranchRow.name)))
        if not rows or not detail:
            return [self._branch_record(r) for r in rows]
        members: dict[str, list[str]] = {}
        for node_id, branch in session.execute(
                select(NodeRow.node_id, NodeRow.branch).where(NodeRow.branch.is_not(None))
                .order_by(NodeRow.registered_at_ms, NodeRow.node_id)):
            members.setdefault(str(branch), []).append(node_id)
        # answered leases per branch (an answered lease is an accepted bundle)
        bundles = dict(session.execute(
            select(LeaseRow.branch, func.count(LeaseRow.lease_id))
            .where(LeaseRow.branch.is_not(None), LeaseRow.bundle_id.is_not(None))
            .group_by(LeaseRow.branch)).tuples().all())
        return [self._branch_record(r, tuple(members.get(r.name, ())),
                                    int(bundles.get(r.name, 0))) for r in rows]

    def list_branches(self, detail: bool = True) -> list[BranchRecord]:
        with self._read() as session:
            return self._list_branches(session, detail)

    def assign_branches(self, assignments: Mapping[str, str | None]) -> list[NodeRecord]:
        if not assignments:
            return []
        for node_id, branch in assignments.items():
            if not _storable(node_id):
                raise FtisError(ErrorCode.NODE_UNKNOWN, f"no node {_clean(node_id[:64])!r}")
            if branch is not None and not _storable(branch):
                raise FtisError(ErrorCode.BRANCH_UNKNOWN, f"no branch {_clean(branch[:64])!r}")
        with self._write() as session:
            wanted = sorted({b for b in assignments.values() if b is not None})
            # FOR SHARE: a concurrent define_branches cannot drop them before we commit
            found = set(session.scalars(select(BranchRow.name).where(
                BranchRow.name.in_(wanted)).with_for_update(read=True))) if wanted else set()
            missing = [b for b in wanted if b not in found]
            if missing:
                raise FtisError(ErrorCode.BRANCH_UNKNOWN, f"no branch {missing[0][:64]!r}")
            ids = sorted(assignments)  # lock in node_id order, as everywhere
            locked = set(session.scalars(select(NodeRow.node_id).where(
                NodeRow.node_id.in_(ids)).with_for_update()))
            unknown = [i for i in ids if i not in locked]
            if unknown:
                raise FtisError(ErrorCode.NODE_UNKNOWN, f"no node {_clean(unknown[0][:64])!r}")
            for node_id in ids:
                session.execute(update(NodeRow).where(NodeRow.node_id == node_id)
                                .values(branch=assignments[node_id]))
            out = []
            for node_id in assignments:
                record = self._read_node(session, node_id)
                assert record is not None
                out.append(record)
            return out

    # -- settings ----------------------------------------------------------------------
    def get_setting(self, key: str) -> str | None:
        with self._read() as session:
            return session.scalar(select(SettingRow.value).where(SettingRow.key == key))

    def put_setting(self, key: str, value: str, now_ms: int) -> None:
        with self._write() as session:
            row = session.get(SettingRow, key, with_for_update=True)
            if row is None:
                session.add(SettingRow(key=key, value=value, at_ms=now_ms))
            else:
                row.value, row.at_ms = value, now_ms

    # -- metrics and stats -----------------------------------------------------------
    def record_metrics(
        self, node_id: str, step: int, values: dict[str, float], now_ms: int
    ) -> None:
        encoded = _encode_metrics(values)
        with self._write() as session:
            session.add(MetricRow(node_id=node_id, step=step, values=encoded, at_ms=now_ms))
            session.execute(
                update(NodeRow)
                .where(NodeRow.node_id == node_id)
                .values(latest_metrics=encoded, latest_metrics_step=step, last_seen_ms=now_ms)
            )

    def rejections_by_code(self, node_id: str | None = None) -> dict[int, int]:
        query = (
            select(VerdictRow.code, func.count(VerdictRow.id))
            .where(VerdictRow.code != 0)
            .group_by(VerdictRow.code)
        )
        if node_id is not None:
            query = query.where(VerdictRow.node_id == node_id)
        with self._read() as session:
            return {int(code): int(n) for code, n in session.execute(query)}

    def stats(self, now_ms: int, active_window_ms: int) -> StatsRecord:
        with self._read() as session:
            nodes = session.scalar(select(func.count(NodeRow.node_id))) or 0
            active = session.scalar(
                select(func.count(NodeRow.node_id)).where(
                    NodeRow.last_seen_ms >= now_ms - active_window_ms
                )
            )
            banned = session.scalar(
                select(func.count(NodeRow.node_id)).where(NodeRow.banned.is_(True))
            )
            quarantined = session.scalar(
                select(func.count(NodeRow.node_id))
                .join(ReputationRow, ReputationRow.node_id == NodeRow.node_id)
                .where(ReputationRow.quarantined.is_(True), NodeRow.banned.is_(False))
            )
            outstanding = session.scalar(
                select(func.count(LeaseRow.lease_id)).where(
                    LeaseRow.bundle_id.is_(None), LeaseRow.deadline_ms >= now_ms
                )
            )
            accepted, completions, tokens, reward_sum, size = session.execute(
                select(
                    func.count(BundleRow.sequence),
                    func.coalesce(func.sum(BundleRow.completions), 0),
                    func.coalesce(func.sum(BundleRow.completion_tokens), 0),
                    func.coalesce(func.sum(BundleRow.mean_reward * BundleRow.completions), 0.0),
                    func.coalesce(func.sum(BundleRow.size_bytes), 0),
                )
            ).one()
        by_code = self.rejections_by_code()
        return StatsRecord(
            nodes=int(nodes),
            active_nodes=int(active or 0),
            banned_nodes=int(banned or 0),
            leases_outstanding=int(outstanding or 0),
            bundles_accepted=int(accepted),
            bundles_rejected=sum(by_code.values()),
            completions=int(completions),
            completion_tokens=int(tokens),
            mean_verified_reward=float(reward_sum) / int(completions) if completions else 0.0,
            rejections_by_code=by_code,
            bundle_bytes=int(size),
            quarantined_nodes=int(quarantined or 0),
        )

    def close(self) -> None:
        """Give back the unused rest of this process's task block when nobody reserved
        after it (one conditional update; otherwise the rest stays a gap), then release
        the connections."""
        with self._block_lock:
            start, end = self._block
            self._block = (0, 0)
        if end > start:
            with contextlib.suppress(SQLAlchemyError), self._write_conn() as conn:
                counters = CounterRow.__table__
                conn.execute(update(counters).where(counters.c.name == TASK_DRAWS,
                                                    counters.c.value == end)
                             .values(value=start))
        if self._writers is not None:
            self._writers.shutdown(wait=True)
        self.engine.dispose()
        if self._sqlite_lock is not None:
            self._sqlite_lock.close()


def open_state(url: str) -> SqlState:
    """Open (and migrate) the database at ``url``. Raises DatabaseError."""
    return SqlState(url)


def dump_tables(state: SqlState, tables: tuple[str, ...] = ("nodes", "leases", "bundles")) -> dict:
    """Every row of ``tables`` as sorted tuples (for before/after comparisons in tests)."""
    out: dict[str, list[tuple[Any, ...]]] = {}
    with state._read() as session:  # noqa: SLF001 - same module family
        for name in tables:
            table = Base.metadata.tables[name]
            rows = session.execute(select(table)).all()
            out[name] = sorted(tuple(json.dumps(v, default=repr) for v in r) for r in rows)
    return out
