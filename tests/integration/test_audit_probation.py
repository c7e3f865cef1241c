"""Audit-based probation (issue 13, class 1; docs/reputation.md "Audit-based
probation"), played over the real gRPC protocol against a real coordinator with
``reputation.audit_reporters = 2``.

The operator seeds A, B and two receivers R1, R2 (``audit_seed_nodes``); each submits
the 5 verified bundles that end count-probation, so they are established. A newcomer's
bundles then reach only established receivers of its tokenizer, flagged audit-only; R1
and R2 run the real client path on them (``ExternalPool`` re-verification, the
training draw, ``Learner.step``, ``Learner.audit`` with a tiny random model whose
log-probs an honest newcomer reports, ``sender_feedback``) and report. The tests show:

(a) a probation node's bundles reach only established receivers, flagged audit-only,
    and are not trained on; (b) an honest newcomer leaves probation after the two
    agreeing reports; (c) a model-less newcomer whose log-probs are a constant -0.7 per
    token (ftis-lab's ``answer_computer``) fails its audit, stays on probation and ends
    with negative evidence; (d) fresh sybils, and nodes with the bundle count but no
    audit, cannot corroborate anyone. Honest nodes keep their reputation throughout.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import torch

from ftis.client.learner.trainer import Learner, LearnerConfig
from ftis.client.node.runner import sender_feedback
from ftis.client.swarm.external_pool import ExternalPool
from ftis.coordinator import reputation
from ftis.coordinator.server.app import CoordinatorServer
from ftis.coordinator.state.base import AuditRelay
from ftis.lab.harness.coordinator import (
    VOCAB,
    load_tokenizer,
    make_config,
    model_card,
    register_envelope,
    tokenizer_fp,
)
from ftis.lab.harness.trust_swarm import Node, Swarm, card_model, model_bundle, now_ms
from ftis.protocol.identity import NodeIdentity
from ftis.v1 import bundle_pb2, swarm_pb2, swarm_pb2_grpc

pytestmark = pytest.mark.integration

K = 2
PROBATION_BUNDLES = 5


@dataclass
class World:
    swarm: Swarm
    receivers: list[Node]  # R1, R2: seeded, established, with the model card's weights

    @property
    def state(self):
        return self.swarm.server.state

    def node(self) -> Node:
        return self.swarm.attacker()

    def audit(self, node: Node) -> int:
        record = self.state.get_node(node.node_id)
        assert record is not None
        return record.audit_status

    def in_probation(self, node: Node) -> bool:
        record = self.state.get_node(node.node_id)
        assert record is not None
        return reputation.in_probation(record.bundles_accepted, record.audit_status,
                                       self.swarm.server.ctx.policy)


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    """The model card's weights (:func:`card_model`)."""
    return card_model()


def _bundle(node: Node, lease: swarm_pb2.TaskLease,
            model: torch.nn.Module | None) -> bundle_pb2.Bundle:
    """An honest bundle whose log-probs are the model's; with ``model=None`` the
    harness's placeholder, a constant -0.7 per token (what a model-less node that
    computes answers sends: ftis-lab's ``answer_computer``)."""
    return node.honest_bundle(lease) if model is None else model_bundle(node, lease, model)


def _submit(node: Node, n: int, model: torch.nn.Module | None) -> list[str]:
    ids = []
    for lease in node.lease(n):
        reply = node.submit_bundle(_bundle(node, lease, model))
        assert reply.error.code == 0, reply.error
        ids.append(reply.bundle_id)
    return ids


@pytest.fixture
def world(tmp_path: Path, model: torch.nn.Module) -> Iterator[World]:
    ids = [NodeIdentity.generate() for _ in range(4)]  # A, B, R1, R2: the operator's seeds
    server = CoordinatorServer(make_config(
        db=str(tmp_path / "coordinator.db"), require_tokenizer=True,
        reputation={"reporter_maturity_s": 0, "audit_reporters": K,
                    "probation_bundles": PROBATION_BUNDLES},
        audit_seed_nodes=[i.node_id for i in ids]))
    server.start()
    channel = grpc.insecure_channel(server.address)
    stub = swarm_pb2_grpc.SwarmStub(channel)
    try:
        card = model_card(tokenizer_fp(), VOCAB)
        a, b, r1, r2 = (Node(i, stub, card) for i in ids)
        assert a.register().error.code == 0 and a.upload().error.code == 0
        for n in (b, r1, r2):
            assert n.register().tokenizer_known
        stored = _submit(a, PROBATION_BUNDLES, None)  # A: the harness's honest sender
        _submit(b, PROBATION_BUNDLES, None)
        for r in (r1, r2):
            _submit(r, PROBATION_BUNDLES, model)
        world = World(Swarm(server, stub, a, b, stored), [r1, r2])
        for n in (a, b, r1, r2):  # seeded and past the count: established
            assert world.audit(n) == reputation.AUDIT_PASSED and not world.in_probation(n)
        world.swarm.honest_round()  # A's bundles reach B for training, B reports
        yield world
    finally:
        channel.close()
        server.stop(grace=1.0)


def _assert_honest_kept_their_reputation(world: World,
                                         before: dict[str, tuple[float, bool]]) -> None:
    """``Swarm.assert_honest_kept_their_reputation`` for honest nodes with a history: A
    and B (and the auditors) have no negative evidence, are not quarantined, lost no
    more than the half-life's decay over the test's seconds (B, 5 bundles and no new
    evidence: about 4e-6 per 10 s), A's next bundle still reaches B and A still gains."""
    swarm = world.swarm
    swarm.honest_round()
    after = swarm.honest_standing()
    for name, (score, quarantined) in after.items():
        assert not quarantined and score >= before[name][0] - 1e-4, (name, before, after)
    assert after["A"][0] > before["A"][0]
    for node in (swarm.honest_a, swarm.honest_b, *world.receivers):
        rows = world.state.list_evidence(node.node_id, 1000)
        assert all(e.weight >= 0 for e in rows), [e for e in rows if e.weight < 0]


def _relayed(receiver: Node, sender: Node, world: World) -> list[swarm_pb2.RelayedBundle]:
    """What ``receiver`` is relayed of ``sender``'s bundles (a pull from cursor 0)."""
    theirs = set(world.swarm.stored_by(sender))
    return [b for b in receiver.pull().bundles if b.bundle_id in theirs]


def _receive_and_report(receiver: Node, model: torch.nn.Module, world: World,
                        under_audit: set[str]) -> dict[str, swarm_pb2.SenderFeedback]:
    """What a real receiver does: re-verify the relay (``ExternalPool``), train on the
    trainable draw from the other receivers (which never holds an audit-only group),
    audit the audit-only groups without training, report ``sender_feedback`` about the
    receivers and ``under_audit``. Asserts the audit left the weights as the step did."""
    tok = load_tokenizer()
    pool = ExternalPool(receiver.node_id, VOCAB, tokenizer_fp(),
                        decode=lambda ids: tok.decode(ids, skip_special_tokens=False))
    for relayed in receiver.pull().bundles:
        pool.add(relayed)
    peers = {r.node_id for r in world.receivers}
    drawn = pool.take(len(pool.groups))
    assert not any(g.meta.get("audit_only") or g.sender in under_audit for g in drawn)
    trainable = [g for g in drawn if g.sender in peers]
    audits = [g for g in pool.take_audits(64) if g.sender in under_audit]
    assert audits and all(g.meta["audit_only"] for g in audits)
    learner = Learner(model, LearnerConfig(), pad_token_id=0)
    # audited with the weights before the update; even when handed to step as training
    # groups too, audit-only groups are not trained on
    metrics = learner.step(trainable + audits, audit=audits)
    assert metrics["groups_external"] == len(trainable) > 0 and metrics["updated"] == 1.0
    assert metrics["audit_completions"] == sum(len(g.completions) for g in audits)
    invalid, mismatched = pool.drain_rejections()
    feedback = sender_feedback(learner.sender_stats, trainable + audits, invalid, mismatched,
                               pool.drain_rejected_ids())
    reply = receiver.report(*feedback)
    assert reply.error.code == 0 and not reply.dropped_feedback, reply
    return {f.sender_node_id: f for f in feedback}


def test_newcomer_is_relayed_for_audit_only_and_released_by_k_reporters(
        world: World, model: torch.nn.Module) -> None:
    swarm = world.swarm
    before = swarm.honest_standing()
    newbie = world.node()
    # (d, in passing) a fresh sybil and a quarantined node: not established
    sybil = world.node()
    liar = world.node()
    (lease,) = liar.lease()
    lie = liar.honest_bundle(lease)
    lie.completions[0].claimed_reward = 0.0  # a wrong claim: -2, E = 1/4, quarantined
    assert liar.submit_bundle(lie).error.code == 0
    assert swarm.standing(liar)[1]
    ids = _submit(newbie, PROBATION_BUNDLES, model)
    assert world.in_probation(newbie) and world.audit(newbie) == reputation.AUDIT_PENDING

    # (a) who gets what: established receivers of the tokenizer, audit-only; nobody else
    for r in (*world.receivers, swarm.honest_b):
        got = _relayed(r, newbie, world)
        assert [b.bundle_id for b in got] == ids and all(b.audit_only for b in got)
    for outsider in (sybil, liar):
        assert _relayed(outsider, newbie, world) == []
    assert not any(b.audit_only for b in _relayed(sybil, swarm.honest_a, world))  # A: trainable

    # (b) one audit is not enough, the second (distinct, established) one releases it
    r1, r2 = world.receivers
    report = _receive_and_report(r1, copy.deepcopy(model), world, {newbie.node_id})
    fb = report[newbie.node_id]
    assert fb.log_ratio_completions == 2 * PROBATION_BUNDLES and abs(fb.mean_log_ratio) < 0.05
    assert sorted(fb.bundle_ids) == sorted(ids)
    assert world.state.audit_reports(newbie.node_id) == {r1.node_id: True}
    assert world.in_probation(newbie)
    _receive_and_report(r2, copy.deepcopy(model), world, {newbie.node_id})
    assert world.state.audit_reports(newbie.node_id) == {r1.node_id: True, r2.node_id: True}
    assert world.audit(newbie) == reputation.AUDIT_PASSED and not world.in_probation(newbie)
    # released: its bundles now reach everyone not quarantined, for training
    later = _submit(newbie, 1, model)
    got = _relayed(sybil, newbie, world)
    assert [b.bundle_id for b in got] == ids + later and not any(b.audit_only for b in got)
    score, quarantined = swarm.standing(newbie)
    assert score > 0.5 and not quarantined
    assert not any(e.kind == reputation.AUDIT_FAILED
                   for e in world.state.list_evidence(newbie.node_id, 1000))
    for r in world.receivers:  # the auditors were not charged
        assert all(e.weight > 0 for e in world.state.list_evidence(r.node_id, 1000))
    _assert_honest_kept_their_reputation(world, before)


def test_fabricated_logprobs_fail_the_audit(world: World, model: torch.nn.Module) -> None:
    swarm = world.swarm
    before = swarm.honest_standing()
    # (c) a model-less node computing answers: correct rewards, -0.7 per token
    faker = world.node()
    ids = _submit(faker, PROBATION_BUNDLES, None)
    faker_before, _ = swarm.standing(faker)
    assert faker_before > 0.8  # the count alone would have released it
    reports = [_receive_and_report(r, copy.deepcopy(model), world, {faker.node_id})
               for r in world.receivers]
    for report in reports:  # a near-uniform model: about -5.7 + 0.7 nats/token
        assert report[faker.node_id].mean_log_ratio < -1.5
    assert world.state.audit_reports(faker.node_id) == {r.node_id: False
                                                        for r in world.receivers}
    assert world.audit(faker) == reputation.AUDIT_FAILED_STATUS and world.in_probation(faker)
    rows = world.state.list_evidence(faker.node_id, 1000)
    failed = [e for e in rows if e.kind == reputation.AUDIT_FAILED]
    assert len(failed) == 1 and failed[0].weight == reputation.WEIGHT_AUDIT_FAILED
    assert sum(1 for e in rows if e.kind == reputation.FEEDBACK and e.weight < 0) == K
    score, _ = swarm.standing(faker)
    assert score < faker_before - 0.2
    # still on probation: its bundles, old and new, reach no one for training
    more = _submit(faker, 2, None)
    assert _relayed(swarm.attacker(), faker, world) == []
    assert all(b.audit_only for b in _relayed(swarm.honest_b, faker, world))
    assert world.audit(faker) == reputation.AUDIT_FAILED_STATUS
    assert len(ids + more) == PROBATION_BUNDLES + 2
    _assert_honest_kept_their_reputation(world, before)


def test_fresh_or_unaudited_identities_cannot_corroborate(
        world: World, model: torch.nn.Module) -> None:
    swarm = world.swarm
    before = swarm.honest_standing()
    target = world.node()
    ids = _submit(target, 2, None)
    # (d) two fresh sybils, and one that did the count's 5 verified bundles but was
    # never audited itself (on probation: not established)
    fresh = [world.node(), world.node()]
    counted = world.node()
    _submit(counted, PROBATION_BUNDLES, model)
    assert world.in_probation(counted)
    praise = swarm_pb2.SenderFeedback(
        sender_node_id=target.node_id, groups=1, tokens=20, mean_log_ratio=-0.1,
        log_ratio_completions=4, log_ratio_stderr=0.05, bundle_ids=ids)
    for sybil in (*fresh, counted):
        assert _relayed(sybil, target, world) == []  # never relayed to them
        reply = sybil.report(praise)
        assert reply.error.code == 0 and not reply.dropped_feedback
    assert world.state.audit_reports(target.node_id) == {}
    assert world.audit(target) == reputation.AUDIT_PENDING and world.in_probation(target)
    # the same praise from one established receiver that was relayed them counts once:
    # pending until a second, distinct one agrees
    r1 = world.receivers[0]
    assert [b.bundle_id for b in _relayed(r1, target, world)] == ids
    assert r1.report(praise).error.code == 0
    assert world.state.audit_reports(target.node_id) == {r1.node_id: True}
    assert r1.report(praise).error.code == 0  # the same bundles again: not counted
    assert world.audit(target) == reputation.AUDIT_PENDING
    # nor does praise lift the sybils themselves
    for sybil in (*fresh, counted):
        assert world.in_probation(sybil)
    _assert_honest_kept_their_reputation(world, before)


def test_an_older_client_is_never_relayed_audit_only_bundles(
        world: World, model: torch.nn.Module) -> None:
    """An established receiver whose client registered without the ``audit-only-relay``
    capability (a release before it, which would train on audit-only bundles) is
    relayed none of a probation sender's bundles, and its report naming them is no
    audit; registering again from this release's client restores both."""
    r1, r2 = world.receivers
    reply = r2.stub.Register(swarm_pb2.RegisterRequest(envelope=register_envelope(
        r2.identity, r2.card, now_ms(), capabilities=())), timeout=30)
    assert reply.error.code == 0
    record = world.state.get_node(r2.node_id)
    assert record is not None and record.capabilities == ()
    assert not world.in_probation(r2)  # still established: only the capability is missing
    newbie = world.node()
    ids = _submit(newbie, 2, model)
    _submit(world.swarm.honest_a, 1, None)  # a later bundle: R2's page reaches past ids
    assert _relayed(r2, newbie, world) == []
    assert [b.bundle_id for b in _relayed(r1, newbie, world)] == ids
    praise = swarm_pb2.SenderFeedback(
        sender_node_id=newbie.node_id, groups=1, tokens=20, mean_log_ratio=-0.1,
        log_ratio_completions=4, log_ratio_stderr=0.05, bundle_ids=ids)
    assert r2.report(praise).error.code == 0
    assert world.state.audit_reports(newbie.node_id) == {}
    assert r2.register().error.code == 0  # this release's client: the capability is back
    record = world.state.get_node(r2.node_id)
    assert record is not None and record.capabilities == ("audit-only-relay",)
    got = _relayed(r2, newbie, world)
    assert [b.bundle_id for b in got] == ids and all(b.audit_only for b in got)


def test_volunteer_nodes_audit_a_newcomer_in_their_round_loop(tmp_path: Path,
                                                              tiny_model_dir: Path,
                                                              tiny_policy_factory) -> None:
    """The real client round loop (``VolunteerNode.run_round``) with k = 1: a seeded,
    established receiver R is relayed a newcomer N's bundles audit-only, trains on none
    of them, audits them (its bundles have zero reward variance with a random tiny model:
    relayed for audit all the same) and reports; N is released; afterwards N's bundles
    are relayed to anyone, for training."""
    import random

    from ftis.client.node.config import ClientConfig
    from ftis.client.node.runner import VolunteerNode
    from ftis.client.swarm.connection import RetryPolicy, SwarmConnection

    keys = {name: tmp_path / name / "node_key.pem" for name in ("r", "n")}
    ids = {name: NodeIdentity.load_or_create(key) for name, key in keys.items()}
    server = CoordinatorServer(make_config(
        db=str(tmp_path / "coordinator.db"), tasks=[{"dataset": "letter_counting"}],
        reputation={"reporter_maturity_s": 0, "audit_reporters": 1, "probation_bundles": 2},
        audit_seed_nodes=[ids["r"].node_id]))
    server.start()
    try:
        def node(name: str) -> VolunteerNode:
            policy = tiny_policy_factory()
            cfg = ClientConfig(coordinator=server.address, model=str(tiny_model_dir),
                               rounds=0, local_groups=2, external_groups=2, group_size=4,
                               max_new_tokens=8, learning_rate=1e-4, out=tmp_path / name,
                               key_file=keys[name])
            conn = SwarmConnection(server.address, ids[name], policy.card,
                                   tokenizer_json=policy.tokenizer_json,
                                   retry=RetryPolicy(base_s=0.05, cap_s=0.5, max_outage_s=30),
                                   rng=random.Random(0))
            conn.register()
            return VolunteerNode(cfg, policy, conn)

        r, n = node("r"), node("n")
        state, policy = server.state, server.ctx.policy

        def record(v: VolunteerNode):  # noqa: ANN202
            got = state.get_node(v.conn.node_id)
            assert got is not None
            return got

        r.run_round()  # R: 2 verified bundles, seeded: established
        assert not reputation.in_probation(record(r).bundles_accepted, record(r).audit_status,
                                           policy)
        n.run_round()  # N: 2 verified bundles, audit pending
        assert record(n).bundles_accepted == 2 and record(n).audit_status == 0
        result = r.run_round()  # R: relayed N's bundles audit-only, audits, reports
        assert result.metrics["audit_groups"] == 2 and result.metrics["external_groups_used"] == 0
        assert result.metrics["audit_completions"] == 8
        assert state.audit_reports(n.conn.node_id) == {r.conn.node_id: True}
        assert record(n).audit_status == reputation.AUDIT_PASSED
        n.run_round()  # released: N's bundles are relayed for training, to anyone
        result = r.run_round()
        assert result.metrics["audit_groups"] == 0
        page, _ = state.pull_bundles(
            requester_id="0" * 32, cursor=0, limit=64, max_bytes=10**7,
            audit=AuditRelay(2, established=False, fingerprint=record(n).fingerprint))
        assert [b.audit_only for b in page if b.node_id == n.conn.node_id] == [False] * 4
    finally:
        server.stop(grace=1.0)
