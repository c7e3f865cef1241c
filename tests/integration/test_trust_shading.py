"""Issue 13, class 4, played over the real gRPC protocol against a real coordinator with
honest nodes alongside (:mod:`trust_swarm`).

Class 4: a sender that lowers every sampler log-prob by ln C (C = 2, 0.693 nats/token)
doubles its importance weight in every receiver, and the receivers' feedback *raised* its
reputation (|mean log-ratio| 0.693 is within the old 1.5 tolerance). Here two established
honest receivers pull the bundles of an honest sender and of a shading one, train on them
with the real learner and a tiny random model (the senders' log-probs are that model's),
and report what a real receiver reports (``runner.sender_feedback``). The shader ends
with negative evidence from both, is disputed (its verified bundles earn nothing), and
the honest sender, reported the same way, gains reputation.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from ftis.client.learner.trainer import Learner, LearnerConfig
from ftis.client.node.runner import sender_feedback
from ftis.client.swarm.external_pool import ExternalPool
from ftis.coordinator import reputation
from ftis.lab.harness.coordinator import VOCAB, load_tokenizer, tokenizer_fp
from ftis.lab.harness.trust_swarm import Node, Swarm, card_model, model_bundle, running_swarm
from ftis.v1 import swarm_pb2

pytestmark = pytest.mark.integration

#: the shading of the review: every sampler log-prob lowered by ln C with C = 2
SHADE_NATS = math.log(2.0)
#: bundles (of G = 2 completions) each sender has relayed before the receivers report
SENDER_BUNDLES = 6


@pytest.fixture
def swarm(tmp_path: Path) -> Iterator[Swarm]:
    # full weight at once for established reporters: the test runs for seconds
    with running_swarm(tmp_path, reputation={"reporter_maturity_s": 0}) as world:
        yield world


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    """The model card's weights (:func:`card_model`)."""
    return card_model()


def _submit(node: Node, model: torch.nn.Module, n: int, shade: float = 0.0) -> list[str]:
    ids = []
    for lease in node.lease(n):
        reply = node.submit_bundle(model_bundle(node, lease, model, shade))
        assert reply.error.code == 0, reply.error
        ids.append(reply.bundle_id)
    return ids


def _receive_and_report(receiver: Node, model: torch.nn.Module,
                        senders: set[str]) -> dict[str, swarm_pb2.SenderFeedback]:
    """What a real receiver does with the relay: re-verify each bundle (ExternalPool),
    train one step on the senders' groups, report ``sender_feedback``. (A's bundles carry
    placeholder log-probs, not the model's, so they are left to :meth:`Swarm.honest_round`.)"""
    tok = load_tokenizer()
    pool = ExternalPool(receiver.node_id, VOCAB, tokenizer_fp(),
                        decode=lambda ids: tok.decode(ids, skip_special_tokens=False))
    for relayed in receiver.pull().bundles:
        pool.add(relayed)
    groups = [g for g in pool.take(len(pool.groups)) if g.sender in senders]
    learner = Learner(model, LearnerConfig(), pad_token_id=0)
    learner.step(groups)
    invalid, mismatched = pool.drain_rejections()
    feedback = sender_feedback(learner.sender_stats, groups, invalid, mismatched,
                               pool.drain_rejected_ids())
    reply = receiver.report(*feedback)
    assert reply.error.code == 0 and not reply.dropped_feedback, reply
    return {f.sender_node_id: f for f in feedback}


def _feedback_rows(swarm: Swarm, node: Node) -> list:
    return [e for e in swarm.server.state.list_evidence(node.node_id, 1000)
            if e.kind == reputation.FEEDBACK]


def test_class4_shaded_logprobs_are_reported_and_disputed(swarm: Swarm, model) -> None:
    import copy

    receivers = [swarm.attacker(), swarm.attacker()]  # honest receivers, like B
    for r in receivers:  # established reporters: 5 verified bundles each
        _submit(r, model, 5)
    honest, shader = swarm.attacker(), swarm.attacker()
    _submit(honest, model, SENDER_BUNDLES)
    _submit(shader, model, SENDER_BUNDLES, shade=SHADE_NATS)
    before = swarm.honest_standing()
    honest_before, _ = swarm.standing(honest)
    shader_before, _ = swarm.standing(shader)

    reports = [_receive_and_report(r, copy.deepcopy(model), {honest.node_id, shader.node_id})
               for r in receivers]
    cfg = swarm.server.ctx.policy
    for report in reports:
        h, s = report[honest.node_id], report[shader.node_id]
        assert h.log_ratio_completions == s.log_ratio_completions == 2 * SENDER_BUNDLES
        assert s.mean_log_ratio - h.mean_log_ratio == pytest.approx(SHADE_NATS, abs=1e-4)
        assert abs(s.mean_log_ratio) < cfg.log_ratio_tolerance  # praise under the old rule
        assert s.log_ratio_stderr < 0.01 and len(s.bundle_ids) == SENDER_BUNDLES

    blame = _feedback_rows(swarm, shader)
    assert len(blame) == 2 and all(e.weight < 0 for e in blame)
    assert {e.reporter_node_id for e in blame} == {r.node_id for r in receivers}
    assert all("negative" in e.detail and "stderr" in e.detail for e in blame)
    score, _ = swarm.standing(shader)
    assert score < shader_before
    # two established reporters agree: disputed, its next verified bundle earns nothing
    _submit(shader, model, 1, shade=SHADE_NATS)
    last = swarm.server.state.list_evidence(shader.node_id, 1000)
    newest = max((e for e in last if e.kind == reputation.BUNDLE_VERIFIED),
                 key=lambda e: e.id)
    assert newest.weight == 0.0 and "disputed" in newest.detail
    assert swarm.standing(shader)[0] <= score + 1e-9

    # the honest sender, reported the same way by the same receivers, gains
    praise = _feedback_rows(swarm, honest)
    assert len(praise) == 2 and all(e.weight > 0 for e in praise)
    score, quarantined = swarm.standing(honest)
    assert score > honest_before and not quarantined
    for r in receivers:  # the reporters were not charged for anything
        assert all(e.weight > 0 for e in swarm.server.state.list_evidence(r.node_id, 1000))
    swarm.assert_honest_kept_their_reputation(before)
