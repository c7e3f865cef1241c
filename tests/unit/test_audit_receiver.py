"""Receivers of audit-only relays (audit-based probation, docs/reputation.md): the pool
keeps them apart from trainable groups, the learner never trains on them, and
:meth:`Learner.audit` records the same log-ratio statistics a trained external group
gets, which ``sender_feedback`` reports with the audited bundle ids."""

from __future__ import annotations

import copy
import random

import pytest
import torch

from ftis.client.learner.trainer import Learner, LearnerConfig
from ftis.client.node.runner import sender_feedback
from ftis.client.rollout.groups import RolloutGroup
from ftis.client.swarm.external_pool import ExternalPool
from ftis.protocol.envelope import seal
from ftis.protocol.identity import NodeIdentity
from ftis.v1 import bundle_pb2, swarm_pb2

FP = "ab" * 32


def _relayed(identity, seq, rewards=(1.0, 0.0), fingerprint=FP, audit_only=False):
    bundle = bundle_pb2.Bundle(
        task_id=f"t{seq}", lease_id=f"l{seq}", node_id=identity.node_id,
        model_card=bundle_pb2.ModelCard(tokenizer_fingerprint=fingerprint, vocab_size=100),
        sampling=bundle_pb2.SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=8),
        prompt_token_ids=[1, 2, 3],
        completions=[bundle_pb2.Completion(token_ids=[5, 6], logprobs=[-0.5, -1.0],
                                           text="x y") for _ in rewards],
    )
    return swarm_pb2.RelayedBundle(sequence=seq, bundle_id=f"b{seq}",
                                   envelope=seal("bundle", bundle, identity),
                                   verified_rewards=list(rewards), audit_only=audit_only)


def test_pool_keeps_audit_only_groups_out_of_the_training_draw() -> None:
    me, peer, newbie = (NodeIdentity.generate() for _ in range(3))
    pool = ExternalPool(me.node_id, vocab_size=100, fingerprint=FP, rng=random.Random(0))
    assert pool.add(_relayed(peer, 1))
    assert pool.add(_relayed(newbie, 2, audit_only=True))
    # zero reward variance does not matter for an audit (log-probs are compared)
    assert pool.add(_relayed(newbie, 3, rewards=(1.0, 1.0), audit_only=True))
    # another tokenizer cannot be audited token by token: dropped
    assert not pool.add(_relayed(newbie, 4, fingerprint="cd" * 32, audit_only=True))
    taken = pool.take(10)
    assert [g.sender for g in taken] == [peer.node_id]
    assert not taken[0].meta.get("audit_only")
    audits = pool.take_audits(1)
    assert [g.meta["bundle_id"] for g in audits] == ["b2"] and audits[0].meta["audit_only"]
    assert [g.meta["bundle_id"] for g in pool.take_audits(5)] == ["b3"]
    assert pool.take_audits(5) == [] and pool.take(10) == []


def _audit_group(sender: str) -> RolloutGroup:
    return RolloutGroup([1, 5], [[7, 8, 2, 4], [9, 2]], [[-5.0, -6.0, -5.5, -5.0], [-5.0, -5.1]],
                        [0.0, 1.0], local=False, sender=sender,
                        meta={"bundle_id": "bx", "audit_only": True})


def test_learner_never_trains_on_audit_only_groups(tiny_policy_factory) -> None:
    pol = tiny_policy_factory()
    learner = Learner(copy.deepcopy(pol.model), LearnerConfig(learning_rate=1e-2), 0)
    before = {n: p.detach().clone() for n, p in learner.model.named_parameters()}
    m = learner.step([_audit_group("newbie")])
    assert m["samples"] == 0 and m["updated"] == 0.0 and learner.updates == 0
    assert all(torch.equal(p, before[n]) for n, p in learner.model.named_parameters())


def test_audit_reports_what_training_would_without_updating(tiny_policy_factory) -> None:
    pol = tiny_policy_factory()
    trained = Learner(copy.deepcopy(pol.model), LearnerConfig(learning_rate=0.0), 0)
    plain = _audit_group("newbie")
    plain.meta = {"bundle_id": "bx"}
    trained.step([plain])  # the same group as a trainable external group, lr 0
    expected = trained.sender_stats["newbie"]

    auditor = Learner(copy.deepcopy(pol.model), LearnerConfig(learning_rate=1e-2), 0)
    before = {n: p.detach().clone() for n, p in auditor.model.named_parameters()}
    m = auditor.step([], audit=[_audit_group("newbie")])
    assert m["audit_completions"] == 2 and m["updated"] == 0.0
    got = auditor.sender_stats["newbie"]
    assert all(torch.equal(p, before[n]) for n, p in auditor.model.named_parameters())
    assert auditor.updates == 0
    assert (got.completions, got.tokens, got.log_ratio_completions) == (2, 6, 2)
    assert got.mean_log_ratio == pytest.approx(expected.mean_log_ratio, abs=1e-5)
    assert got.log_ratio_stderr == pytest.approx(expected.log_ratio_stderr, abs=1e-5)
    # the feedback entry names the audited bundle, with the statistics the coordinator judges
    (fb,) = sender_feedback(auditor.sender_stats, [_audit_group("newbie")])
    assert fb.sender_node_id == "newbie" and list(fb.bundle_ids) == ["bx"]
    assert fb.log_ratio_completions == 2 and fb.tokens == 6
    assert fb.mean_log_ratio == pytest.approx(got.mean_log_ratio)
