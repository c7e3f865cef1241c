"""The read-only history queries of the status page and the /metrics gauges
(:mod:`ftis.coordinator.state.history`) on SQLite and PostgreSQL: bucketed by the
database, bounded to the newest rows, and they select nothing secret."""

from __future__ import annotations

from ftis.coordinator.observe import status as page
from ftis.lab.harness.coordinator import (
    Coordinator,
    FakeClock,
    build_bundle,
    make_config,
    register,
    seal_bundle,
)


def test_history_on_both_backends(state, state_url) -> None:
    clock = FakeClock(1_800_000_000_000)
    coord = Coordinator(make_config(db=state_url, lease_ttl_s=30), state, clock)
    start = clock()
    a, b = register(coord), register(coord)
    for minute in range(4):
        for lease in coord.lease_tasks(a.node_id, 2, 2, 16):
            coord.submit_bundle(seal_bundle(build_bundle(lease, a), a))
        coord.report_metrics(a.node_id, minute + 1, {"reward_mean": 0.5, "loss": 1.0})
        clock.advance(60)
    coord.lease_tasks(b.node_id, 1, 2, 16)  # never answered: expires
    clock.advance(120)
    coord.flush_seen()

    buckets = state.reward_history(start, 60_000)
    assert [(x.start_ms - start) // 60_000 for x in buckets] == [0, 1, 2, 3]
    assert all(x.bundles == 2 and x.completions == 4 and x.node_id == a.node_id
               for x in buckets)
    assert sum(x.reward_sum for x in buckets) == 8.0  # alternate right/wrong completions
    assert sum(x.bundles for x in state.reward_history(start, 60_000, max_rows=3)) == 3
    verdicts = state.verdict_history(start, 120_000)
    assert [(v.code, v.count) for v in verdicts] == [(0, 4), (0, 4)]
    evidence = state.evidence_since(start)
    assert len(evidence) == 8 and {e.kind for e in evidence} == {"bundle_verified"}
    assert len(state.evidence_since(start + 3 * 60_000)) == 2
    points = state.metrics_history(start, ("reward_mean",))
    assert [p.step for p in points] == [1, 2, 3, 4]
    assert all(p.values == {"reward_mean": 0.5} for p in points)
    counts = state.swarm_counts(clock(), 5 * 60_000)
    assert (counts.nodes, counts.banned_nodes, counts.quarantined_nodes) == (2, 0, 0)
    assert (counts.leases_outstanding, counts.leases_expired) == (0, 1)
    data = page.build_status(state, coord.reputation_config, clock(), window_s=3600)
    assert data["summary"]["accepted_window"] == 8 and data["summary"]["leases_expired"] == 1
    assert {n["node_id"] for n in data["nodes"]} == {a.node_id, b.node_id}
