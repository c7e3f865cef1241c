"""``ftis-lab simulate`` against the native swarm (issue 16, part 2): the same tiny swarm
of three learners, run natively (a gRPC coordinator and SwarmConnection clients in lock
step) and in Flower's simulation engine (Ray, two actors, learners' state carried in
their Flower context), must agree: the same bundles stored, the same verified rewards in
the same order, the same per-round counts and learner losses, and the same reputations
within 1e-3 (wall-clock decay). Needs flwr: runs in .venv-flower (``make test-flower``)."""

from __future__ import annotations

import pytest

pytest.importorskip("flwr")
pytest.importorskip("ray")

from ftis.lab.simulate.spec import SwarmSpec, compare  # noqa: E402

pytestmark = pytest.mark.flower

N, ROUNDS, G = 3, 3, 8


def test_simulated_swarm_matches_the_native_one(tmp_path):
    from ftis.lab.simulate.flower import run_flower
    from ftis.lab.simulate.native import run_native

    # letter_counting: the one family on which the tiny random model earns some reward,
    # so that groups with reward variance exist and learners update on own and relayed
    # groups (a swarm of zero rewards would agree trivially)
    spec = SwarmSpec(learners=N, rounds=ROUNDS, group_size=G, max_new_tokens=12,
                     model_seed=1, external_groups=2, out=tmp_path,
                     coordinator={"tasks": [{"dataset": "letter_counting"}], "task_seed": 1})
    native = run_native(spec)
    simulated = run_flower(spec, client_cpus=1, ray_cpus=2, snapshots=True)

    assert compare(native, simulated) == []
    # concrete values, not only agreement
    assert simulated.bundles_accepted == native.bundles_accepted == N * ROUNDS
    assert simulated.bundles_rejected == native.bundles_rejected == 0
    assert len(simulated.rounds) == N * ROUNDS
    assert {len(r) for r in simulated.verified_rewards.values()} == {ROUNDS * G}
    rewards = sum(sum(r) for r in simulated.verified_rewards.values())
    assert rewards == sum(sum(r) for r in native.verified_rewards.values()) > 0
    learned = [r for r in simulated.rounds if r.metrics["samples"] > 0]
    assert learned and all(r.metrics["updated"] == 1.0 for r in learned)
    assert sum(r.metrics["external_groups_used"] for r in simulated.rounds) > 0
    for node, score in simulated.reputations.items():
        assert abs(score - native.reputations[node]) <= 1e-3
        assert score > 0.5  # accepted bundles earned standing; nobody was penalised
