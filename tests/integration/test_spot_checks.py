"""Spot checks over real gRPC (issue 13, class 1): a coordinator that holds the weights
of the swarm's model (a tiny random Llama on disk, loaded in a spawned worker exactly as a
volunteer loads it) accepts an honest node's sampled bundles and refuses made-up and
shaded log-probs, which quarantines the sender while it is on probation. With
audit-based probation on and no seeds, a passed spot check is the coordinator's own
audit: it bootstraps the first established nodes of a card it holds."""

from __future__ import annotations

import gzip
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch

from ftis.client.models.loader import Policy, load_policy
from ftis.client.rollout.sampler import SamplingSettings, sample_groups
from ftis.coordinator import reputation
from ftis.coordinator.server.app import CoordinatorServer
from ftis.lab.harness.coordinator import make_config
from ftis.lab.harness.trust_swarm import MAX_NEW_TOKENS, Node, answer_of, now_ms
from ftis.protocol.errors import ErrorCode
from ftis.protocol.identity import NodeIdentity
from ftis.v1 import bundle_pb2, swarm_pb2_grpc

SAMPLING = SamplingSettings(temperature=0.7, max_new_tokens=MAX_NEW_TOKENS)


@pytest.fixture(scope="module")
def policy(tiny_model_dir: Path) -> Policy:
    return load_policy(str(tiny_model_dir))


@pytest.fixture(scope="module")
def served(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[tuple[CoordinatorServer, swarm_pb2_grpc.SwarmStub]]:
    db = tmp_path_factory.mktemp("spot") / "coordinator.db"
    server = CoordinatorServer(make_config(
        db=str(db), require_tokenizer=True,
        spot_checks={"models": [str(tiny_model_dir)], "workers": 1, "budget_s": 60,
                     "min_tokens": 4, "required": True}))
    server.start()
    channel = grpc.insecure_channel(server.address)
    try:
        yield server, swarm_pb2_grpc.SwarmStub(channel)
    finally:
        channel.close()
        server.stop(grace=1.0)


def _node(stub: swarm_pb2_grpc.SwarmStub, policy: Policy,
          card: bundle_pb2.ModelCard | None = None) -> Node:
    node = Node(NodeIdentity.generate(), stub, card or policy.card,
                tokenizer=policy.tokenizer.backend_tokenizer)
    assert node.register().error.code == 0
    return node


def _sampled_bundle(node: Node, policy: Policy, seed: int) -> bundle_pb2.Bundle:
    """What the volunteer client sends (``VolunteerNode.make_bundle``): sampled tokens,
    the sampler's own log-probs, text = decode(ids), no claimed reward."""
    (lease,) = node.lease()
    prompt, text = policy.prompt_token_ids([{"role": m.role, "content": m.content}
                                            for m in lease.messages])
    result = sample_groups(policy.model, [prompt], lease.group_size, SAMPLING,
                           policy.eos_token_ids, policy.tokenizer.pad_token_id,
                           torch.Generator().manual_seed(seed))
    return bundle_pb2.Bundle(
        task_id=lease.task_id, lease_id=lease.lease_id, node_id=node.node_id,
        model_card=policy.card, policy_version=0, sampling=SAMPLING.to_proto(),
        prompt_token_ids=prompt, prompt_text=text, created_at_ms=now_ms(),
        completions=[bundle_pb2.Completion(token_ids=c.token_ids, logprobs=c.logprobs,
                                           text=policy.decode(c.token_ids),
                                           finish_reason=c.finish_reason)
                     for c in result.completions[0]])


def _standing(server: CoordinatorServer, node: Node) -> tuple[float, bool]:
    record = server.state.get_node(node.node_id)
    assert record is not None and not record.banned
    return (reputation.current_score(record.standing, now_ms(),
                                     server.ctx.policy.half_life_s), record.quarantined)


def test_an_honest_node_passes_and_leaves_probation(served, policy) -> None:
    server, stub = served
    node = _node(stub, policy)
    gz = gzip.compress(policy.tokenizer.backend_tokenizer.to_str().encode())
    assert node.upload(gz).error.code == 0
    checker = server.ctx.spot_checks
    assert checker is not None
    before = checker.counts["passed"] + checker.counts["failed"]
    for seed in range(6):  # probation_bundles = 5: every one of them is checked
        reply = node.submit_bundle(_sampled_bundle(node, policy, seed))
        assert reply.error.code == 0, reply.error
    checked = checker.counts["passed"] + checker.counts["failed"] - before
    assert checked >= 5 and checker.counts["failed"] == 0
    score, quarantined = _standing(server, node)
    assert not quarantined and score > 0.8  # E = (6 + 1) / (6 + 2)


def test_made_up_and_shaded_logprobs_are_refused(served, policy) -> None:
    server, stub = served
    # a model-less node that computes the answer and makes up log-probs (issue 13's
    # answer_computer): every other check passes
    computer = _node(stub, policy)
    (lease,) = computer.lease()
    tok = policy.tokenizer.backend_tokenizer
    ids = tok.encode(f"The answer is {answer_of(lease)}. <answer>{answer_of(lease)}</answer>",
                     add_special_tokens=False).ids
    prompt, text = policy.prompt_token_ids([{"role": m.role, "content": m.content}
                                            for m in lease.messages])
    made_up = bundle_pb2.Bundle(
        task_id=lease.task_id, lease_id=lease.lease_id, node_id=computer.node_id,
        model_card=policy.card, sampling=SAMPLING.to_proto(), prompt_token_ids=prompt,
        prompt_text=text, created_at_ms=now_ms(),
        completions=[bundle_pb2.Completion(token_ids=ids, logprobs=[-0.7] * len(ids),
                                           text=policy.decode(ids))] * 2)
    reply = computer.submit_bundle(made_up)
    assert reply.error.code == ErrorCode.LOGPROB_SPOT_CHECK_FAILED, reply.error
    assert "nats/token" in reply.error.reason
    score, quarantined = _standing(server, computer)
    assert quarantined and score == pytest.approx(1 / 6, abs=1e-3)  # one -4 event
    assert server.state.list_bundles(computer.node_id, 10) == []

    # a node with the model that inflates its log-probs by 1 nat/token (logprob_shade)
    shader = _node(stub, policy)
    bundle = _sampled_bundle(shader, policy, seed=11)
    for c in bundle.completions:
        c.logprobs[:] = [min(x + 1.0, 0.0) for x in c.logprobs]
    reply = shader.submit_bundle(bundle)
    assert reply.error.code == ErrorCode.LOGPROB_SPOT_CHECK_FAILED, reply.error


def test_a_card_the_coordinator_does_not_hold_cannot_register(served, policy) -> None:
    _, stub = served
    other = bundle_pb2.ModelCard()
    other.CopyFrom(policy.card)
    other.base_model = "some/other-model"
    node = Node(NodeIdentity.generate(), stub, other)
    assert node.register().error.code == ErrorCode.MODEL_NOT_CHECKABLE


def test_a_passed_spot_check_is_the_audit_of_a_held_card(
        tiny_model_dir: Path, tmp_path: Path, policy: Policy) -> None:
    """Audit-based probation on (k = 2) with no seeds and no established receiver: an
    honest node of the held card passes its audit on its first checked bundle and is
    established after the count; a node of a card the coordinator does not hold is never
    checked and stays on probation (only receivers' audits or a seed can pass it)."""
    server = CoordinatorServer(make_config(
        db=str(tmp_path / "coordinator.db"), require_tokenizer=True,
        reputation={"audit_reporters": 2},
        spot_checks={"models": [str(tiny_model_dir)], "workers": 1, "budget_s": 60,
                     "min_tokens": 4}))
    server.start()
    channel = grpc.insecure_channel(server.address)
    try:
        stub = swarm_pb2_grpc.SwarmStub(channel)
        policy_cfg = server.ctx.policy
        honest = _node(stub, policy)
        gz = gzip.compress(policy.tokenizer.backend_tokenizer.to_str().encode())
        assert honest.upload(gz).error.code == 0
        unheld_card = bundle_pb2.ModelCard()
        unheld_card.CopyFrom(policy.card)
        unheld_card.base_model = "someone/else"
        other = _node(stub, policy, unheld_card)
        assert server.state.get_node(honest.node_id).audit_status == reputation.AUDIT_PENDING
        reply = honest.submit_bundle(_sampled_bundle(honest, policy, 0))
        assert reply.error.code == 0, reply.error
        record = server.state.get_node(honest.node_id)
        assert record.audit_status == reputation.AUDIT_PASSED
        assert reputation.in_probation(record.bundles_accepted, record.audit_status,
                                       policy_cfg)  # the count still applies: 1 of 5
        for seed in range(1, 5):
            assert honest.submit_bundle(_sampled_bundle(honest, policy, seed)).error.code == 0
        for seed in range(5):
            bundle = _sampled_bundle(other, policy, 10 + seed)
            bundle.model_card.CopyFrom(unheld_card)
            assert other.submit_bundle(bundle).error.code == 0
        record = server.state.get_node(honest.node_id)
        assert not reputation.in_probation(record.bundles_accepted, record.audit_status,
                                           policy_cfg)
        assert reputation.established(record.bundles_accepted, record.audit_status,
                                      record.quarantined, record.banned, policy_cfg)
        unchecked = server.state.get_node(other.node_id)
        assert unchecked.bundles_accepted == 5
        assert unchecked.audit_status == reputation.AUDIT_PENDING
        assert reputation.in_probation(unchecked.bundles_accepted, unchecked.audit_status,
                                       policy_cfg)
    finally:
        channel.close()
        server.stop(grace=1.0)
