"""Issue 13, classes 1 and 3, played over the real gRPC protocol against a real
coordinator with honest nodes alongside (:mod:`trust_swarm`).

Class 1: the answer left the coordinator in every lease (``TaskLease.entry_json``).
Class 3: two fresh identities drove an honest node from E = 0.875 to 0.121 with negative
feedback, and two others lifted a quarantined reward liar back into relay with praise.
Each test asserts that the attack fails and that the honest nodes keep their reputation.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from ftis.coordinator.state.sql import SqlState
from ftis.lab.harness.trust_swarm import Node, Swarm, running_swarm
from ftis.protocol.errors import ErrorCode
from ftis.tasks.source import TaskSpec
from ftis.v1 import swarm_pb2

pytestmark = pytest.mark.integration

#: Tasks whose ReasoningGYM metadata holds the answer (gcd: "result"; products and
#: chain_sum: the expression) next to the test's default chain_sum.
LEAKY_TASKS = [
    TaskSpec(dataset="chain_sum", config={"min_terms": 2, "max_terms": 2, "min_digits": 1,
                                          "max_digits": 1}),
    TaskSpec(dataset="gcd", config={"min_value": 100, "max_value": 100_000}),
    TaskSpec(dataset="products", config={"min_digits": 3, "max_digits": 4}),
]
#: What a lease may carry: the prompt, and nothing about its answer.
LEASE_FIELDS = {"lease_id", "task_id", "dataset", "messages", "question", "deadline_ms",
                "group_size", "max_new_tokens"}


@pytest.fixture
def swarm(tmp_path: Path) -> Iterator[Swarm]:
    # full weight at once for established reporters: the test runs for seconds
    with running_swarm(tmp_path, reputation={"reporter_maturity_s": 0},
                       tasks=LEAKY_TASKS) as world:
        yield world


def _established(swarm: Swarm, node: Node, bundles: int = 5) -> None:
    """``node`` submits enough verified bundles to finish probation."""
    for lease in node.lease(bundles):
        reply = node.submit_bundle(node.honest_bundle(lease))
        assert reply.error.code == 0, reply.error


# -- class 1: the answer stays on the coordinator -------------------------------------------


def test_class1_leases_carry_no_answer(swarm: Swarm) -> None:
    attacker = swarm.attacker()
    leases = attacker.lease(24)
    assert {lease.dataset for lease in leases} == {"chain_sum", "gcd", "products"}
    state: SqlState = swarm.server.state
    for lease in leases:
        assert {f.name for f, _ in lease.ListFields()} <= LEASE_FIELDS
        assert "entry_json" not in swarm_pb2.TaskLease.DESCRIPTOR.fields_by_name
        entry = state.get_lease_by_task(lease.task_id).entry
        wire = lease.SerializeToString()
        # nothing beyond the question: with the question, the prompt and the random ids
        # removed, no trace of a (multi-digit) answer is left in the bytes sent
        stripped = swarm_pb2.TaskLease()
        stripped.CopyFrom(lease)
        for name in ("question", "messages", "lease_id", "task_id"):
            stripped.ClearField(name)
        rest = stripped.SerializeToString()
        if len(entry.answer) >= 3:
            assert entry.answer.encode() not in rest, (lease.dataset, entry.answer)
        assert b"metadata" not in wire and b"source_index" not in wire
        assert b'"answer"' not in wire
    # an honest reply still brings the verified rewards back
    reply = swarm.honest_a.submit_bundle(swarm.honest_a.honest_bundle(swarm.honest_a.lease()[0]))
    assert reply.error.code == 0 and len(reply.verified_rewards) == 2


def test_class1_claims_are_optional_and_a_wrong_claim_still_costs(swarm: Swarm) -> None:
    node = swarm.attacker()
    first, second = node.lease(2)
    unclaimed = node.honest_bundle(first)
    for c in unclaimed.completions:
        c.ClearField("claimed_reward")
    reply = node.submit_bundle(unclaimed)
    assert reply.error.code == 0 and reply.reward_mismatches == 0
    assert list(reply.verified_rewards) == [1.0, 0.0]  # the coordinator scored it
    lying = node.honest_bundle(second)
    lying.completions[1].claimed_reward = 1.0
    assert node.submit_bundle(lying).reward_mismatches == 1


# -- class 3: sybils steering reputation through feedback -------------------------------------


def _blame(sender: Node, bundle_ids: list[str]) -> swarm_pb2.SenderFeedback:
    return swarm_pb2.SenderFeedback(
        sender_node_id=sender.node_id, groups=1, tokens=20, mean_log_ratio=9.0,
        filtered_frac=1.0, truncated_frac=1.0, invalid_bundles=1, bundle_ids=bundle_ids)


def test_class3_fresh_sybils_cannot_sink_an_honest_node(swarm: Swarm) -> None:
    for _ in range(6):
        swarm.honest_round()
    before = swarm.honest_standing()
    a = swarm.honest_a
    stored_before = swarm.server.state.get_node(a.node_id).standing
    sybils = [swarm.attacker(), swarm.attacker()]
    for sybil in sybils:
        pulled = [b.bundle_id for b in sybil.pull().bundles]  # they may pull like anyone
        assert set(swarm.stored) <= set(pulled)
        for _ in range(2):  # the review's attack: 2 reports of 64 entries each
            reply = sybil.report(*([_blame(a, [])] * 32 + [_blame(a, [pulled[0]])] * 32))
            assert reply.error.code == 0 and not reply.dropped_feedback, reply
    assert swarm.server.state.get_node(a.node_id).standing == stored_before  # not moved
    stored_feedback = [e for e in swarm.server.state.list_evidence(a.node_id, 1000)
                       if e.kind == "feedback" and e.reporter_node_id in
                       {s.node_id for s in sybils}]
    assert stored_feedback == []  # weightless reports write no evidence rows
    swarm.assert_honest_kept_their_reputation(before)


def test_class3_an_established_reporter_counts_each_pulled_bundle_once(swarm: Swarm) -> None:
    a, b = swarm.honest_a, swarm.honest_b
    _established(swarm, b)  # B finishes probation: its reports weigh
    (lease,) = a.lease()
    fresh = a.submit_bundle(a.honest_bundle(lease)).bundle_id
    reply = b.report(_blame(a, [fresh]))  # not yet relayed to B: does not count
    assert reply.error.code == 0
    assert not [e for e in swarm.server.state.list_evidence(a.node_id, 1000)
                if e.kind == "feedback" and e.weight < 0]
    assert fresh in [x.bundle_id for x in b.pull().bundles]
    before, _ = swarm.standing(a)
    b.report(_blame(a, [fresh]))
    b.report(_blame(a, [fresh]))  # the same bundle again: counted once
    negative = [e for e in swarm.server.state.list_evidence(a.node_id, 1000)
                if e.kind == "feedback" and e.weight < 0]
    assert len(negative) == 1 and negative[0].reporter_node_id == b.node_id
    assert swarm.standing(a)[0] < before


def test_class3_praise_from_sybils_cannot_lift_a_quarantine(swarm: Swarm) -> None:
    before = swarm.honest_standing()
    liar = swarm.attacker()
    for lease in liar.lease(3):  # wrong claims on every bundle: quarantined in probation
        bundle = liar.honest_bundle(lease)
        for c in bundle.completions:
            c.claimed_reward = 1.0 - c.claimed_reward
        assert liar.submit_bundle(bundle).error.code == 0
    score, quarantined = swarm.standing(liar)
    assert quarantined
    praise = []
    for _ in range(2):
        sybil = swarm.attacker()
        pulled = [x.bundle_id for x in sybil.pull().bundles]
        praise.append((sybil, pulled))
    for sybil, pulled in praise:
        entry = swarm_pb2.SenderFeedback(sender_node_id=liar.node_id, groups=1, tokens=20,
                                         mean_log_ratio=0.0, bundle_ids=pulled[:1])
        for _ in range(2):
            assert sybil.report(*[entry] * 64).error.code == 0
    assert swarm.standing(liar) == (pytest.approx(score, abs=1e-3), True)
    swarm.assert_relay_unchanged()  # none of the liar's bundles is relayed
    swarm.assert_honest_kept_their_reputation(before)


def test_class3_report_metrics_is_rate_limited(tmp_path: Path) -> None:
    with running_swarm(tmp_path, reports_per_minute=3) as world:
        node = world.attacker()
        codes = [node.report().error.code for _ in range(6)]
        assert codes[:3] == [0, 0, 0] or codes.count(0) <= 4
        assert ErrorCode.RATE_LIMITED in codes
