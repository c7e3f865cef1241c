"""Receivers re-verify relayed bundles before they can reach the learner."""

import random

import pytest

from ftis.client.swarm.external_pool import ExternalPool
from ftis.protocol.envelope import seal
from ftis.protocol.identity import NodeIdentity
from ftis.v1 import bundle_pb2, swarm_pb2

FP = "ab" * 32


def _relayed(identity, seq, rewards=(1.0, 0.0), token=5, fingerprint=FP, version=0,
             reputation=0.0):
    bundle = bundle_pb2.Bundle(
        task_id=f"t{seq}", lease_id=f"l{seq}", node_id=identity.node_id,
        model_card=bundle_pb2.ModelCard(tokenizer_fingerprint=fingerprint, vocab_size=100),
        policy_version=version,
        sampling=bundle_pb2.SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=8),
        prompt_token_ids=[1, 2, 3],
        completions=[bundle_pb2.Completion(token_ids=[token, 6], logprobs=[-0.5, -1.0],
                                           text="x y", claimed_reward=r) for r in rewards],
    )
    return swarm_pb2.RelayedBundle(sequence=seq, bundle_id=f"b{seq}",
                                   envelope=seal("bundle", bundle, identity),
                                   verified_rewards=list(rewards),
                                   sender_reputation=reputation)


def test_pool_keeps_valid_and_drops_bad_bundles():
    me, peer = NodeIdentity.generate(), NodeIdentity.generate()
    pool = ExternalPool(me.node_id, vocab_size=100, fingerprint=FP, rng=random.Random(0))
    assert pool.add(_relayed(peer, 1))
    tampered = _relayed(peer, 2)
    tampered.envelope.payload = tampered.envelope.payload[:-1] + bytes(
        [tampered.envelope.payload[-1] ^ 1])
    assert not pool.add(tampered)
    assert not pool.add(_relayed(me, 3))  # own bundle
    assert not pool.add(_relayed(peer, 4, token=100))  # outside the receiver's vocabulary
    assert not pool.add(_relayed(peer, 5, fingerprint="cd" * 32))
    assert not pool.add(_relayed(peer, 6, rewards=(1.0, 1.0)))  # zero variance: no signal
    assert pool.cursor == 6 and len(pool.groups) == 1 and pool.rejected == 4
    group = pool.take(3)[0]
    assert group.local is False and group.sender == peer.node_id
    assert group.rewards == [1.0, 0.0] and group.gen_logprobs[0] == [-0.5, -1.0]
    assert pool.take(1) == []  # each group is used once


def test_pool_drops_stale_groups():
    me, peer = NodeIdentity.generate(), NodeIdentity.generate()
    pool = ExternalPool(me.node_id, 100, FP, max_policy_lag=2)
    for seq, version in enumerate([0, 5, 6], start=1):
        pool.add(_relayed(peer, seq, version=version))
    taken = pool.take(5)
    assert sorted(g.policy_version for g in taken) == [5, 6]


def test_pool_checks_text_against_tokens_and_counts_per_sender():
    me, peer = NodeIdentity.generate(), NodeIdentity.generate()
    pool = ExternalPool(me.node_id, 100, FP, decode=lambda ids: "x y")
    assert pool.add(_relayed(peer, 1))
    lying = _relayed(peer, 2)
    bundle = bundle_pb2.Bundle()
    bundle.ParseFromString(lying.envelope.payload)
    bundle.completions[0].text = "7"
    lying.envelope.CopyFrom(seal("bundle", bundle, peer))
    assert not pool.add(lying)
    assert not pool.add(_relayed(peer, 3, token=100))
    invalid, mismatched = pool.drain_rejections()
    assert mismatched == {peer.node_id: 1} and invalid == {peer.node_id: 1}
    assert pool.drain_rejections() == ({}, {})
    # feedback names the rejected bundles (the coordinator counts only relayed ones)
    assert pool.drain_rejected_ids() == {peer.node_id: [lying.bundle_id,
                                                         _relayed(peer, 3).bundle_id]}
    assert pool.drain_rejected_ids() == {}


def test_sampling_follows_sender_reputation():
    me, trusted, doubtful = (NodeIdentity.generate() for _ in range(3))
    picks = {trusted.node_id: 0, doubtful.node_id: 0}
    for trial in range(200):
        pool = ExternalPool(me.node_id, 100, FP, rng=random.Random(trial))
        a, b = _relayed(trusted, 1), _relayed(doubtful, 2)
        a.sender_reputation, b.sender_reputation = 0.9, 0.1
        pool.add(a)
        pool.add(b)
        (g,) = pool.take(1)
        picks[g.sender] += 1
    # P(trusted first) = 0.9 / (0.9 + 0.1) = 0.9 for weighted sampling without replacement
    assert 160 <= picks[trusted.node_id] <= 195


def test_a_huge_policy_version_only_stales_its_own_sender():
    me, honest, liar = (NodeIdentity.generate() for _ in range(3))
    pool = ExternalPool(me.node_id, 100, FP, max_policy_lag=2)
    pool.add(_relayed(honest, 1, version=3))
    pool.add(_relayed(liar, 2, version=0))
    pool.add(_relayed(liar, 3, version=2**62))
    taken = pool.take(5)
    assert sorted(g.policy_version for g in taken) == [3, 2**62]


def test_take_never_returns_a_zero_variance_group():
    """SAPO as written: the J external groups are drawn only among informative groups,
    however many uninformative ones (all rewards equal) were relayed."""
    me = NodeIdentity.generate()
    peers = [NodeIdentity.generate() for _ in range(3)]
    pool = ExternalPool(me.node_id, 100, FP, rng=random.Random(0))
    informative = 0
    for seq in range(1, 121):
        peer = peers[seq % 3]
        flat = seq % 5 != 0  # 4 of 5 bundles carry no signal
        rewards = (float(seq % 2),) * 3 if flat else (1.0, 0.0, 0.0)
        # the uninformative ones come from the best-reputed senders
        kept = pool.add(_relayed(peer, seq, rewards=rewards,
                                 reputation=0.99 if flat else 0.05))
        assert kept is not flat
        informative += not flat
    assert pool.zero_variance_dropped == 120 - informative and pool.rejected == 0
    taken = []
    while batch := pool.take(4):
        assert all(not g.reward_variance_zero for g in batch)
        taken += batch
    assert len(taken) == informative == 24
    assert len({g.meta["bundle_id"] for g in taken}) == 24 and not pool.weights


def test_groups_are_built_from_the_bundle():
    from ftis.client.rollout.groups import RolloutGroup

    me, peer = NodeIdentity.generate(), NodeIdentity.generate()
    relayed = _relayed(peer, 7, rewards=(0.0, 1.0), version=3)
    pool = ExternalPool(me.node_id, 100, FP)
    assert pool.add(relayed)
    (group,) = pool.take(1)
    bundle = bundle_pb2.Bundle()
    bundle.ParseFromString(relayed.envelope.payload)
    # the same builder serves the learner's own bundles
    own = RolloutGroup.from_bundle(bundle, [0.0, 1.0], local=True)
    assert own.local and not group.local
    for g in (own, group):
        assert (g.prompt_ids, g.completions, g.sender, g.policy_version, g.task_id) == (
            [1, 2, 3], [[5, 6], [5, 6]], peer.node_id, 3, "t7")
        assert g.gen_logprobs == [[-0.5, -1.0], [-0.5, -1.0]] and not g.cross_tokenizer
    assert group.meta["bundle_id"] == "b7"
    with pytest.raises(ValueError):
        RolloutGroup.from_bundle(bundle, [1.0], local=True)


def test_rejections_carry_named_codes_and_only_the_senders_faults_count():
    from ftis.protocol.errors import ErrorCode, LocalErrorCode

    me, peer, other = (NodeIdentity.generate() for _ in range(3))
    pool = ExternalPool(me.node_id, 100, FP, decode=lambda ids: "x y")
    tampered = _relayed(peer, 1)
    tampered.envelope.payload = tampered.envelope.payload[:-1] + bytes(
        [tampered.envelope.payload[-1] ^ 1])
    foreign_id = _relayed(peer, 5)
    bundle = bundle_pb2.Bundle()
    bundle.ParseFromString(foreign_id.envelope.payload)
    bundle.node_id = other.node_id  # signed by peer, claims to be other
    foreign_id.envelope.CopyFrom(seal("bundle", bundle, peer))
    short_rewards = _relayed(peer, 6)
    del short_rewards.verified_rewards[1:]
    lying = _relayed(peer, 7)
    bundle = bundle_pb2.Bundle()
    bundle.ParseFromString(lying.envelope.payload)
    bundle.completions[0].text = "7"
    lying.envelope.CopyFrom(seal("bundle", bundle, peer))
    cases = [
        (tampered, ErrorCode.SIGNATURE_INVALID),
        (_relayed(me, 2), LocalErrorCode.RELAY_OWN_BUNDLE),
        (_relayed(peer, 3, fingerprint="cd" * 32), LocalErrorCode.TOKENIZER_FOREIGN),
        (_relayed(peer, 4, token=100), ErrorCode.TOKEN_OUT_OF_VOCAB),
        (foreign_id, ErrorCode.NODE_MISMATCH),
        (short_rewards, LocalErrorCode.RELAY_REWARDS_MISMATCH),
        (lying, ErrorCode.TEXT_MISMATCH),
    ]
    for relayed, code in cases:
        before = pool.rejected_by_code[code]
        assert not pool.add(relayed)
        assert pool.rejected_by_code[code] == before + 1, code
    assert pool.rejected == len(cases) == sum(pool.rejected_by_code.values())
    invalid, mismatched = pool.drain_rejections()
    # only what the sender signed counts against it: out-of-vocabulary tokens and a node
    # id that is not its own; never the receiver itself (feedback about oneself is refused)
    assert invalid == {peer.node_id: 2} and mismatched == {peer.node_id: 1}


def test_a_foreign_bundle_that_cannot_be_retokenized_is_not_held_against_the_sender():
    from ftis.protocol.errors import LocalErrorCode

    me, peer = NodeIdentity.generate(), NodeIdentity.generate()
    # no task question: re-tokenizing fails before the retokenizer is used
    pool = ExternalPool(me.node_id, 100, FP, retokenizer=object())
    assert not pool.add(_relayed(peer, 1, fingerprint="cd" * 32))
    assert pool.rejected_by_code == {LocalErrorCode.RETOKENIZE_FAILED: 1}
    assert pool.drain_rejections() == ({}, {})


def test_local_error_codes_are_named_never_sent_and_documented():
    import ast
    import re
    from pathlib import Path

    from ftis.protocol.errors import (
        LOCAL_ERROR_CODES,
        ErrorCode,
        FtisError,
        LocalErrorCode,
        code_name,
    )

    assert LOCAL_ERROR_CODES and all(170 <= c < 180 for c in LOCAL_ERROR_CODES)
    assert not set(LOCAL_ERROR_CODES) & set(ErrorCode.values())  # free in the wire enum
    assert code_name(LocalErrorCode.RELAY_OWN_BUNDLE) == "RELAY_OWN_BUNDLE"
    assert code_name(ErrorCode.TEXT_MISMATCH) == "TEXT_MISMATCH"
    error = FtisError(LocalErrorCode.TOKENIZER_FOREIGN, "x")
    assert str(error) == "TOKENIZER_FOREIGN: x"
    with pytest.raises(ValueError):
        error.to_proto()
    assert FtisError(ErrorCode.NODE_MISMATCH, "y").to_proto().code == ErrorCode.NODE_MISMATCH

    root = Path(__file__).resolve().parents[2]
    rows = dict(re.findall(r"^\| (\d+) \| `([A-Z_]+)` \|", (root / "docs" / "error-codes.md")
                           .read_text(), re.MULTILINE))
    expected = {str(v): k for k, v in ErrorCode.items()} | {
        str(v): k for v, k in LOCAL_ERROR_CODES.items()}
    assert rows == expected

    # no bare numbers: every FtisError in the programs' source names its code
    for directory in ("client/ftis/client", "coordinator/ftis/coordinator", "proto/ftis"):
        for path in (root / directory).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                        and node.func.id == "FtisError" and node.args
                        and isinstance(node.args[0], ast.Constant)):
                    raise AssertionError(f"{path}:{node.lineno}: FtisError with a bare number")


def test_one_sender_cannot_fill_the_batch():
    """Issue 13, class 4: a sender with a far higher reputation (or one that floods the
    relay) still contributes at most ``max_per_sender`` groups; the others fill the rest."""
    me, flood, other = (NodeIdentity.generate() for _ in range(3))
    pool = ExternalPool(me.node_id, 100, FP, rng=random.Random(0))
    for seq in range(1, 7):
        pool.add(_relayed(flood, seq, reputation=0.99))
    for seq in range(7, 9):
        pool.add(_relayed(other, seq, reputation=0.01))
    taken = pool.take(4, max_per_sender=2)
    assert sorted(g.sender == flood.node_id for g in taken) == [False, False, True, True]
    # with only the capped sender left, it still gets no more than its cap
    assert [g.sender for g in pool.take(4, max_per_sender=2)] == [flood.node_id] * 2
    assert len(pool.groups) == 2  # its other groups wait for later rounds


@pytest.mark.parametrize(("local", "external", "share", "cap"), [
    (2, 2, 0.5, 2), (4, 4, 0.5, 4), (1, 3, 0.5, 2), (2, 2, 0.25, 1), (1, 1, 0.1, 1)])
def test_the_cap_is_a_share_of_the_whole_batch(local, external, share, cap):
    from ftis.client.node.config import ClientConfig

    cfg = ClientConfig(coordinator="127.0.0.1:1", model="x", local_groups=local,
                       external_groups=external, max_sender_share=share)
    assert cfg.max_groups_per_sender == cap
