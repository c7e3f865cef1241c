"""SQLAlchemy 2 implementation of :class:`State` (SQLite file, ``sqlite://`` in memory,
PostgreSQL).

SQLite connections run with ``journal_mode=WAL``, ``synchronous=FULL`` and foreign keys
on; all operations on SQLite are serialised by a process-wide lock (SQLite has one
writer anyway, and the in-memory database shares one connection).
"""

from __future__ import annotations

import contextlib
import json
import math
import threading
from collections.abc import Iterator
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
    create_engine,
    event,
    func,
    select,
    update,
)
from sqlalchemy.exc import IntegrityError, SQLAlchemyError
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, sessionmaker
from sqlalchemy.pool import StaticPool

from ftis.coordinator.state.base import (
    BundleRecord,
    DatabaseError,
    LeaseRecord,
    NewBundle,
    NodeRecord,
    State,
    StatsRecord,
)
from ftis.protocol.errors import ErrorCode, FtisError
from ftis.tasks.source import TaskEntry

_Id = BigInteger().with_variant(Integer, "sqlite")  # SQLite autoincrement needs INTEGER


class Base(DeclarativeBase):
    """Declarative base of the coordinator tables."""


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


class BundleRow(Base):
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


class VerdictRow(Base):
    """Audit log: one row per accepted (code 0) or rejected bundle submission."""

    __tablename__ = "verdicts"

    id: Mapped[int] = mapped_column(_Id, primary_key=True, autoincrement=True)
    # Not a foreign key: rejections of unregistered senders are logged too.
    node_id: Mapped[str | None] = mapped_column(String(64), nullable=True, index=True)
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


def _encode_metrics(values: dict[str, float]) -> dict[str, float | str]:
    """JSON-safe metrics: non-finite floats become the strings "nan", "inf", "-inf"."""
    return {k: (float(v) if math.isfinite(v) else str(float(v))) for k, v in values.items()}


def _decode_metrics(values: dict[str, Any] | None) -> dict[str, float]:
    return {k: float(v) for k, v in (values or {}).items()}


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    cursor = dbapi_connection.cursor()
    try:
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA synchronous=FULL")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.execute("PRAGMA busy_timeout=30000")
    finally:
        cursor.close()


class SqlState(State):
    """:class:`State` on any SQLAlchemy URL.

    Args:
        url: e.g. ``sqlite:///var/ftis.db``, ``sqlite://`` (in memory, one shared
            connection; for tests) or ``postgresql+psycopg://user@host/db``.

    Raises:
        DatabaseError: if the database cannot be reached or the tables not created.
    """

    def __init__(self, url: str) -> None:
        self.url = url
        self.is_sqlite = url.startswith("sqlite")
        kwargs: dict[str, Any] = {}
        if self.is_sqlite:
            kwargs["connect_args"] = {"check_same_thread": False, "timeout": 30}
            if url in ("sqlite://", "sqlite:///:memory:") or "mode=memory" in url:
                kwargs["poolclass"] = StaticPool
        else:
            kwargs["pool_pre_ping"] = True
        try:
            self.engine = create_engine(url, **kwargs)
            if self.is_sqlite:
                event.listen(self.engine, "connect", _sqlite_pragmas)
            Base.metadata.create_all(self.engine)
        except (SQLAlchemyError, ImportError, ValueError) as exc:
            raise DatabaseError(f"cannot open database {url!r}: {exc}") from exc
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)
        self._lock: contextlib.AbstractContextManager[Any] = (
            threading.RLock() if self.is_sqlite else contextlib.nullcontext()
        )

    @contextlib.contextmanager
    def _session(self) -> Iterator[Session]:
        """A session in one transaction, committed on success, rolled back on error."""
        with self._lock, self._sessions() as session, session.begin():
            yield session

    # -- conversions -------------------------------------------------------------
    def _node_record(self, session: Session, row: NodeRow) -> NodeRecord:
        rejected = session.scalar(
            select(func.count(VerdictRow.id)).where(
                VerdictRow.node_id == row.node_id, VerdictRow.code != 0
            )
        )
        return NodeRecord(
            node_id=row.node_id,
            public_key=row.public_key,
            display_name=row.display_name,
            model_card=row.model_card,
            fingerprint=row.fingerprint,
            vocab_size=row.vocab_size,
            client_version=row.client_version,
            registered_at_ms=row.registered_at_ms,
            last_seen_ms=row.last_seen_ms,
            policy_version=row.policy_version,
            banned=row.banned,
            ban_reason=row.ban_reason,
            bundles_accepted=row.bundles_accepted,
            bundles_rejected=int(rejected or 0),
            reward_mismatches=row.reward_mismatches,
            completions=row.completions,
            completion_tokens=row.completion_tokens,
            latest_metrics=_decode_metrics(row.latest_metrics),
            latest_metrics_step=row.latest_metrics_step,
        )

    @staticmethod
    def _lease_record(row: LeaseRow) -> LeaseRecord:
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
        )

    @staticmethod
    def _bundle_record(row: BundleRow, dataset: str) -> BundleRecord:
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
        )

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
    ) -> NodeRecord:
        with self._session() as session:
            row = session.get(NodeRow, node_id)
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
            row.display_name = display_name
            row.model_card = model_card
            row.fingerprint = fingerprint
            row.vocab_size = vocab_size
            row.client_version = client_version
            row.last_seen_ms = now_ms
            session.flush()
            return self._node_record(session, row)

    def get_node(self, node_id: str) -> NodeRecord | None:
        with self._session() as session:
            row = session.get(NodeRow, node_id)
            return None if row is None else self._node_record(session, row)

    def resolve_node(self, id_or_prefix: str) -> NodeRecord:
        if not id_or_prefix:
            raise FtisError(ErrorCode.NODE_UNKNOWN, "empty node id")
        with self._session() as session:
            row = session.get(NodeRow, id_or_prefix)
            if row is not None:
                return self._node_record(session, row)
            escaped = id_or_prefix.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
            rows = session.scalars(
                select(NodeRow).where(NodeRow.node_id.like(escaped + "%", escape="\\")).limit(2)
            ).all()
            if len(rows) != 1:
                what = "no node" if not rows else "several nodes"
                raise FtisError(ErrorCode.NODE_UNKNOWN, f"{what} matching {id_or_prefix[:64]!r}")
            return self._node_record(session, rows[0])

    def list_nodes(self) -> list[NodeRecord]:
        with self._session() as session:
            rows = session.scalars(
                select(NodeRow).order_by(NodeRow.registered_at_ms, NodeRow.node_id)
            ).all()
            return [self._node_record(session, r) for r in rows]

    def touch_node(self, node_id: str, now_ms: int, policy_version: int | None = None) -> None:
        values: dict[str, Any] = {"last_seen_ms": now_ms}
        if policy_version is not None:
            values["policy_version"] = policy_version
        with self._session() as session:
            session.execute(update(NodeRow).where(NodeRow.node_id == node_id).values(**values))

    def set_ban(self, node_id: str, banned: bool, reason: str = "") -> NodeRecord:
        with self._session() as session:
            row = session.get(NodeRow, node_id)
            if row is None:
                raise FtisError(ErrorCode.NODE_UNKNOWN, f"no node {node_id[:64]!r}")
            row.banned = banned
            row.ban_reason = reason if banned else ""
            session.flush()
            return self._node_record(session, row)

    # -- leases ------------------------------------------------------------------
    def count_outstanding_leases(self, node_id: str | None, now_ms: int) -> int:
        query = select(func.count(LeaseRow.lease_id)).where(
            LeaseRow.bundle_id.is_(None), LeaseRow.deadline_ms >= now_ms
        )
        if node_id is not None:
            query = query.where(LeaseRow.node_id == node_id)
        with self._session() as session:
            return int(session.scalar(query) or 0)

    def insert_leases(self, leases: list[LeaseRecord]) -> None:
        with self._session() as session:
            session.add_all(
                LeaseRow(
                    lease_id=lease.lease_id,
                    task_id=lease.task_id,
                    node_id=lease.node_id,
                    dataset=lease.dataset,
                    spec_index=lease.spec_index,
                    entry_json=lease.entry.to_json(),
                    group_size=lease.group_size,
                    max_new_tokens=lease.max_new_tokens,
                    issued_at_ms=lease.issued_at_ms,
                    deadline_ms=lease.deadline_ms,
                    bundle_id=None,
                )
                for lease in leases
            )

    def get_lease_by_task(self, task_id: str) -> LeaseRecord | None:
        with self._session() as session:
            row = session.scalar(select(LeaseRow).where(LeaseRow.task_id == task_id))
            return None if row is None else self._lease_record(row)

    def lease_counts(self) -> dict[tuple[int, str], int]:
        with self._session() as session:
            rows = session.execute(
                select(
                    LeaseRow.spec_index, LeaseRow.dataset, func.count(LeaseRow.lease_id)
                ).group_by(LeaseRow.spec_index, LeaseRow.dataset)
            ).all()
            return {(int(k), str(d)): int(n) for k, d, n in rows}

    # -- bundles -----------------------------------------------------------------
    def store_bundle(self, bundle: NewBundle, now_ms: int) -> BundleRecord:
        try:
            with self._session() as session:
                answered = session.execute(
                    update(LeaseRow)
                    .where(LeaseRow.lease_id == bundle.lease_id, LeaseRow.bundle_id.is_(None))
                    .values(bundle_id=bundle.bundle_id)
                )
                if answered.rowcount != 1:
                    raise FtisError(
                        ErrorCode.BUNDLE_REPLAYED, f"lease {bundle.lease_id} already answered"
                    )
                row = BundleRow(
                    bundle_id=bundle.bundle_id,
                    node_id=bundle.node_id,
                    task_id=bundle.task_id,
                    lease_id=bundle.lease_id,
                    fingerprint=bundle.fingerprint,
                    envelope=bundle.envelope,
                    verified_rewards=list(bundle.verified_rewards),
                    mean_reward=bundle.mean_reward,
                    zero_variance=bundle.zero_variance,
                    completions=bundle.completions,
                    completion_tokens=bundle.completion_tokens,
                    size_bytes=bundle.size_bytes,
                    reward_mismatches=bundle.reward_mismatches,
                    policy_version=bundle.policy_version,
                    stored_at_ms=now_ms,
                )
                session.add(row)
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
                dataset = session.scalar(
                    select(LeaseRow.dataset).where(LeaseRow.lease_id == bundle.lease_id)
                )
                return self._bundle_record(row, dataset or "")
        except IntegrityError as exc:
            raise FtisError(
                ErrorCode.BUNDLE_REPLAYED, f"lease {bundle.lease_id} or bundle already stored"
            ) from exc

    def record_rejection(
        self, node_id: str | None, bundle_id: str | None, code: int, reason: str, now_ms: int
    ) -> None:
        with self._session() as session:
            session.add(
                VerdictRow(
                    node_id=node_id,
                    bundle_id=bundle_id,
                    code=int(code),
                    reason=reason,
                    at_ms=now_ms,
                )
            )

    def pull_bundles(
        self,
        *,
        requester_id: str,
        cursor: int,
        limit: int,
        max_bytes: int,
        fingerprint: str = "",
        skip_zero_variance: bool = False,
    ) -> tuple[list[BundleRecord], int]:
        with self._session() as session:
            max_seq = int(session.scalar(select(func.max(BundleRow.sequence))) or 0)
            query = (
                select(BundleRow, LeaseRow.dataset)
                .join(NodeRow, NodeRow.node_id == BundleRow.node_id)
                .join(LeaseRow, LeaseRow.lease_id == BundleRow.lease_id)
                .where(
                    BundleRow.sequence > cursor,
                    BundleRow.sequence <= max_seq,
                    BundleRow.node_id != requester_id,
                    NodeRow.banned.is_(False),
                )
                .order_by(BundleRow.sequence)
                .limit(limit)
            )
            if fingerprint:
                query = query.where(BundleRow.fingerprint == fingerprint)
            if skip_zero_variance:
                query = query.where(BundleRow.zero_variance.is_(False))
            page: list[BundleRecord] = []
            used = 0
            full = False
            for row, dataset in session.execute(query):
                if page and used + row.size_bytes > max_bytes:
                    full = True
                    break
                page.append(self._bundle_record(row, dataset))
                used += row.size_bytes
            if len(page) >= limit:
                full = True
            next_cursor = page[-1].sequence if full and page else max_seq
            return page, next_cursor

    def list_bundles(self, node_prefix: str = "", limit: int = 50) -> list[BundleRecord]:
        query = (
            select(BundleRow, LeaseRow.dataset)
            .join(LeaseRow, LeaseRow.lease_id == BundleRow.lease_id)
            .order_by(BundleRow.sequence.desc())
            .limit(limit)
        )
        if node_prefix:
            escaped = node_prefix.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
            query = query.where(BundleRow.node_id.like(escaped + "%", escape="\\"))
        with self._session() as session:
            return [self._bundle_record(row, ds) for row, ds in session.execute(query)]

    # -- metrics and stats -----------------------------------------------------------
    def record_metrics(
        self, node_id: str, step: int, values: dict[str, float], now_ms: int
    ) -> None:
        encoded = _encode_metrics(values)
        with self._session() as session:
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
        with self._session() as session:
            return {int(code): int(n) for code, n in session.execute(query)}

    def stats(self, now_ms: int, active_window_ms: int) -> StatsRecord:
        with self._session() as session:
            nodes = session.scalar(select(func.count(NodeRow.node_id))) or 0
            active = session.scalar(
                select(func.count(NodeRow.node_id)).where(
                    NodeRow.last_seen_ms >= now_ms - active_window_ms
                )
            )
            banned = session.scalar(
                select(func.count(NodeRow.node_id)).where(NodeRow.banned.is_(True))
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
        )

    def close(self) -> None:
        self.engine.dispose()


def open_state(url: str) -> SqlState:
    """Open (and create tables in) the database at ``url``. Raises DatabaseError."""
    return SqlState(url)


def dump_tables(state: SqlState, tables: tuple[str, ...] = ("nodes", "leases", "bundles")) -> dict:
    """Every row of ``tables`` as sorted tuples (for before/after comparisons in tests)."""
    out: dict[str, list[tuple[Any, ...]]] = {}
    with state._session() as session:  # noqa: SLF001 - same module family
        for name in tables:
            table = Base.metadata.tables[name]
            rows = session.execute(select(table)).all()
            out[name] = sorted(tuple(json.dumps(v, default=repr) for v in r) for r in rows)
    return out
