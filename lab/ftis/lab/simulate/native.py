"""The same swarm the native way, the simulator's parity reference (no ``flwr``).

A real :class:`~ftis.coordinator.server.app.CoordinatorServer` on loopback gRPC (SQLite
file) and N volunteer nodes, each a :class:`VolunteerNode` on its own
:class:`~ftis.client.swarm.connection.SwarmConnection` (signed requests, signed bundles),
in one process and in lock step: every node samples, then every node submits, then every
node pulls, learns and reports, as the simulator's two messages per round order them
(in ``ftis-client start`` a node's phases follow each other at once and the order between
nodes is left to timing, which no two runs would share).
"""

from __future__ import annotations

import time

from ftis.client.swarm.connection import SwarmConnection
from ftis.coordinator.server.app import CoordinatorServer
from ftis.lab.simulate.coordinator import totals
from ftis.lab.simulate.learner import build_node
from ftis.lab.simulate.spec import LearnerRound, SwarmSpec, SwarmSummary


def run_native(spec: SwarmSpec) -> SwarmSummary:
    """Run ``spec`` natively; the coordinator's database is ``out/native.db``.

    Raises:
        FtisError: a registration or a call the nodes do not handle was refused.
    """
    spec.out.mkdir(parents=True, exist_ok=True)
    db = spec.out / "native.db"
    db.unlink(missing_ok=True)
    t_setup = time.perf_counter()
    server = CoordinatorServer(spec.coordinator_config(str(db)).model_copy(
        update={"listen": "127.0.0.1:0", "admin_listen": "127.0.0.1:0"}))
    server.start()
    conns: list[SwarmConnection] = []
    try:
        nodes = []
        for i in range(spec.learners):
            identity = spec.identity(i)
            conn = SwarmConnection(server.address, identity, card=None,  # type: ignore[arg-type]
                                   retries=3)
            node = build_node(spec, i, conn)
            conn.card = node.policy.card
            conn.tokenizer_json = node.policy.tokenizer_json
            conn.display_name = f"sim-{i}"
            conn.register()
            conns.append(conn)
            nodes.append(node)
        summary = SwarmSummary(setup_s=time.perf_counter() - t_setup)
        started = time.perf_counter()
        for _ in range(spec.rounds):
            t0 = time.perf_counter()
            stats: list[dict[str, float]] = [{} for _ in nodes]
            pending = [node.sample(s) for node, s in zip(nodes, stats, strict=True)]
            local = [node.submit(p, s) for node, p, s in zip(nodes, pending, stats,
                                                             strict=True)]
            for node, groups, s in zip(nodes, local, stats, strict=True):
                result = node.learn(groups, s, t0)
                summary.rounds.append(LearnerRound(node.conn.node_id, result.round,
                                                   dict(result.metrics)))
        summary.wall_s = time.perf_counter() - started
        server.ctx.seen.flush(server.state)
        end = totals(server.ctx, [c.node_id for c in conns])
        summary.bundles_accepted, summary.bundles_rejected = (end.bundles_accepted,
                                                              end.bundles_rejected)
        summary.verified_rewards, summary.reputations = end.verified_rewards, end.reputations
        return summary
    finally:
        for conn in conns:
            conn.close()
        server.stop(grace=1.0)
