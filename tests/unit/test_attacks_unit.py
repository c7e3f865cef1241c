"""Each attacker's forgery does what it says, on synthetic bundles; plus the security
experiment's bookkeeping (detection round, verdicts, table) on synthetic records."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from types import SimpleNamespace

import pytest

from ftis.client.node.runner import VolunteerNode
from ftis.client.rollout.groups import RolloutGroup
from ftis.lab.attack import ATTACK_KINDS, KINDS, mutations
from ftis.lab.attack.nodes import (
    NODE_CLASSES,
    AttackLog,
    AttackOptions,
    FabricatedPromptNode,
    FalseReporterNode,
    ReplayNode,
    TextMismatchNode,
    read_attack_log,
)
from ftis.protocol.bundles import BundleLimits, check_structure
from ftis.protocol.envelope import open_envelope, seal
from ftis.protocol.errors import ErrorCode, FtisError
from ftis.protocol.identity import NodeIdentity
from ftis.tasks import render_messages, score_completion
from ftis.v1 import bundle_pb2, common_pb2, swarm_pb2

VOCAB, G = 300, 4
CARD = bundle_pb2.ModelCard(base_model="tiny", tokenizer_fingerprint="f" * 64, vocab_size=VOCAB)


def _bundle(seed: int = 0, node_id: str = "n" * 32) -> bundle_pb2.Bundle:
    rng = random.Random(seed)
    comps = []
    for _ in range(G):
        n = rng.randint(2, 6)
        comps.append(bundle_pb2.Completion(
            token_ids=[rng.randrange(3, VOCAB) for _ in range(n)],
            logprobs=[-rng.uniform(0.1, 6.0) for _ in range(n)], text=f"text {seed}",
            claimed_reward=0.0, finish_reason=bundle_pb2.FINISH_REASON_LENGTH))
    return bundle_pb2.Bundle(
        task_id=f"task{seed}", lease_id=f"lease{seed}", node_id=node_id, model_card=CARD,
        sampling=bundle_pb2.SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=8),
        prompt_token_ids=[1, 5, 6, 7], prompt_text="prompt", completions=comps,
        created_at_ms=1)


def _lease(question: str = "How many 'r' are in 'strawberry'?",
           group_size: int = G) -> swarm_pb2.TaskLease:
    return swarm_pb2.TaskLease(
        lease_id="mylease", task_id="mytask", dataset="letter_counting",
        messages=[common_pb2.ChatMessage(**m) for m in render_messages(question)],
        question=question, group_size=group_size, max_new_tokens=8)


def _lps(b: bundle_pb2.Bundle) -> list[list[float]]:
    return [list(c.logprobs) for c in b.completions]


def test_kinds_all_have_a_node_class():
    assert set(NODE_CLASSES) == set(KINDS)
    assert "honest" not in ATTACK_KINDS and len(ATTACK_KINDS) == 14
    assert {"logprob_shade", "sybil_feedback", "answer_computer"} <= set(ATTACK_KINDS)
    from ftis.lab.experiment.security import EXPECTED_CODES

    assert set(EXPECTED_CODES) == set(ATTACK_KINDS)


def test_logprob_shade_lowers_every_logprob_by_ln_c():
    from ftis.client.learner.loss import LossConfig
    from ftis.lab.attack.nodes import AttackOptions

    assert AttackOptions().shade_truncation == LossConfig().truncation == 2.0
    b = _bundle()
    out = mutations.shade_logprobs(b, 2.0)
    for before, after in zip(_lps(b), _lps(out), strict=True):
        assert [x - y for x, y in zip(before, after, strict=True)] == pytest.approx(
            [math.log(2.0)] * len(before))
    assert _lps(b) == _lps(_bundle())  # the input is untouched
    assert out.completions[0].token_ids == b.completions[0].token_ids
    check_structure(out, BundleLimits(G, 8, VOCAB))  # still a valid bundle
    for bad in (1.0, 0.5, math.inf):
        with pytest.raises(ValueError):
            mutations.shade_logprobs(b, bad)


@pytest.mark.parametrize(("dataset", "question", "answer"), [
    ("chain_sum", "State the final answer to the following arithmetic problem: "
                  "12 + 7 - 30 =", "-11"),
    ("products", "Solve the following multiplication: 123 * 45. Give only the result "
                 "as your final answer.", "5535"),
    ("gcd", "Find the Greatest Common Divisor (GCD) of these numbers: 462, 1071. Give "
            "only the GCD as your final answer.", "21"),
    ("letter_counting", "How many 'r' are in 'strawberry'?", None),
    ("chain_sum", "What is: 3 * 4 =", None),
])
def test_computed_answer_parses_arithmetic_questions(dataset, question, answer):
    assert mutations.computed_answer(dataset, question) == answer


def test_computed_bundle_encodes_answers_with_the_tokenizer_and_made_up_logprobs():
    from ftis.lab.harness.coordinator import VOCAB as TOKENIZER_VOCAB
    from ftis.lab.harness.coordinator import load_tokenizer

    tok = load_tokenizer()

    def encode(text):
        return tok.encode(text).ids

    def decode(ids):
        return tok.decode(ids, skip_special_tokens=False)

    lease = _lease("What is: 12 + 7 - 30 =")
    b = mutations.computed_bundle(lease, "n" * 32, CARD, [1, 2], "prompt", "-11", encode,
                                  decode, random.Random(0), eos_ids=(2,))
    assert len(b.completions) == G and b.task_id == "mytask" and b.lease_id == "mylease"
    for i, c in enumerate(b.completions):
        assert c.text == decode(list(c.token_ids)) and c.token_ids[-1] == 2
        assert list(c.token_ids[:-1]) == encode(c.text.rsplit(decode([2]), 1)[0])
        assert len(c.logprobs) == len(c.token_ids)
        assert all(-1.5 <= lp <= -0.05 for lp in c.logprobs)
        assert not c.HasField("claimed_reward")
        # the scorer reads the computed answer in even completions, answer + 1 in odd ones
        expected = 1.0 if i % 2 == 0 else 0.0
        assert score_completion("chain_sum", c.text, {"answer": "-11", "metadata": {}}
                                ) == expected
    check_structure(b, BundleLimits(G, 64, TOKENIZER_VOCAB))


def test_sybil_reports_are_signed_by_each_ring_member_and_blame_the_others():
    from ftis.protocol.auth import request_digest
    from ftis.protocol.identity import verify_signature

    ring = [NodeIdentity.generate() for _ in range(3)]
    received = {"honest": ["b1", "b2"], ring[0].node_id: ["b3"]}
    reqs = mutations.sybil_reports(ring, received, G, step=4, now_ms=1234)
    assert [r.node_id for r in reqs] == [i.node_id for i in ring]
    for ident, req in zip(ring, reqs, strict=True):
        assert req.auth.timestamp_ms == 1234 and req.step == 4
        assert verify_signature(ident.public_key, req.auth.signature,
                                request_digest("ReportMetrics", 1234, req))
        (fb,) = req.feedback  # ring members are left out
        assert fb.sender_node_id == "honest" and list(fb.bundle_ids) == ["b1", "b2"]
        assert (fb.invalid_bundles, fb.text_mismatches, fb.mean_log_ratio) == (2, 2 * G, 25.0)


def test_reward_liar_claims_one_and_leaves_the_input():
    b = _bundle()
    out = mutations.lie_rewards(b)
    assert [c.claimed_reward for c in out.completions] == [1.0] * G
    assert [c.claimed_reward for c in b.completions] == [0.0] * G
    assert [list(c.token_ids) for c in out.completions] == \
        [list(c.token_ids) for c in b.completions]


def test_logprob_inflate_moves_logprobs_towards_zero():
    b = _bundle()
    out = mutations.scale_logprobs(b, 0.05)
    for orig, new in zip(_lps(b), _lps(out), strict=True):
        assert len(orig) == len(new)
        for lp, q in zip(orig, new, strict=True):
            assert q == pytest.approx(lp * 0.05, rel=1e-5, abs=1e-7)
            assert lp < q <= 0.0 and math.isfinite(q)
    with pytest.raises(ValueError):
        mutations.scale_logprobs(b, 1.5)


def test_logprob_deflate_subtracts_nats_per_token():
    b = _bundle()
    out = mutations.shift_logprobs(b, 5.0)
    for orig, new in zip(_lps(b), _lps(out), strict=True):
        assert [q - lp for lp, q in zip(orig, new, strict=True)] == \
            pytest.approx([-5.0] * len(orig), abs=1e-5)
    # receivers' per-token log-ratio lp_learner - lp_gen grows by 5 nats: exp(5) >> C = 2
    assert math.exp(5.0) > 2.0


def test_deflated_and_inflated_bundles_still_pass_structure_checks():
    limits = BundleLimits(G, 8, VOCAB)
    check_structure(mutations.shift_logprobs(_bundle(), 5.0), limits)
    check_structure(mutations.scale_logprobs(_bundle(), 0.05), limits)


def test_text_mismatch_keeps_tokens_and_claims_the_answer():
    b = _bundle()
    text = mutations.answer_text("3")
    assert score_completion("letter_counting", text, {"question": "", "answer": "3",
                                                      "metadata": {}}) == 1.0
    out = mutations.replace_text(b, text)
    assert all(c.text == text for c in out.completions)
    assert all(c.claimed_reward == 1.0 for c in out.completions)
    assert [list(c.token_ids) for c in out.completions] == \
        [list(c.token_ids) for c in b.completions]


def test_fabricated_prompt_replaces_prompt_only():
    b = _bundle()
    out = mutations.fabricate_prompt(b, [9, 9, 9], "made up")
    assert list(out.prompt_token_ids) == [9, 9, 9] and out.prompt_text == "made up"
    assert out.task_id == b.task_id and out.lease_id == b.lease_id
    assert list(b.prompt_token_ids) == [1, 5, 6, 7]


@pytest.mark.parametrize("group_size", [2, G, 7])
def test_copy_under_lease_rebinds_a_victims_bundle(group_size):
    victim = _bundle(3, node_id="v" * 32)
    lease = _lease(group_size=group_size)
    out = mutations.copy_under_lease(victim, lease, "a" * 32, CARD, 4, 99)
    assert (out.task_id, out.lease_id, out.node_id) == ("mytask", "mylease", "a" * 32)
    assert out.policy_version == 4 and out.created_at_ms == 99
    assert list(out.prompt_token_ids) == list(victim.prompt_token_ids)  # verbatim prompt
    assert len(out.completions) == group_size
    assert list(out.completions[0].token_ids) == list(victim.completions[0].token_ids)
    own = mutations.copy_under_lease(victim, lease, "a" * 32, CARD, 4, 99,
                                     prompt=([1, 2], "mine"))
    assert list(own.prompt_token_ids) == [1, 2] and own.prompt_text == "mine"
    # the victim's claims are dropped: the attacker cannot score for its own lease
    assert all(c.claimed_reward == 0.0 for c in victim.completions)
    assert not any(c.HasField("claimed_reward") for c in own.completions)


def test_resealed_copy_verifies_under_the_attackers_key():
    attacker = NodeIdentity.generate()
    copy = mutations.copy_under_lease(_bundle(), _lease(), attacker.node_id, CARD, 0, 1)
    env = seal("bundle", copy, attacker)
    msg, node_id = open_envelope(env, "bundle", bundle_pb2.Bundle, 1 << 20)
    assert node_id == attacker.node_id == msg.node_id


def test_false_feedback_claims_the_worst_about_every_sender():
    fb = mutations.false_feedback({"s1": ["b1", "b2"], "s2": []}, group_size=G)
    by = {f.sender_node_id: f for f in fb}
    assert set(by) == {"s1", "s2"}
    assert by["s1"].groups == 2 and list(by["s1"].bundle_ids) == ["b1", "b2"]
    assert by["s1"].text_mismatches == 2 * G and by["s1"].invalid_bundles == 2
    assert by["s1"].mean_log_ratio == 25.0
    assert by["s1"].filtered_frac == 1.0 and by["s1"].truncated_frac == 1.0


def test_oversized_bundle_exceeds_the_limit():
    b = mutations.oversized_bundle(_lease(), "a" * 32, CARD, 5_000_000)
    assert b.ByteSize() > 5_000_000


def test_random_tokens_bundle_is_structurally_valid_and_consistent():
    lease = _lease()
    b = mutations.random_tokens_bundle(lease, "a" * 32, CARD, [1, 2], "p",
                                       decode=lambda ids: " ".join(map(str, ids)),
                                       rng=random.Random(0))
    check_structure(b, BundleLimits(G, 8, VOCAB))
    for c in b.completions:
        assert c.text == " ".join(map(str, c.token_ids))
        assert not c.HasField("claimed_reward")
        assert all(lp == pytest.approx(-math.log(VOCAB)) for lp in c.logprobs)


EXPECTED_GARBAGE = {
    "bad_signature": ErrorCode.SIGNATURE_INVALID,
    "short_public_key": ErrorCode.ENVELOPE_MALFORMED,
    "signed_random_payload": ErrorCode.PAYLOAD_MALFORMED,
    "unknown_payload_type": ErrorCode.PAYLOAD_TYPE_INVALID,
    "register_payload_as_bundle": ErrorCode.PAYLOAD_TYPE_INVALID,
    "nan_logprob": ErrorCode.LOGPROB_NOT_FINITE,
    "positive_logprob": ErrorCode.LOGPROB_POSITIVE,
    "token_out_of_vocab": ErrorCode.TOKEN_OUT_OF_VOCAB,
    "empty_completion": ErrorCode.COMPLETION_EMPTY,
    "logprob_count_mismatch": ErrorCode.LOGPROB_COUNT_MISMATCH,
}


def test_garbage_envelopes_each_fail_with_their_code():
    ident = NodeIdentity.generate()
    b = _bundle(node_id=ident.node_id)
    seen = {}
    for label, env in mutations.garbage_envelopes(b, ident, random.Random(0)):
        with pytest.raises(FtisError) as err:
            msg, _ = open_envelope(env, "bundle", bundle_pb2.Bundle, 1 << 20)
            check_structure(msg, BundleLimits(G, 8, VOCAB))
        seen[label] = err.value.code
    assert seen == EXPECTED_GARBAGE


# -- node classes (their mutate hooks, without a coordinator) -------------------------------
class _Conn:
    node_id = "a" * 32
    identity = NodeIdentity.generate()


#: Attributes of the wrapped VolunteerNode (``attacker.node``), not of the attacker.
_NODE_ATTRS = {"conn", "policy", "round", "config", "pool", "learner", "sampling"}


def _node(cls, tiny_policy=None, **attrs):
    """An attacker of class ``cls`` around a stand-in for its VolunteerNode (whose
    ``__init__`` builds a learner and needs a connection)."""
    node = cls.__new__(cls)
    node.options = AttackOptions()
    node.rng = random.Random(0)
    node.lease_index = 0
    node.accepted_envelopes = []
    node._variant = "own"
    wrapped = {"conn": _Conn(), "policy": tiny_policy, "round": 0, "config": None}
    node.node = SimpleNamespace(**{**wrapped, **{k: v for k, v in attrs.items()
                                                 if k in _NODE_ATTRS}})
    node.__dict__.update({k: v for k, v in attrs.items() if k not in _NODE_ATTRS})
    return node


def test_attackers_wrap_the_node_by_composition():
    assert all(not issubclass(cls, VolunteerNode) for cls in NODE_CLASSES.values())
    for cls in NODE_CLASSES.values():  # each implements the node's hooks
        assert callable(cls.bundle) and callable(cls.submit) and callable(cls.feedback)


def test_text_mismatch_node_writes_a_guessed_answer():
    node = _node(TextMismatchNode)
    out = node.mutate(_bundle(), _lease(), [1], "p")
    assert all(c.text == f"The final answer is <answer>{TextMismatchNode.GUESS}</answer>"
               and c.claimed_reward == 1.0 for c in out.completions)


def test_fabricated_prompt_node_tokenizes_another_question(tiny_policy_factory):
    policy = tiny_policy_factory()
    node = _node(FabricatedPromptNode, policy)
    lease = _lease()
    real_ids, _ = policy.prompt_token_ids(render_messages(lease.question))
    out = node.mutate(_bundle(), lease, real_ids, "p")
    assert list(out.prompt_token_ids) != real_ids
    assert lease.question not in policy.tokenizer.decode(list(out.prompt_token_ids))
    assert node.options.fake_question in out.prompt_text


def test_replay_node_submits_own_then_copies(tiny_policy_factory):
    policy = tiny_policy_factory()
    victim = _bundle(5, node_id="v" * 32)
    node = _node(ReplayNode, policy, stolen=[(swarm_pb2.RelayedBundle(), victim)],
                 config=None, round=2)
    lease = _lease()
    ids, text = policy.prompt_token_ids(render_messages(lease.question))
    sampled = [type("S", (), {"token_ids": [5, 6], "logprobs": [-1.0, -2.0],
                              "finish_reason": 2})() for _ in range(G)]
    node.node.sampling = type("S", (), {"to_proto": lambda self: victim.sampling})()
    variants, bundles = [], []
    for _ in range(3):
        honest = VolunteerNode.make_bundle(node.node, lease, ids, text, sampled)
        bundles.append(node.bundle(honest, lease, ids, text))
        variants.append(node._variant)
    assert variants == ["own", "copy_own_prompt", "copy_verbatim"]
    own, own_prompt, verbatim = bundles
    assert [list(c.token_ids) for c in own.completions] == [[5, 6]] * G
    assert list(verbatim.prompt_token_ids) == list(victim.prompt_token_ids)
    assert list(own_prompt.prompt_token_ids) == ids
    for b in (verbatim, own_prompt):
        assert b.lease_id == "mylease" and b.node_id == node.conn.node_id
        assert list(b.completions[0].token_ids) == list(victim.completions[0].token_ids)
    node.node.round, node.lease_index = 0, 0  # no verbatim copies (they get banned) before round 3
    assert [node.variant(i) for i in range(3)] == ["own", "copy_own_prompt", "copy_own_prompt"]


def test_false_reporter_reports_every_sender_it_heard_from(tmp_path):
    log = AttackLog(tmp_path / "attack.jsonl", "false_reporter", "a" * 32)
    groups = [RolloutGroup(prompt_ids=[1], completions=[[2]], gen_logprobs=[[-1.0]],
                           rewards=[1.0], local=False, sender=s, meta={"bundle_id": b})
              for s, b in (("s1", "b1"), ("s2", "b2"), ("s1", "b3"))]

    class Pool:
        def __init__(self):
            self.groups = [groups[2]]

        def drain_rejections(self):
            from collections import Counter
            return Counter(), Counter()

        def drain_rejected_ids(self):
            return {}

    class Learner:
        sender_stats = {}

    node = _node(FalseReporterNode, attack_log=log, pool=Pool(), learner=Learner(),
                 config=type("C", (), {"group_size": G})())
    honest = VolunteerNode.feedback(node.node, groups[:2])  # drains the pool's counters
    fb = {f.sender_node_id: f for f in node.feedback(groups[:2], honest)}
    assert set(fb) == {"s1", "s2"}
    assert sorted(fb["s1"].bundle_ids) == ["b1", "b3"]
    assert fb["s2"].text_mismatches == G and fb["s2"].mean_log_ratio == 25.0
    events = [e["event"] for e in read_attack_log(tmp_path / "attack.jsonl")]
    assert events == ["received", "feedback"]


def test_attack_cli_takes_every_start_flag():
    import inspect

    from ftis.client.cli import start
    from ftis.lab.cli import attack

    params = inspect.signature(attack.attack).parameters
    assert set(inspect.signature(start.start).parameters) <= set(params)
    assert {"kind", "inflate_factor", "deflate_nats", "sybils", "wait_for"} <= set(params)


# -- experiment bookkeeping -----------------------------------------------------------------
def test_round_at_and_first_flagged():
    from ftis.lab.experiment.security import first_flagged, round_at

    honest = {"a": [{"time": 10.0}, {"time": 20.0}, {"time": 30.0}],
              "b": [{"time": 12.0}, {"time": 25.0}, {"time": 31.0}]}
    assert round_at(5.0, honest) == 1
    assert round_at(21.0, honest) == 2  # b has done only 1 round
    assert round_at(40.0, honest) == 4
    st = {"quarantined": False, "banned": False}
    timeline = [(1.0, {"x": st}), (2.0, {"x": {**st, "quarantined": True}}),
                (3.0, {"x": {"quarantined": True, "banned": True}})]
    assert first_flagged(timeline, "x") == (2.0, 3.0)
    assert first_flagged(timeline, "y") == (None, None)


def _record(**kw):
    base = {"kind": "reward_liar", "rounds": 5, "banned_end": False, "quarantined_end": False,
            "banned_round": None, "quarantined_round": None, "detected_round": None,
            "submissions": 3, "accepted": 3, "bad_accepted": 3, "expected_codes_seen": [],
            "codes": {}, "attacker_groups_learned": 0,
            "attacker_groups_learned_after_detection": 0, "quarantined_bundles_learned": 0,
            "false_positives": 0, "honest_reward_mean": 0.1, "baseline_reward_mean": 0.12,
            "honest_reward": [0.1, 0.1], "sybils_admitted": 0, "sybils_attempted": 0,
            "sybils_leased": 0}
    return {**base, **kw}


def test_verdicts_and_table(tmp_path):
    from ftis.lab.experiment.security import markdown_table, plot_rewards, verdict

    assert verdict(_record(banned_round=2, detected_round=2)) == "banned"
    assert verdict(_record(quarantined_end=True)) == "quarantined"
    assert verdict(_record(kind="fabricated_prompt", accepted=0, bad_accepted=0,
                           expected_codes_seen=["PROMPT_MISMATCH"])) == "rejected"
    assert verdict(_record()) == "missed"
    assert verdict(_record(kind="sybil_burst", submissions=0,
                           codes={"register:REGISTRATION_THROTTLED": 40})) == "throttled"
    recs = [_record(detected_round=2, banned_round=2), _record(kind="replay", detected_round=9)]
    for r in recs:
        r["verdict"] = verdict(r)
    table = markdown_table(recs)
    assert table.count("\n") == 3 and "| reward_liar | banned | 2 |" in table
    assert "| replay | banned | >5 |" not in table and ">5" in table
    png = plot_rewards(recs, [0.1, 0.2], tmp_path / "r.png")
    assert png.stat().st_size > 1000


def test_attack_log_roundtrip(tmp_path):
    log = AttackLog(tmp_path / "x" / "attack.jsonl", "replay", "id")
    log.write("submit", 1, code=0)
    log.write("submit", 2, code=124, code_name="BUNDLE_REPLAYED")
    recs = read_attack_log(tmp_path / "x" / "attack.jsonl")
    assert [r["round"] for r in recs] == [1, 2] and recs[1]["code_name"] == "BUNDLE_REPLAYED"
    assert json.loads(Path(tmp_path / "x" / "attack.jsonl").read_text().splitlines()[0])[
        "kind"] == "replay"
    assert read_attack_log(tmp_path / "missing.jsonl") == []


# -- the replay_frame attack against the coordinator in-process ------------------------------
def test_third_party_replay_of_a_relayed_envelope_does_not_hurt_the_signer():
    from ftis.lab.harness.coordinator import build_bundle, make_coordinator, register

    coord = make_coordinator(bundles_per_minute=10)
    victim = register(coord)
    (lease,) = coord.lease_tasks(victim.node_id, 1, 2, 16)
    relayed = seal("bundle", build_bundle(lease, victim), victim)
    coord.submit_bundle(relayed)
    codes = []
    for _ in range(20):  # what an attacker does with the victim's relayed envelope
        with pytest.raises(FtisError) as err:
            coord.submit_bundle(relayed)
        codes.append(err.value.code)
    assert ErrorCode.BUNDLE_REPLAYED in codes
    assert not [e for e in coord.evidence(victim.node_id) if e.weight < 0]
    (lease2,) = coord.lease_tasks(victim.node_id, 1, 2, 16)
    coord.submit_bundle(seal("bundle", build_bundle(lease2, victim, seed=1), victim))


def test_security_swarm_config_seeds_the_honest_nodes_for_the_audit(tmp_path: Path) -> None:
    """Each swarm gets a per-run copy of the coordinator config with the Heartbeat quota
    raised for the harness's probes and, with ``--audit-reporters k``,
    ``reputation.audit_reporters`` = k and the honest ids as ``audit_seed_nodes``, keeping
    the rest."""
    from ftis.coordinator.config import load_config
    from ftis.lab.experiment.security import swarm_config

    base = tmp_path / "coordinator.json"
    base.write_text(json.dumps({"tasks": [{"dataset": "letter_counting"}], "task_seed": 1,
                                "reputation": {"probation_bundles": 4}}))
    run = tmp_path / "run"
    run.mkdir()
    plain = load_config(swarm_config(base, run, 0, ["b", "a"]))
    assert plain.heartbeats_per_minute == 600 and plain.reputation.audit_reporters == 0
    assert plain.audit_seed_nodes == [] and plain.reputation.probation_bundles == 4
    path = swarm_config(base, run, 2, ["b" * 32, "a" * 32])
    assert path == run / "coordinator.json"
    cfg = load_config(path)
    assert cfg.reputation.audit_reporters == 2 and cfg.reputation.probation_bundles == 4
    assert cfg.audit_seed_nodes == ["a" * 32, "b" * 32] and cfg.task_seed == 1
