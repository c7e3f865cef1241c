"""Read-only, bounded history queries of the SQL storage (the status page and the
``/metrics`` gauges): the implementations of :class:`State`'s history methods for an
:class:`~ftis.coordinator.state.sql.SqlState`.

Each query runs in one read transaction of the state (``_read_conn``: on SQLite a WAL
snapshot that never waits for writers) and scans at most ``max_rows`` of the newest
rows of its table: the newest id (or bundle sequence) is read first, then only the
primary-key range above ``newest - max_rows`` is read, so the cost does not grow with
the database. Time buckets are computed by the database (``GROUP BY``), so a page over
hours of a busy swarm returns a few hundred rows. Nothing here selects envelopes, keys,
proofs or tokenizers.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from sqlalchemy import Table, and_, func, select

from ftis.coordinator.state.base import (
    HISTORY_MAX_ROWS,
    EvidenceRecord,
    MetricsPoint,
    RewardBucket,
    SwarmCounts,
    VerdictBucket,
)

if TYPE_CHECKING:
    from ftis.coordinator.state.base import State


def _tables() -> dict[str, Table]:
    from ftis.coordinator.state.sql import Base

    return dict(Base.metadata.tables)


def _sql(state: State) -> Any:
    """The state as an ``SqlState`` (anything with ``engine`` and ``_read_conn``)."""
    if not hasattr(state, "engine") or not hasattr(state, "_read_conn"):
        raise NotImplementedError(
            f"{type(state).__name__} does not implement the history queries")
    return state


def _limit(max_rows: int | None) -> int:
    return HISTORY_MAX_ROWS if max_rows is None else max(int(max_rows), 1)


def swarm_counts(state: State, now_ms: int, active_window_ms: int) -> SwarmCounts:
    t = _tables()
    nodes, reps, leases = t["nodes"], t["reputation"], t["leases"]
    count = func.count()
    unanswered = leases.c.bundle_id.is_(None)
    query = select(
        select(count).select_from(nodes).scalar_subquery(),
        select(count).select_from(nodes)
        .where(nodes.c.last_seen_ms >= now_ms - active_window_ms).scalar_subquery(),
        select(count).select_from(nodes.join(reps, reps.c.node_id == nodes.c.node_id))
        .where(reps.c.quarantined.is_(True), nodes.c.banned.is_(False)).scalar_subquery(),
        select(count).select_from(nodes).where(nodes.c.banned.is_(True)).scalar_subquery(),
        select(count).select_from(leases)
        .where(unanswered, leases.c.deadline_ms >= now_ms).scalar_subquery(),
        select(count).select_from(leases)
        .where(unanswered, leases.c.deadline_ms < now_ms).scalar_subquery(),
    )
    with _sql(state)._read_conn() as conn:
        row = conn.execute(query).one()
    return SwarmCounts(*(int(v or 0) for v in row))


def _floor_bound(conn: Any, column: Any, max_rows: int) -> int:
    """Ids above this are the newest ``max_rows`` (at most; ids may have gaps)."""
    newest = conn.execute(select(func.max(column))).scalar()
    return int(newest or 0) - max_rows


def reward_history(state: State, since_ms: int, bucket_ms: int,
                   max_rows: int | None = None) -> list[RewardBucket]:
    t = _tables()
    bundles, leases = t["bundles"], t["leases"]
    bucket_ms = max(int(bucket_ms), 1)
    key = ((bundles.c.stored_at_ms - since_ms) // bucket_ms).label("k")
    with _sql(state)._read_conn() as conn:
        floor = _floor_bound(conn, bundles.c.sequence, _limit(max_rows))
        rows = conn.execute(
            select(key, leases.c.dataset, bundles.c.node_id, func.count(),
                   func.sum(bundles.c.completions),
                   func.sum(bundles.c.mean_reward * bundles.c.completions))
            .select_from(bundles.join(leases, leases.c.lease_id == bundles.c.lease_id))
            .where(and_(bundles.c.sequence > floor, bundles.c.stored_at_ms >= since_ms))
            .group_by(key, leases.c.dataset, bundles.c.node_id)
        ).all()
    return sorted(
        (RewardBucket(start_ms=since_ms + int(k) * bucket_ms, dataset=str(dataset),
                      node_id=str(node_id), bundles=int(n), completions=int(c or 0),
                      reward_sum=float(r or 0.0))
         for k, dataset, node_id, n, c, r in rows),
        key=lambda b: (b.start_ms, b.dataset, b.node_id))


def verdict_history(state: State, since_ms: int, bucket_ms: int,
                    max_rows: int | None = None) -> list[VerdictBucket]:
    verdicts = _tables()["verdicts"]
    bucket_ms = max(int(bucket_ms), 1)
    key = ((verdicts.c.at_ms - since_ms) // bucket_ms).label("k")
    with _sql(state)._read_conn() as conn:
        floor = _floor_bound(conn, verdicts.c.id, _limit(max_rows))
        rows = conn.execute(
            select(key, verdicts.c.code, func.count())
            .where(and_(verdicts.c.id > floor, verdicts.c.at_ms >= since_ms))
            .group_by(key, verdicts.c.code)
        ).all()
    return sorted((VerdictBucket(since_ms + int(k) * bucket_ms, int(code), int(n))
                   for k, code, n in rows), key=lambda v: (v.start_ms, v.code))


def evidence_since(state: State, since_ms: int,
                   max_rows: int | None = None) -> list[EvidenceRecord]:
    ev = _tables()["evidence"]
    with _sql(state)._read_conn() as conn:
        floor = _floor_bound(conn, ev.c.id, _limit(max_rows))
        rows = conn.execute(
            select(ev.c.id, ev.c.node_id, ev.c.at_ms, ev.c.kind, ev.c.weight, ev.c.detail,
                   ev.c.reporter_node_id, ev.c.bundle_id)
            .where(and_(ev.c.id > floor, ev.c.at_ms >= since_ms))
            .order_by(ev.c.id)
        ).all()
    return [EvidenceRecord(id=int(r[0]), node_id=r[1], at_ms=int(r[2]), kind=r[3],
                           weight=float(r[4]), detail=r[5], reporter_node_id=r[6],
                           bundle_id=r[7]) for r in rows]


def metrics_history(state: State, since_ms: int, keys: tuple[str, ...],
                    max_rows: int | None = None) -> list[MetricsPoint]:
    metrics = _tables()["metrics"]
    wanted = set(keys)
    with _sql(state)._read_conn() as conn:
        floor = _floor_bound(conn, metrics.c.id, _limit(max_rows))
        rows = conn.execute(
            select(metrics.c.node_id, metrics.c.at_ms, metrics.c.step, metrics.c["values"])
            .where(and_(metrics.c.id > floor, metrics.c.at_ms >= since_ms))
            .order_by(metrics.c.id)
        ).all()
    out = []
    for node_id, at_ms, step, values in rows:
        picked = {}
        for k, v in (values or {}).items():
            if k in wanted and isinstance(v, int | float) and math.isfinite(v):
                picked[k] = float(v)
        out.append(MetricsPoint(node_id=node_id, at_ms=int(at_ms), step=int(step),
                                values=picked))
    return out
