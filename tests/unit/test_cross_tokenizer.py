"""Cross-tokenizer learning (DESIGN.md section 6): sequence-level weights, re-tokenization,
and a learner step on another family's completions, checked against hand computations."""

from __future__ import annotations

import math
import random

import pytest
import torch

from ftis.client.learner.loss import (
    LossConfig,
    sequence_importance_weights,
    sequence_level_divergence,
    sequence_level_policy_loss,
)
from ftis.client.swarm.cross_tokenizer import (
    Retokenizer,
    retokenizer_for,
    split_termination,
)
from ftis.client.swarm.external_pool import ExternalPool
from ftis.protocol.envelope import seal
from ftis.protocol.identity import NodeIdentity
from ftis.tasks import render_messages
from ftis.v1 import bundle_pb2, swarm_pb2

E = math.e
STOP, LENGTH = bundle_pb2.FINISH_REASON_STOP, bundle_pb2.FINISH_REASON_LENGTH


# ----------------------------------------------------------------- pure functions


def test_sequence_weights_by_method():
    old = torch.tensor([-3.0, -5.0, -2.0])
    gen = torch.tensor([-4.0, -3.0, -2.0])  # log ratios 1, -2, 0
    torch.testing.assert_close(sequence_importance_weights(old, gen, "tis", 2.0),
                               torch.tensor([2.0, E**-2, 1.0]))
    torch.testing.assert_close(sequence_importance_weights(old, gen, "ftis", 3.0),
                               torch.tensor([E, E**-2, 1.0]))
    torch.testing.assert_close(sequence_importance_weights(old, gen, "vis", 2.0),
                               torch.tensor([E, E**-2, 1.0]))
    assert sequence_importance_weights(old, gen, "nois").tolist() == [1.0, 1.0, 1.0]
    # huge log-ratios are clamped, never inf
    w = sequence_importance_weights(torch.tensor([0.0]), torch.tensor([-500.0]), "vis")
    assert math.isfinite(w.item()) and w.item() == pytest.approx(math.exp(20), rel=1e-5)


def test_sequence_divergence_hand_values():
    old = torch.tensor([-3.0, -5.0, -2.0])
    gen = torch.tensor([-4.0, -3.0, -2.0])  # R = e, e^-2, 1
    torch.testing.assert_close(sequence_level_divergence(old, gen, "kl_learner_gen"),
                               torch.tensor([1.0, 1 - 3 * E**-2, 0.0]))
    torch.testing.assert_close(sequence_level_divergence(old, gen, "kl_gen_learner"),
                               torch.tensor([E - 2, E**-2 + 1, 0.0]))
    # per-token: x = (S_old - S_gen) / n with n = 2, 4, 1 -> x = 0.5, -0.5, 0
    n = torch.tensor([2.0, 4.0, 1.0])
    torch.testing.assert_close(sequence_level_divergence(old, gen, "k1_mean", n),
                               torch.tensor([-0.5, 0.5, 0.0]))
    # k3(x) = e^x - 1 - x: e^0.5 - 1.5 = 0.1487212707 ; e^-0.5 - 0.5 = 0.1065306597
    torch.testing.assert_close(sequence_level_divergence(old, gen, "k3_mean", n),
                               torch.tensor([0.1487212707, 0.1065306597, 0.0]))
    with pytest.raises(ValueError):
        sequence_level_divergence(old, gen, "tv")
    with pytest.raises(ValueError):  # a per-token statistic needs the token counts
        sequence_level_divergence(old, gen, "k1_mean")


@pytest.mark.parametrize("n", [1, 8, 30, 64, 512])
def test_cross_tokenizer_gate_fires_at_per_token_log_ratio_minus_2(n):
    # S_old - S_gen = -2 n: k1 mean (S_gen - S_old) / n = 2 >= delta = 1, at every length
    # (the summed log-ratio -2 n is far beyond the old [-20, 20] clamp for n > 10)
    lp_old = torch.full((2, n), -1.0)
    s_gen = torch.full((2,), -1.0 * n + 2.0 * n)
    mask = torch.ones(2, n, dtype=torch.bool)
    adv = torch.tensor([-1.0, 1.0])
    out = sequence_level_policy_loss(lp_old.clone(), lp_old, s_gen, adv, mask, LossConfig())
    assert out.per_completion.filtered.tolist() == [True, False]  # only the negative one
    torch.testing.assert_close(out.per_completion.k1_mean, torch.tensor([2.0, 2.0]))
    torch.testing.assert_close(out.per_completion.log_ratio_sum,
                               torch.tensor([-2.0 * n, -2.0 * n]))
    # the legacy sequence-level kl_learner_gen is at most 1 nat as R -> 0: with g = 50 it
    # never fires, which made cross-family F-TIS plain TIS
    legacy = LossConfig(divergence="kl_learner_gen", filter_threshold=50.0)
    out = sequence_level_policy_loss(lp_old.clone(), lp_old, s_gen, adv, mask, legacy)
    assert not out.per_completion.filtered.any()
    assert (out.per_completion.divergence <= 1.0).all()
    # a per-token log-ratio of -0.5 stays under delta
    s_gen = torch.full((2,), -0.5 * n)
    out = sequence_level_policy_loss(lp_old.clone(), lp_old, s_gen, adv, mask, LossConfig())
    assert not out.per_completion.filtered.any()


def test_sequence_level_loss_and_gradient_hand_computed():
    # two completions of the receiver's tokens: lengths 2 and 1
    lp_old = torch.tensor([[-1.0, -2.0], [-2.0, 0.0]])
    mask = torch.tensor([[1, 1], [1, 0]], dtype=torch.bool)
    seq_gen = torch.tensor([-4.0, -1.0])  # S_old = -3, -2 -> log R = 1, -1
    adv = torch.tensor([1.0, -1.0])
    lp_theta = lp_old.clone().requires_grad_(True)
    cfg = LossConfig(method="tis", truncation=2.0)
    out = sequence_level_policy_loss(lp_theta, lp_old, seq_gen, adv, mask, cfg)
    loss, stats = out.loss, out.values
    w = [2.0, E**-1]  # min(e, 2), e^-1
    expected = -(w[0] * 1 * 2 + w[1] * -1 * 1) / 3
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    loss.backward()
    torch.testing.assert_close(lp_theta.grad,
                               torch.tensor([[-w[0] / 3, -w[0] / 3], [w[1] / 3, 0.0]]))
    assert stats["is_weight_mean"].item() == pytest.approx((2 * w[0] + w[1]) / 3, abs=1e-6)
    assert stats["is_weight_raw_max"].item() == pytest.approx(E, abs=1e-5)
    assert stats["truncated_frac"].item() == pytest.approx(2 / 3)  # both tokens of seq 0
    # logratio_gen_mean: token-weighted mean of S_old - S_gen = (1 + 1 - 1) / 3
    assert stats["logratio_gen_mean"].item() == pytest.approx(1 / 3, abs=1e-6)
    # k1 means (S_gen - S_old) / n = -1 / 2, 1 / 1 ; sequence mean 0.25
    torch.testing.assert_close(out.per_completion.k1_mean, torch.tensor([-0.5, 1.0]))
    assert stats["k1_mean"].item() == pytest.approx(0.25)
    assert out.per_completion.tokens.tolist() == [2, 1]
    assert out.per_completion.truncated_tokens.tolist() == [2, 0]

    # nois: weight 1 everywhere
    loss_nois = sequence_level_policy_loss(lp_old.clone(), lp_old, seq_gen, adv, mask,
                                           LossConfig(method="nois")).loss
    assert loss_nois.item() == pytest.approx(-(1 * 2 - 1) / 3, abs=1e-6)


def test_sequence_level_filter_drops_far_negative_samples():
    lp_old = torch.tensor([[-1.0, -1.0], [-1.0, -1.0]])
    mask = torch.ones(2, 2, dtype=torch.bool)
    seq_gen = torch.tensor([0.0, 0.0])  # S_old = -2: R = e^-2, D = 1 - 3e^-2 = 0.594
    adv = torch.tensor([1.0, -1.0])
    # default gate: k1 mean (0 - (-2)) / 2 = 1 >= delta = 1 ; legacy with g = 0.5 alike
    for cfg in (LossConfig(method="ftis"),
                LossConfig(divergence="kl_learner_gen", filter_threshold=0.5)):
        out = sequence_level_policy_loss(lp_old.clone(), lp_old, seq_gen, adv, mask, cfg)
        stats = out.values
        assert stats["filtered_frac"].item() == 0.5  # only the negative one
        assert out.per_completion.filtered.tolist() == [False, True]
        assert out.loss.item() == pytest.approx(-(E**-2) * 2 / 4, abs=1e-6)
        assert stats["divergence_mean"].item() == pytest.approx(1 - 3 * E**-2, abs=1e-6)
        assert stats["k1_mean"].item() == pytest.approx(1.0)


# ----------------------------------------------------------------- termination


@pytest.mark.parametrize(("text", "reason", "expected"), [
    ("The answer is 7.<|im_end|>", STOP, ("The answer is 7.", True)),
    (" 3 + 4 = 7<eos>", STOP, (" 3 + 4 = 7", True)),
    (" 3 + 4 = 7\nQuestion:", STOP, (" 3 + 4 = 7", True)),
    (" 7\nQuestion: what is", STOP, (" 7", True)),
    ("a <b> c</s>", STOP, ("a <b> c", True)),
    ("7<end_of_turn><eos>", STOP, ("7", True)),
    ("no marker", STOP, ("no marker", True)),
    ("cut off mid <|im_end|>", LENGTH, ("cut off mid <|im_end|>", False)),
])
def test_split_termination(text, reason, expected):
    assert split_termination(text, reason) == expected


def test_retokenizer_termination_by_format():
    enc = {"7": [7], "7\nQuestion:": [7, 8, 9]}
    chat = Retokenizer(prompt_ids=lambda q: [1], encode=lambda t: enc[t], eos_token_id=2)
    plain = Retokenizer(prompt_ids=lambda q: [1], encode=lambda t: enc[t], eos_token_id=2,
                        stop_text="\nQuestion:")
    assert chat.completion_ids("7", True) == [7, 2]
    assert chat.completion_ids("7", False) == [7]
    assert chat.completion_ids("", True) == [2]
    assert plain.completion_ids("7", True) == [7, 8, 9]
    assert plain.completion_ids("7", False) == [7]


# ------------------------------------------------- two tiny models, two vocabularies


@pytest.fixture(scope="module")
def two_families(tmp_path_factory):
    from ftis.client.models.loader import load_policy
    from ftis.client.models.tiny import build_tiny_model

    root = tmp_path_factory.mktemp("families")
    a = build_tiny_model(root / "gen", vocab_size=300, seed=1)
    b = build_tiny_model(root / "recv", vocab_size=380, seed=2,
                         seed_text="seventeen plus twenty answers questions quickly")
    torch.manual_seed(0)
    return load_policy(str(a)), load_policy(str(b))


def _foreign_bundle(gen, identity, question, rewards):
    from ftis.client.rollout.sampler import SamplingSettings, sample_groups

    prompt_ids, prompt_text = gen.prompt_token_ids(render_messages(question))
    settings = SamplingSettings(temperature=1.0, max_new_tokens=6)
    result = sample_groups(gen.model, [prompt_ids], len(rewards), settings,
                           gen.eos_token_ids, gen.tokenizer.pad_token_id,
                           torch.Generator().manual_seed(3))
    completions = []
    for c, r in zip(result.completions[0], rewards, strict=True):
        completions.append(bundle_pb2.Completion(
            token_ids=c.token_ids, logprobs=c.logprobs, text=gen.decode(c.token_ids),
            claimed_reward=r, finish_reason=c.finish_reason))
    bundle = bundle_pb2.Bundle(
        task_id="t1", lease_id="l1", node_id=identity.node_id, model_card=gen.card,
        sampling=settings.to_proto(), prompt_token_ids=prompt_ids, prompt_text=prompt_text,
        completions=completions)
    return swarm_pb2.RelayedBundle(sequence=1, bundle_id="b1",
                                   envelope=seal("bundle", bundle, identity),
                                   verified_rewards=list(rewards), task_question=question,
                                   sender_reputation=0.5), bundle


def test_cross_family_group_weights_match_hand_computation(two_families):
    from ftis.client.learner.trainer import Learner, LearnerConfig

    gen, recv = two_families
    assert gen.card.tokenizer_fingerprint != recv.card.tokenizer_fingerprint
    assert gen.card.vocab_size != recv.card.vocab_size
    me, peer = NodeIdentity.generate(), NodeIdentity.generate()
    question = "What is 4 + 3?"
    rewards = [1.0, 0.0, 1.0, 0.0]
    relayed, bundle = _foreign_bundle(gen, peer, question, rewards)

    # without a retokenizer the foreign bundle is dropped (and not held against the sender)
    strict = ExternalPool(me.node_id, recv.card.vocab_size, recv.card.tokenizer_fingerprint)
    assert not strict.add(relayed)
    assert strict.drain_rejections() == ({}, {})

    pool = ExternalPool(me.node_id, recv.card.vocab_size, recv.card.tokenizer_fingerprint,
                        rng=random.Random(0), retokenizer=retokenizer_for(recv))
    assert pool.add(relayed) and pool.cross_tokenizer_accepted == 1
    group = pool.take(1)[0]
    assert group.cross_tokenizer and group.gen_logprobs is None
    # the receiver's own prompt for the coordinator's question, not the sender's tokens
    assert group.prompt_ids == recv.prompt_token_ids(render_messages(question))[0]
    for c, ids, s in zip(bundle.completions, group.completions, group.gen_sequence_logprobs,
                         strict=True):
        assert s == pytest.approx(sum(c.logprobs), abs=1e-6)
        content, stopped = split_termination(c.text, c.finish_reason)
        expected = recv.tokenizer(content, add_special_tokens=False)["input_ids"]
        if stopped:
            expected = [*expected, recv.tokenizer.eos_token_id]
        assert ids == expected
        assert all(0 <= t < recv.card.vocab_size for t in ids)

    # hand computation of S_old per completion with a plain full forward pass
    recv.model.eval()
    s_old = []
    with torch.no_grad():
        for ids in group.completions:
            x = torch.tensor([group.prompt_ids + ids])
            logits = recv.model(input_ids=x).logits[0, len(group.prompt_ids) - 1 : -1]
            s_old.append(float(torch.log_softmax(logits, -1)
                               .gather(-1, torch.tensor(ids)[:, None]).sum()))
    c_cap = 2.0
    # log-ratios are clamped to [-20, log C] before exp (sequence_importance_weights)
    w = [math.exp(min(max(so - sg, -20.0), math.log(c_cap)))
         for so, sg in zip(s_old, group.gen_sequence_logprobs, strict=True)]
    n_tok = [len(ids) for ids in group.completions]
    expected_mean = sum(wi * n for wi, n in zip(w, n_tok, strict=True)) / sum(n_tok)

    learner = Learner(recv.model, LearnerConfig(loss=LossConfig(method="tis", truncation=c_cap),
                                                learning_rate=1e-3, micro_batch_size=8),
                      pad_token_id=recv.tokenizer.pad_token_id)
    before = [p.detach().clone() for p in learner.params]
    metrics = learner.step([group])
    assert metrics["cross_samples_counted"] == 4
    assert metrics["cross_is_weight_mean"] == pytest.approx(expected_mean, rel=1e-4)
    assert metrics["cross_is_weight_max"] == pytest.approx(max(w), rel=1e-4)
    assert metrics["updated"] == 1.0
    assert any(not torch.equal(a, p) for a, p in zip(before, learner.params, strict=True))
    # cross-family senders are counted but their log-ratios are not reported as evidence
    st = learner.sender_stats[peer.node_id]
    assert st.completions == 4 and st.cross_tokenizer_completions == 4 and st.tokens == 0


def test_cross_family_nois_uses_weight_one(two_families):
    from ftis.client.learner.trainer import Learner, LearnerConfig

    gen, recv = two_families
    me, peer = NodeIdentity.generate(), NodeIdentity.generate()
    relayed, _ = _foreign_bundle(gen, peer, "What is 2 + 5?", [1.0, 0.0, 0.0, 1.0])
    pool = ExternalPool(me.node_id, recv.card.vocab_size, recv.card.tokenizer_fingerprint,
                        retokenizer=retokenizer_for(recv))
    assert pool.add(relayed)
    learner = Learner(recv.model, LearnerConfig(loss=LossConfig(method="ftis"),
                                                cross_tokenizer="nois", learning_rate=1e-6),
                      pad_token_id=recv.tokenizer.pad_token_id)
    metrics = learner.step(pool.take(1))
    assert metrics["cross_is_weight_mean"] == 1.0 and metrics["cross_is_weight_max"] == 1.0


def test_foreign_bundle_without_question_is_dropped(two_families):
    gen, recv = two_families
    me, peer = NodeIdentity.generate(), NodeIdentity.generate()
    relayed, _ = _foreign_bundle(gen, peer, "What is 1 + 1?", [1.0, 0.0])
    relayed.task_question = ""
    pool = ExternalPool(me.node_id, recv.card.vocab_size, recv.card.tokenizer_fingerprint,
                        retokenizer=retokenizer_for(recv))
    assert not pool.add(relayed) and pool.rejected == 1
    assert pool.drain_rejections() == ({}, {})


def test_geometric_sequence_weights_hand_computed():
    old = torch.tensor([-30.0, -4.0])
    gen = torch.tensor([-10.0, -6.0])  # log R = -20, 2 over 10 and 4 tokens
    lengths = torch.tensor([10.0, 4.0])
    torch.testing.assert_close(
        sequence_importance_weights(old, gen, "tis", 2.0, lengths),
        torch.tensor([E**-2, min(E**0.5, 2.0)]))
    # in the loss: the learner's token count is n
    lp_old = torch.tensor([[-1.0, -1.0, -1.0, -1.0]])  # S_old = -4
    mask = torch.ones(1, 4, dtype=torch.bool)
    out = sequence_level_policy_loss(
        lp_old.clone(), lp_old, torch.tensor([-8.0]), torch.tensor([1.0]), mask,
        LossConfig(method="tis", truncation=2.0), length_normalized=True)
    assert out.stats["is_weight_mean"].value.item() == pytest.approx(min(math.exp(1.0), 2.0))
    assert out.loss.item() == pytest.approx(-2.0)
