"""Learner step: micro-batching is exact, the gradient is the weighted log-likelihood one."""

import copy

import pytest
import torch

from ftis.client.learner.batch import pack
from ftis.client.learner.loss import LossConfig, group_advantages
from ftis.client.learner.trainer import Learner, LearnerConfig, groups_to_samples
from ftis.client.rollout.groups import RolloutGroup


def _groups():
    local = RolloutGroup([1, 5, 6], [[7, 8, 2], [9, 2], [10, 11, 12, 2]],
                         [[-1.0, -2.0, -0.5], [-3.0, -0.1], [-1.0, -1.0, -1.0, -1.0]],
                         [1.0, 0.0, 0.0], local=True)
    external = RolloutGroup([1, 5], [[7, 8, 2, 4], [9, 2]],
                            [[-5.0, -6.0, -5.5, -5.0], [-5.0, -5.1]], [0.0, 1.0], local=False)
    flat = RolloutGroup([1, 6], [[7, 2], [8, 2]], [[-1.0, -1.0], [-1.0, -1.0]], [1.0, 1.0],
                        local=True)
    return [local, external, flat]


def _grads_after_backward(policy, groups, micro_batch_size, method="tis", share_prompt=True):
    model = copy.deepcopy(policy.model)
    config = LearnerConfig(loss=LossConfig(method=method), learning_rate=0.0,
                           max_grad_norm=1e9, micro_batch_size=micro_batch_size,
                           share_prompt=share_prompt)
    learner = Learner(model, config, 0)
    # reproduce step() up to backward without the optimizer touching the weights
    learner.optimizer.step = lambda: None  # type: ignore[method-assign]
    grads = {}
    orig = learner.optimizer.zero_grad
    def capture(set_to_none=True):
        for n, p in model.named_parameters():
            if p.grad is not None:
                grads[n] = p.grad.clone()
        orig(set_to_none=set_to_none)
    learner.optimizer.zero_grad = capture  # type: ignore[method-assign]
    metrics = learner.step(groups)
    return metrics, grads


def _unpadded_logprobs(model, sample):
    ids = torch.tensor([sample.prompt_ids + sample.completion_ids])
    logits = model(input_ids=ids).logits[0, len(sample.prompt_ids) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(
        -1, torch.tensor(sample.completion_ids)[:, None])[:, 0]


def test_packing_aligns_completions_and_matches_unpadded_forward(tiny_policy_factory):
    pol = tiny_policy_factory()
    samples = groups_to_samples(_groups()[:2], scale_by_std=True)
    batch = pack(samples, 0)
    assert batch.targets.shape == batch.completion_mask.shape == (5, 4)
    assert batch.logits_to_keep == 5
    assert batch.completion_mask.sum(-1).tolist() == [3, 2, 4, 4, 2]
    assert batch.targets[1, :2].tolist() == [9, 2] and batch.gen_logprobs[1, 2] == 0.0
    with torch.no_grad():
        lp = Learner(pol.model, LearnerConfig(), 0)._forward_logprobs(batch)
        for i, s in enumerate(samples):
            n = len(s.completion_ids)
            torch.testing.assert_close(lp[i, :n], _unpadded_logprobs(pol.model, s),
                                       atol=1e-5, rtol=0)


def test_micro_batching_does_not_change_loss_or_gradient(tiny_policy_factory):
    pol = tiny_policy_factory()
    m1, g1 = _grads_after_backward(pol, _groups(), micro_batch_size=1)
    m8, g8 = _grads_after_backward(pol, _groups(), micro_batch_size=8)
    assert m1["loss"] == pytest.approx(m8["loss"], rel=1e-5)
    assert g1.keys() == g8.keys() and g1
    for n in g1:
        torch.testing.assert_close(g1[n], g8[n], atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("micro_batch_size", [2, 8])
def test_a_shared_prompt_forward_does_not_change_the_step(tiny_policy_factory,
                                                          micro_batch_size):
    """``share_prompt`` (each group's prompt run once, its cache repeated) against every
    completion run with its prompt: the same loss, statistics and gradient (float32)."""
    pol = tiny_policy_factory()
    shared, g_shared = _grads_after_backward(pol, _groups(), micro_batch_size)
    whole, g_whole = _grads_after_backward(pol, _groups(), micro_batch_size,
                                           share_prompt=False)
    for key in ("loss", "is_weight_mean", "truncated_frac", "external_k1_mean",
                "external_is_weight_max"):
        assert shared[key] == pytest.approx(whole[key], rel=1e-5, abs=1e-7), key
    assert g_shared.keys() == g_whole.keys() and g_shared
    for n in g_shared:
        torch.testing.assert_close(g_shared[n], g_whole[n], atol=1e-6, rtol=1e-4)


def test_zero_variance_groups_dropped_and_on_policy_ignores_external(tiny_policy_factory):
    samples = groups_to_samples(_groups(), scale_by_std=True)
    assert len(samples) == 5  # 3 local + 2 external; the all-equal group adds nothing
    pol = tiny_policy_factory()
    m, _ = _grads_after_backward(pol, _groups(), 8, method="on_policy")
    assert m["groups_external"] == 0 and m["samples"] == 3


def test_gradient_equals_weighted_log_likelihood_gradient(tiny_policy_factory):
    """With one update per batch (rho = 1, no clipping) the loss gradient must equal the
    gradient of  -(1/N) sum_i sum_t w_it * A_i * log pi(a_it)  (token aggregation)."""
    pol = tiny_policy_factory()
    groups = _groups()[:2]
    metrics, grads = _grads_after_backward(pol, groups, 8, method="tis")

    model = copy.deepcopy(pol.model)
    samples = groups_to_samples(groups, scale_by_std=True)
    # closed form, one unpadded sequence at a time (no batching, no padding, no masks)
    objective, n_tokens = 0.0, sum(len(s.completion_ids) for s in samples)
    for s in samples:
        lp = _unpadded_logprobs(model, s)
        w = torch.exp(lp.detach() - torch.tensor(s.gen_logprobs)).clamp(max=2.0)  # TIS, C = 2
        objective = objective - (w * s.advantage * lp).sum() / n_tokens
    objective.backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, atol=1e-6, rtol=1e-4)
    # advantages are the hand-checkable GRPO ones: [1,0,0] -> [sqrt2, -1/sqrt2, -1/sqrt2]
    adv = group_advantages(torch.tensor([[1.0, 0.0, 0.0]]), eps=0.0)[0]
    torch.testing.assert_close(adv, torch.tensor([2**0.5, -(0.5**0.5), -(0.5**0.5)]))


def test_step_updates_weights_and_reports(tiny_policy_factory):
    pol = tiny_policy_factory("lora")
    before = {n: p.detach().clone() for n, p in pol.model.named_parameters() if p.requires_grad}
    learner = Learner(pol.model, LearnerConfig(learning_rate=1e-2), 0)
    m = learner.step(_groups())
    assert m["updated"] == 1.0 and learner.updates == 1
    assert m["external_samples_counted"] == 2 and 0 < m["is_weight_max"] <= 2.0
    changed = [n for n, p in pol.model.named_parameters()
               if p.requires_grad and not torch.equal(p, before[n])]
    assert changed
    frozen = [p for n, p in pol.model.named_parameters() if "lora_" not in n]
    assert all(not p.requires_grad for p in frozen)


def test_sender_statistics_for_receiver_feedback(tiny_policy_factory):
    pol = tiny_policy_factory()
    groups = _groups()
    groups[1].sender = "peer"
    learner = Learner(copy.deepcopy(pol.model), LearnerConfig(learning_rate=0.0), 0)
    learner.step(groups)
    (st,) = learner.sender_stats.values()
    assert list(learner.sender_stats) == ["peer"]
    assert st.completions == 2 and st.tokens == 6
    # recompute lp_learner - lp_gen for the external group by hand
    samples = [s for s in groups_to_samples(groups, True) if not s.local]
    with torch.no_grad():
        expected = sum((_unpadded_logprobs(learner.model, s) - torch.tensor(s.gen_logprobs)).sum()
                       for s in samples) / 6
    assert st.mean_log_ratio == pytest.approx(float(expected), abs=1e-4)
    # generator log-probs of -5 per token vs a ~uniform tiny model (-log 300 = -5.7): no cap
    assert st.truncated_tokens == 0 and st.filtered == 0


def test_every_loss_statistic_is_accumulated_by_its_declared_reduction():
    """No statistic the loss produces can be dropped by the trainer (issue 11)."""
    from ftis.client.learner.loss import Reduction, policy_loss, sequence_level_policy_loss
    from ftis.client.learner.trainer import StatAccumulator

    old = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -1.0, 0.0]])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    adv = torch.tensor([1.0, -1.0])
    outs = [policy_loss(old.clone(), old, old + 0.4, adv, mask, LossConfig()),
            sequence_level_policy_loss(old.clone(), old, torch.tensor([-2.0, -9.0]), adv,
                                       mask, LossConfig())]
    for out in outs:
        acc = StatAccumulator()
        acc.add(out.stats, 5, 2)
        assert set(acc.finish()) == set(out.stats) | {"samples_counted"}
    # two micro-batches combine exactly: token means by tokens, sequence means by
    # completions, maxima by max
    a, b = outs
    acc = StatAccumulator()
    acc.add(a.stats, 5, 2)
    acc.add(b.stats, 3, 1)
    res = acc.finish()
    for name, stat in a.stats.items():
        va, vb = float(stat.value), float(b.stats[name].value)
        expected = {Reduction.TOKEN_MEAN: (5 * va + 3 * vb) / 8,
                    Reduction.SEQ_MEAN: (2 * va + 1 * vb) / 3,
                    Reduction.MAX: max(va, vb)}[stat.reduction]
        assert res[name] == pytest.approx(expected, rel=1e-6, abs=1e-7), name
    assert res["samples_counted"] == 3


def test_step_emits_every_statistic_per_partition(tiny_policy_factory):
    from ftis.client.learner.loss import policy_loss

    pol = tiny_policy_factory()
    m, _ = _grads_after_backward(pol, _groups(), 2, method="ftis")
    lp = torch.zeros(1, 1)
    names = set(policy_loss(lp, lp, lp, torch.ones(1), torch.ones(1, 1), LossConfig()).stats)
    assert {"is_weight_mean", "is_weight_max", "is_weight_raw_max", "truncated_frac",
            "filtered_frac", "divergence_mean", "clip_frac", "logratio_gen_mean",
            "k1_mean", "gate_mean", "gate_max"} == names
    for prefix in ("", "external_"):
        assert {prefix + n for n in names} | {prefix + "samples_counted"} <= set(m)
    assert not any(k.startswith("cross_") for k in m)  # no cross-tokenizer samples
    assert m["samples_counted"] == 5 and m["external_samples_counted"] == 2


def test_sender_statistics_take_the_loss_filter_decisions(tiny_policy_factory):
    """An external negative sample the learner finds very unlikely (generator log-prob 0
    vs about -log 300 = -5.7 under the tiny model: k1 mean about 5.7 >= 1) is filtered,
    and the per-sender count is the loss's own decision."""
    pol = tiny_policy_factory()
    external = RolloutGroup([1, 5], [[7, 8, 2], [9, 2]], [[0.0, 0.0, 0.0], [-5.0, -5.1]],
                            [0.0, 1.0], local=False, sender="peer")
    learner = Learner(copy.deepcopy(pol.model), LearnerConfig(learning_rate=0.0), 0)
    m = learner.step([external])
    st = learner.sender_stats["peer"]
    assert st.completions == 2 and st.filtered == 1 and st.tokens == 5
    assert m["external_filtered_frac"] == pytest.approx(0.5)
    assert m["external_gate_max"] > 4.0
    # the legacy summed gate with the paper's g = 50 keeps it: D <= 3 tokens x 1 nat
    legacy = LossConfig(divergence="kl_learner_gen", filter_threshold=50.0)
    learner = Learner(copy.deepcopy(pol.model), LearnerConfig(loss=legacy, learning_rate=0.0), 0)
    learner.step([external])
    assert learner.sender_stats["peer"].filtered == 0
    # the feedback describes the sample, whatever the method: tis does not filter, but the
    # sender's gated completion is still reported
    tis = LossConfig(method="tis")
    learner = Learner(copy.deepcopy(pol.model), LearnerConfig(loss=tis, learning_rate=0.0), 0)
    m = learner.step([external])
    assert learner.sender_stats["peer"].filtered == 1 and m["external_filtered_frac"] == 0.0


def test_sender_statistics_stay_finite_for_extreme_generator_logprobs(tiny_policy_factory):
    """Issue 13, class 5: two tokens of -FLT_MAX (finite, so a receiver of an old or
    unchecked bundle may see them) overflow the loss's float32 per-completion sum to inf;
    the receiver's per-sender statistics are float64 with the loss's per-token clamp
    (|lp_learner - lp_gen| <= 20 nats), so its ReportMetrics stays valid."""
    import math

    from ftis.client.learner.loss import policy_loss
    from ftis.v1 import swarm_pb2

    pol = tiny_policy_factory()
    flt_max = 3.4028234663852886e38
    external = RolloutGroup([1, 5], [[7, 8, 2], [9, 2]], [[-flt_max, -flt_max, -1.0],
                                                          [-5.0, -5.1]],
                            [0.0, 1.0], local=False, sender="peer")
    samples = groups_to_samples([external], scale_by_std=True)
    batch = pack(samples, 0)
    learner = Learner(copy.deepcopy(pol.model), LearnerConfig(learning_rate=0.0), 0)
    with torch.no_grad():
        lp = learner._forward_logprobs(batch)
    out = policy_loss(lp, lp, batch.gen_logprobs, batch.advantages, batch.completion_mask,
                      LossConfig())
    assert math.isinf(float(out.per_completion.log_ratio_sum.max()))  # the hazard
    learner.step([external])
    st = learner.sender_stats["peer"]
    assert st.tokens == 5 and math.isfinite(st.log_ratio_sum)
    # the two extreme tokens count 20 nats each (clamped), the others their true value
    m = batch.completion_mask
    rest = (lp.double() - batch.gen_logprobs.double())[m].clamp(max=20.0)
    assert st.log_ratio_sum == pytest.approx(float(rest.sum()), abs=1e-4)
    assert float(rest.max()) == 20.0 and (rest == 20.0).sum() == 2
    report = swarm_pb2.SenderFeedback(sender_node_id="peer", tokens=st.tokens,
                                      mean_log_ratio=st.mean_log_ratio,
                                      filtered_frac=st.filtered / st.completions,
                                      truncated_frac=st.truncated_tokens / st.tokens)
    assert all(math.isfinite(x) for x in (report.mean_log_ratio, report.filtered_frac,
                                          report.truncated_frac))


def test_cross_tokenizer_groups_carry_no_token_logprobs_and_pack():
    cross = RolloutGroup([1, 5], [[7, 8, 2], [9, 2]], None, [1.0, 0.0], local=False,
                         gen_sequence_logprobs=[-4.0, -3.0])
    assert cross.cross_tokenizer and cross.gen_logprobs is None
    # an empty list is accepted and normalised; per-token rows are refused
    assert RolloutGroup([1], [[2]], [], [1.0], local=False,
                        gen_sequence_logprobs=[-1.0]).gen_logprobs is None
    with pytest.raises(ValueError):
        RolloutGroup([1], [[2]], [[-1.0]], [1.0], local=False, gen_sequence_logprobs=[-1.0])
    with pytest.raises(ValueError):  # a token-aligned group needs its log-probs
        RolloutGroup([1], [[2]], None, [1.0], local=True)
    with pytest.raises(ValueError):
        RolloutGroup([1], [[2, 3]], [[-1.0]], [1.0], local=True)
    samples = groups_to_samples([cross], scale_by_std=False)
    assert [s.gen_logprobs for s in samples] == [None, None]
    batch = pack(samples, 0)
    assert batch.gen_logprobs is None
    torch.testing.assert_close(batch.gen_sequence_logprobs, torch.tensor([-4.0, -3.0]))
    torch.testing.assert_close(batch.advantages, torch.tensor([0.5, -0.5]))
    token = groups_to_samples(_groups()[:1], scale_by_std=False)
    with pytest.raises(ValueError):
        pack(samples + token, 0)


# -- issue 13, class 4: the receiver's statistics for the shading test -------------------


def test_log_ratio_stderr_is_the_ratio_estimators_standard_error():
    import math

    from ftis.client.learner.trainer import log_ratio_stderr

    # R = 4 / 4 = 1; residuals S - R L = -1, 1; sqrt(2/1 x 2) / 4 = 0.5
    assert log_ratio_stderr([1.0, 3.0], [2, 2]) == pytest.approx(0.5)
    # R = 4.5 / 6 = 0.75; residuals -0.25, -0.5, 0.75; sqrt(3/2 x 0.875) / 6
    assert log_ratio_stderr([0.5, 1.0, 3.0], [1, 2, 3]) == pytest.approx(
        math.sqrt(1.5 * 0.875) / 6)
    # shading every token by d moves S_i by d L_i and R by d: the spread is unchanged
    d = math.log(2)
    assert log_ratio_stderr([0.5 + d, 1.0 + 2 * d, 3.0 + 3 * d], [1, 2, 3]) == pytest.approx(
        math.sqrt(1.5 * 0.875) / 6)
    assert log_ratio_stderr([2.0], [4]) == 0.0 and log_ratio_stderr([], []) == 0.0
    with pytest.raises(ValueError):
        log_ratio_stderr([1.0], [1, 2])
    with pytest.raises(ValueError):
        log_ratio_stderr([1.0, 2.0], [1, 0])


def _sampled_group(model, prompt, n, length, sender, generator):
    """``n`` completions of ``length`` tokens drawn from ``model`` with their log-probs."""
    rows, lps = [], []
    with torch.no_grad():
        for _ in range(n):
            ids, lp = list(prompt), []
            for _ in range(length):
                logp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0, -1]
                                         .double(), -1)
                token = int(torch.multinomial(logp.exp(), 1, generator=generator))
                ids.append(token)
                lp.append(float(logp[token]))
            rows.append(ids[len(prompt):])
            lps.append(lp)
    rewards = [float(i % 2) for i in range(n)]
    return RolloutGroup(list(prompt), rows, lps, rewards, local=False, sender=sender)


def test_shaded_logprobs_give_the_receiver_a_detectable_shift(tiny_policy_factory):
    """Issue 13, class 4: a sender samples from its own (slightly different) model; an
    honest copy reports its log-probs, a shading copy the same minus ln 2 (C = 2). The
    receiver's per-sender statistics differ by exactly ln 2 nats/token with the same
    standard error, and the coordinator's test flags the shader only."""
    import math

    from ftis.client.node.runner import sender_feedback
    from ftis.coordinator.reputation import ReputationConfig, shift_detected

    pol = tiny_policy_factory()
    sender_model = copy.deepcopy(pol.model)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # the sender's own training history: a perturbed copy
        for p in sender_model.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=gen))
    honest = [_sampled_group(sender_model, [1, 5 + k], 4, 12, "honest", gen) for k in range(3)]
    shaded = [RolloutGroup(g.prompt_ids, g.completions,
                           [[lp - math.log(2.0) for lp in row] for row in g.gen_logprobs],
                           g.rewards, local=False, sender="shader") for g in honest]
    learner = Learner(copy.deepcopy(pol.model), LearnerConfig(learning_rate=0.0), 0)
    learner.step(honest + shaded)
    h, s = learner.sender_stats["honest"], learner.sender_stats["shader"]
    assert h.log_ratio_completions == s.log_ratio_completions == 12
    assert h.tokens == s.tokens == 144
    assert s.mean_log_ratio - h.mean_log_ratio == pytest.approx(math.log(2), abs=1e-5)
    assert s.log_ratio_stderr == pytest.approx(h.log_ratio_stderr, rel=1e-4)
    assert h.mean_log_ratio < 0.05 and 0 < h.log_ratio_stderr < 0.1
    cfg = ReputationConfig()
    report = {f.sender_node_id: f for f in sender_feedback(learner.sender_stats,
                                                           honest + shaded)}
    assert report["shader"].log_ratio_completions == 12
    assert report["shader"].log_ratio_stderr == pytest.approx(s.log_ratio_stderr)
    assert abs(report["shader"].mean_log_ratio) < cfg.log_ratio_tolerance  # the old rule
    verdicts = {name: shift_detected(f.mean_log_ratio, f.log_ratio_stderr,
                                     f.log_ratio_completions, cfg)
                for name, f in report.items()}
    assert verdicts == {"honest": False, "shader": True}
